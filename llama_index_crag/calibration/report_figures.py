"""What the grade report says of a scorer's out-of-sample outcome: its figures, a Markdown table and a plot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from llama_index_crag.calibration.fit import IN_CORPUS, OUT_OF_CORPUS, UNANSWERABLE, Batch
from llama_index_crag.core.grader import Verdict, band

KINDS = (IN_CORPUS, OUT_OF_CORPUS, UNANSWERABLE)


@dataclass
class Outcome:
    """Out-of-sample batch scores of one scorer, with the thresholds each score was judged by."""

    scorer: str
    normalization: str
    batches: List[Batch]
    aggregate: np.ndarray
    upper: np.ndarray
    lower: np.ndarray
    pairs_per_second: float
    strips: Optional[Dict[str, Any]] = None


def auroc(positive: np.ndarray, negative: np.ndarray) -> Optional[float]:
    if not len(positive) or not len(negative):
        return None
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score([1] * len(positive) + [0] * len(negative), np.concatenate([positive, negative])))


def figures(outcome: Outcome, cap: Optional[float] = None) -> Dict[str, Any]:
    """AUROC, accuracy and the three-band confusion matrix of one scorer's outcome; with ``cap`` (a share of the
    answering batches), what the best ``lower`` under that cap catches of each other kind (``caught_at_cap``)."""
    kinds = np.asarray([b.kind for b in outcome.batches])
    verdicts = np.asarray([band(s, u, lo).value for s, u, lo in zip(outcome.aggregate, outcome.upper, outcome.lower)])
    confusion = {k: {v.value: int(((kinds == k) & (verdicts == v.value)).sum()) for v in Verdict} for k in KINDS}
    answered = verdicts != Verdict.INCORRECT.value
    right = np.where(kinds == IN_CORPUS, answered, ~answered)
    rows: Dict[str, Any] = {}
    for other in (OUT_OF_CORPUS, UNANSWERABLE):
        mask = (kinds == IN_CORPUS) | (kinds == other)
        if (kinds == other).any():
            rows[other] = {
                "auroc": auroc(outcome.aggregate[kinds == IN_CORPUS], outcome.aggregate[kinds == other]),
                "accuracy": float(right[mask].mean()),
                "caught": float((~answered[kinds == other]).mean()),
                "batches": int(mask.sum()),
            }
    with_answer = kinds == IN_CORPUS
    at_cap = caught_at_cap(outcome.aggregate, kinds, cap) if cap is not None else None
    if at_cap is not None:
        for other, values in rows.items():
            values["caught_at_cap"] = at_cap["caught"].get(other)
    return {
        "scorer": outcome.scorer,
        "normalization": outcome.normalization,
        "rows": rows,
        "three_band_accuracy": float(right.mean()),
        # Batches with the answer graded INCORRECT: what the engine abstains on unless its fallback finds it.
        "false_reject": float((~answered[with_answer]).mean()) if with_answer.any() else None,
        "accuracy_ceiling": accuracy_ceiling(outcome.aggregate, kinds == IN_CORPUS),
        "at_cap": at_cap,
        "confusion": confusion,
        "pairs_per_second": round(outcome.pairs_per_second, 1),
        "thresholds_mean": {"upper": float(outcome.upper.mean()), "lower": float(outcome.lower.mean())},
        "batches": [
            {"qid": b.question.qid, "kind": b.kind, "score": round(float(s), 6), "verdict": v}
            for b, s, v in zip(outcome.batches, outcome.aggregate, verdicts)
        ],
    }


#: Resamples of the paired bootstrap that sets each scorer's AUROC against the default's.
BOOTSTRAP_RESAMPLES = 1000


def against_default(results: Sequence[Dict[str, Any]], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> None:
    """Add to each result but the default's, per row, its AUROC minus the default's and a 95% interval.

    The interval is a paired bootstrap by question: the same questions are drawn for both
    scorers, so what varies is which questions the two are measured on, not the scorers'
    luck on different draws. An interval that holds 0 means the two are not told apart on
    this set. Only questions both scorers graded count (the LLM judge grades a sample).
    """
    default = next((r for r in results if r.get("default")), None)
    if default is None:
        return
    rng = np.random.default_rng(seed)
    base = {(b["qid"], b["kind"]): b["score"] for b in default["batches"]}
    for result in results:
        if result is default:
            continue
        other = {(b["qid"], b["kind"]): b["score"] for b in result["batches"]}
        for row, values in result["rows"].items():
            keys = sorted(k for k in set(base) & set(other) if k[1] in (IN_CORPUS, row))
            values["against_default"] = _paired_difference(keys, base, other, rng, resamples)


def _paired_difference(
    keys: Sequence[Any], base: Mapping[Any, float], other: Mapping[Any, float], rng: Any, resamples: int
) -> Optional[Dict[str, Any]]:
    from sklearn.metrics import roc_auc_score

    labels = np.asarray([k[1] == IN_CORPUS for k in keys], dtype=int)
    if len(set(labels.tolist())) < 2:
        return None
    first, second = np.asarray([base[k] for k in keys]), np.asarray([other[k] for k in keys])
    questions = sorted({k[0] for k in keys})
    rows_of: Dict[str, List[int]] = {q: [] for q in questions}
    for i, key in enumerate(keys):
        rows_of[key[0]].append(i)
    differences = []
    for _ in range(resamples):
        rows = np.concatenate([rows_of[q] for q in rng.choice(questions, len(questions))])
        if labels[rows].min() != labels[rows].max():
            differences.append(roc_auc_score(labels[rows], second[rows]) - roc_auc_score(labels[rows], first[rows]))
    if not differences:  # every draw held one kind only: too few questions to tell
        return None
    low, high = np.percentile(differences, [2.5, 97.5])
    difference = roc_auc_score(labels, second) - roc_auc_score(labels, first)
    return {"difference": float(difference), "interval": [float(low), float(high)], "questions": len(questions)}


def accuracy_ceiling(scores: np.ndarray, answerable: np.ndarray) -> Dict[str, Optional[float]]:
    """The best three-band accuracy any single ``lower`` threshold reaches on these scores, and that threshold.

    Chosen on the very rows it is measured on, so it is a bound, not a result: it
    says whether better thresholds could reach an accuracy target or only a better
    scorer can. A batch is right when it is answerable and scores at or above the
    threshold, or not answerable and scores below it (``upper`` does not change
    whether a batch is answered).
    """
    if not len(scores):
        return {"accuracy": None, "lower": None}
    order = np.argsort(scores, kind="stable")
    ranked, positive = scores[order], answerable[order].astype(int)
    # Threshold at ranked[i]: rows before i are judged incorrect, rows from i on answered.
    negatives_below = np.concatenate([[0], np.cumsum(1 - positive)])
    positives_from = np.concatenate([np.cumsum(positive[::-1])[::-1], [0]])
    starts = np.flatnonzero(np.concatenate([[True], ranked[1:] != ranked[:-1], [True]]))
    right = negatives_below[starts] + positives_from[starts]
    best = int(np.argmax(right))
    lower = float(ranked[starts[best]]) if starts[best] < len(ranked) else float(np.nextafter(ranked[-1], np.inf))
    return {"accuracy": float(right[best] / len(scores)), "lower": lower}


def caught_at_cap(scores: np.ndarray, kinds: np.ndarray, cap: float) -> Optional[Dict[str, Any]]:
    """The highest ``lower`` that leaves at most ``cap`` of the answering batches under it, and the share of each
    other kind of batch under it.

    Like ``accuracy_ceiling``, chosen on the very rows it is measured on: a bound, not a
    result. It answers "at the false abstention a target allows, what could this score
    catch at best?": when that misses the target, no threshold reaches it and only a
    better scorer can. A batch under ``lower`` is graded INCORRECT.
    """
    answering = np.sort(scores[kinds == IN_CORPUS])
    if not len(answering):
        return None
    allowed = int(np.floor(cap * len(answering) + 1e-9))
    lower = float(answering[allowed]) if allowed < len(answering) else float(np.nextafter(answering[-1], np.inf))
    caught = {other: float((scores[kinds == other] < lower).mean()) for other in KINDS[1:] if (kinds == other).any()}
    return {"cap": cap, "lower": lower, "answering_under": float((answering < lower).mean()), "caught": caught}


def table(results: Sequence[Mapping[str, Any]]) -> str:
    """The report as a Markdown table: one row per scorer and comparison."""
    lines = [
        "| scorer | row | AUROC | against the default (95%) | accuracy | graded INCORRECT: row / with the answer "
        "| batches | three-band accuracy | ceiling | caught at the cap | pairs/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for row, values in result["rows"].items():
            shown = "-" if values["auroc"] is None else f"{values['auroc']:.3f}"
            scorer = f"{result['scorer']} (default)" if result.get("default") else result["scorer"]
            lines.append(
                f"| {scorer} | {row} | {shown} | {_against(values)} | {values['accuracy']:.3f} "
                f"| {_rejected(result, values)} | {values['batches']} | {result['three_band_accuracy']:.3f} "
                f"| {_ceiling(result)} | {_at_cap(result, values)} | {result['pairs_per_second']:.0f} |"
            )
    return "\n".join(lines)


def legend(targets: Mapping[str, Any]) -> str:
    """What the table's bounds mean, as printed under it."""
    lines = [
        "ceiling: the best three-band accuracy any single lower threshold reaches on these scores, "
        "chosen on the same rows (a bound, not a result)"
    ]
    if targets.get("max_false_reject") is not None:
        lines.append(
            "caught at the cap: the share of the row's batches under the highest lower that leaves at most "
            f"{targets['max_false_reject']:g} of the batches with the answer under it (/ the share it leaves), "
            "chosen on the same rows (a bound, not a result)"
        )
    return "\n".join(lines)


def _against(values: Mapping[str, Any]) -> str:
    found = values.get("against_default")
    if not found:
        return "-"
    low, high = found["interval"]
    return f"{found['difference']:+.3f} [{low:+.3f}, {high:+.3f}]"


def _rejected(result: Mapping[str, Any], values: Mapping[str, Any]) -> str:
    if values.get("caught") is None or result.get("false_reject") is None:
        return "-"
    return f"{values['caught']:.3f} / {result['false_reject']:.3f}"


def _ceiling(result: Mapping[str, Any]) -> str:
    value = result["accuracy_ceiling"]["accuracy"]
    return "-" if value is None else f"{value:.3f}"


def _at_cap(result: Mapping[str, Any], values: Mapping[str, Any]) -> str:
    at_cap = result.get("at_cap")
    if not at_cap or values.get("caught_at_cap") is None:
        return "-"
    return f"{values['caught_at_cap']:.3f} / {at_cap['answering_under']:.3f}"


def plot(outcomes: Sequence[Outcome], path: Path) -> None:
    """Score distributions of the classes, one panel per scorer, thresholds drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(outcomes), 1, figsize=(8, 3 * len(outcomes)), squeeze=False)
    for ax, outcome in zip(axes[:, 0], outcomes):
        kinds = np.asarray([b.kind for b in outcome.batches])
        for kind, colour in zip(KINDS, ("tab:green", "tab:red", "tab:orange")):
            values = outcome.aggregate[kinds == kind]
            if len(values):
                ax.hist(values, bins=30, range=(0, 1), alpha=0.5, color=colour, label=f"{kind} ({len(values)})")
        ax.axvline(float(outcome.upper.mean()), color="black", linestyle="--", label="upper")
        ax.axvline(float(outcome.lower.mean()), color="grey", linestyle=":", label="lower")
        ax.set_title(outcome.scorer)
        ax.set_xlabel("batch score (max over candidates)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
