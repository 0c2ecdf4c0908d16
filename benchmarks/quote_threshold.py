"""The answer model's quote decision, fitted on the design halves of the shared sets.

Runs ``llama-crag eval --no-generate --systems crag`` on each set's design half with
``CRAG_QUOTE_THRESHOLD=0`` (the best strip is always quoted, and the trace keeps its
probability), then replays decisions on those rows. A decision (``QuoteDecision``) asks
the best strip for a probability that falls as the grade of its evidence rises:
``sigmoid(bias - grade_weight * place)``, ``place`` being where the grade sits between
the grader's thresholds (0 at lower, 1 at upper; evidence the fallback found goes by its
own grade). It prints each set's figures for one threshold whatever the grade, then
chooses the numbers that give the best mean truthfulness with each set's false
abstention within its cap (``--max-false-abstention``: 5% on every set, or ``SET=X`` for
one), and each set's figures under a decision fitted on the other sets alone (does it
transfer?); ``--write`` stores the decision in the packaged answer model:

    OMP_NUM_THREADS=2 python benchmarks/quote_threshold.py --limit scifact=150 \
        --max-false-abstention scifact=0.283 --write

SciFact's cap is its false abstention before this decision (28.3% on the first 150 claims
of its design half): its claims are not questions, the answer model gives their
sentences low probabilities, and no decision keeps it near 5%; the cap says the fit may
not make it worse there, as the other sets' 5% says it may not make them worse.

The check halves are never read here; report them with ``benchmarks/check_halves.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_halves import evaluate, write_half  # noqa: E402

from llama_index_crag.answers.extract import META_FILE, PACKAGED_DIR, QuoteDecision, evidence_place  # noqa: E402
from llama_index_crag.core.loop import evidence_grade  # noqa: E402
from llama_index_crag.scorers.evidence import EvidenceScorer  # noqa: E402

#: The offline default grader's thresholds, which place each row's grade.
UPPER = EvidenceScorer.DEFAULT_THRESHOLDS["upper"]
LOWER = EvidenceScorer.DEFAULT_THRESHOLDS["lower"]
#: The decisions tried: grade weights, biases (logits) and floors.
WEIGHTS = [round(0.25 * i, 2) for i in range(41)]
BIASES = [round(-8.0 + 0.1 * i, 1) for i in range(121)]
FLOORS = [round(0.05 * i, 2) for i in range(7)]


def design_rows(dataset: Path, out: Path, limit: Optional[int] = None) -> List[Dict[str, Any]]:
    """CRAG's rows on the design half of ``dataset`` (its first ``limit`` questions), every answer quoted whatever
    its probability."""
    half = write_half(dataset, "design", out / "halves")
    folder = out / "design" / dataset.name
    extra = [] if limit is None else ["--limit", str(limit)]
    evaluate(ROOT, half, folder, out / "cache", extra, env={"CRAG_QUOTE_THRESHOLD": "0"})
    results = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    return [r for r in results["rows"] if r["system"] == "crag"]


def place(row: Dict[str, Any]) -> Optional[float]:
    """Where the grade of the row's evidence sits between the offline default's thresholds."""
    return evidence_place(evidence_grade(row["action"], row.get("top_score"), row.get("retry_score")), UPPER, LOWER)


def replay(rows: List[Dict[str, Any]], decision: QuoteDecision) -> Dict[str, float]:
    """The figures under ``decision``: a row answered at 0 abstains when its best strip falls under the threshold
    at its evidence's place."""
    columns = _columns(rows)
    return _figures(columns, decision.thresholds(columns["place"]))


def fit(sets: Sequence[List[Dict[str, Any]]], caps: Sequence[float]) -> Optional[QuoteDecision]:
    """The decision with the best mean truthfulness over ``sets`` whose false abstention is at most the matching
    one of ``caps`` on each (the lower floor, the smaller grade weight, then the lower bias, among equals). Every
    row is read once: the decisions are tried on arrays of its probability, place and outcome."""
    columns = [_columns(rows) for rows in sets]
    best: Optional[Tuple[float, QuoteDecision]] = None
    for floor in FLOORS:
        for weight in WEIGHTS:
            for bias in BIASES:
                decision = QuoteDecision(weight, bias, floor)
                figures = [_figures(c, decision.thresholds(c["place"])) for c in columns]
                if all(f["false_abstention"] <= cap + 1e-9 for f, cap in zip(figures, caps)):
                    mean = float(np.mean([f["truthfulness"] for f in figures]))
                    if best is None or mean > best[0] + 1e-9:
                        best = (mean, decision)
    return None if best is None else best[1]


def fit_for_trust(
    sets: Sequence[List[Dict[str, Any]]], min_truthfulness: Sequence[float], min_out_of_corpus: Sequence[float]
) -> Optional[QuoteDecision]:
    """The decision with the least mean false abstention over ``sets`` whose truthfulness and out-of-corpus
    abstention are at least the matching ones of ``min_truthfulness`` and ``min_out_of_corpus`` on each (a wrong
    answer costs more than an abstention: the floors come first, answering as much as they allow second; among
    equals the better mean truthfulness, then the lower floor, grade weight and bias)."""
    columns = [_columns(rows) for rows in sets]
    best: Optional[Tuple[Tuple[float, float], QuoteDecision]] = None
    for floor in FLOORS:
        for weight in WEIGHTS:
            for bias in BIASES:
                decision = QuoteDecision(weight, bias, floor)
                figures = [_figures(c, decision.thresholds(c["place"])) for c in columns]
                if all(
                    f["truthfulness"] >= t - 1e-9
                    and (np.isnan(f["abstain_out_of_corpus"]) or f["abstain_out_of_corpus"] >= o - 1e-9)
                    for f, t, o in zip(figures, min_truthfulness, min_out_of_corpus)
                ):
                    missed = float(np.mean([f["false_abstention"] for f in figures]))
                    truthful = float(np.mean([f["truthfulness"] for f in figures]))
                    if (
                        best is None
                        or missed < best[0][0] - 1e-9
                        or (missed <= best[0][0] + 1e-9 and truthful > best[0][1] + 1e-9)
                    ):
                        best = ((missed, truthful), decision)
    return None if best is None else best[1]


def _columns(rows: List[Dict[str, Any]]) -> Dict[str, np.ndarray]:
    """The rows as arrays: each one's place (read as 0 when unknown, as the decision reads it), best strip's
    probability, abstention at 0, score if answered, and kind."""
    places = [place(r) for r in rows]
    return {
        "place": np.asarray([0.0 if p is None else p for p in places]),
        "probability": np.asarray([r.get("quote_grade") or 0.0 for r in rows]),
        "abstained": np.asarray([bool(r["abstained"]) for r in rows]),
        "score": np.asarray([1.0 if r["correct"] else -1.0 for r in rows]),
        "kind": np.asarray([r["kind"] for r in rows]),
    }


def _figures(columns: Dict[str, np.ndarray], needed: np.ndarray) -> Dict[str, float]:
    """The figures when each row's best strip needs ``needed``."""
    abstained = columns["abstained"] | (columns["probability"] < needed)

    def share(kind: str) -> float:
        mine = abstained[columns["kind"] == kind]
        return float(mine.mean()) if mine.size else float("nan")

    return {
        "false_abstention": share("answerable"),
        "truthfulness": float(np.where(abstained, 0.0, columns["score"]).mean()),
        "abstain_out_of_corpus": share("out_of_corpus"),
        "abstain_unanswerable": share("unanswerable"),
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default=str(ROOT.parent / "shared" / "datasets"), help="the shared sets")
    parser.add_argument("--sets", default="squad2,clapnq,scifact", help="comma-separated sets")
    parser.add_argument("--out", default="eval-out/halves", help="rows and halves")
    parser.add_argument(
        "--max-false-abstention",
        action="append",
        default=[],
        metavar="X or SET=X",
        help="the cap on every set (default 0.05), or on one set; give it more than once",
    )
    parser.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="N or SET=N",
        help="only the first N questions of every set's half, or of one set's",
    )
    parser.add_argument(
        "--objective",
        choices=("trust", "truthfulness"),
        default="trust",
        help="trust (default): the least false abstention with every set's truthfulness and out-of-corpus "
        "abstention at their floors; truthfulness: the best mean truthfulness with false abstention under its cap",
    )
    parser.add_argument(
        "--min-truthfulness",
        action="append",
        default=[],
        metavar="X or SET=X",
        help="with --objective trust: the floor on every set (default 0.0), or on one set (negative allowed)",
    )
    parser.add_argument(
        "--min-out-of-corpus",
        action="append",
        default=[],
        metavar="X or SET=X",
        help="with --objective trust: the floor on out-of-corpus abstention on every set (default 0.9), or on one",
    )
    parser.add_argument(
        "--no-worse-than-shipped",
        default="",
        metavar="SETS",
        help="with --objective trust: comma-separated sets whose floors are the shipped decision's own truthfulness "
        "and out-of-corpus abstention on their design half (the fit may not make them worse)",
    )
    parser.add_argument("--write", action="store_true", help="store the chosen decision in the packaged model")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    names = args.sets.split(",")
    limit_of = _per_set(args.limit, int, "--limit")
    limits = {name: n for name in names if (n := limit_of.get(name, limit_of.get(""))) is not None}
    cap_of = _per_set(args.max_false_abstention, float, "--max-false-abstention")
    caps = {name: cap_of.get(name, cap_of.get("", 0.05)) for name in names}
    truth_of = _per_set(args.min_truthfulness, float, "--min-truthfulness", positive=False)
    floors = {name: truth_of.get(name, truth_of.get("", 0.0)) for name in names}
    ooc_of = _per_set(args.min_out_of_corpus, float, "--min-out-of-corpus", positive=False)
    ooc = {name: ooc_of.get(name, ooc_of.get("", 0.9)) for name in names}

    def choose(chosen_rows: Dict[str, List[Dict[str, Any]]]) -> Optional[QuoteDecision]:
        names_here = list(chosen_rows)
        if args.objective == "trust":
            return fit_for_trust(
                [chosen_rows[k] for k in names_here], [floors[k] for k in names_here], [ooc[k] for k in names_here]
            )
        return fit([chosen_rows[k] for k in names_here], [caps[k] for k in names_here])

    rows = {name: design_rows(Path(args.datasets) / name, out, limits.get(name)) for name in names}
    shipped = _shipped_decision()
    for name in [n for n in args.no_worse_than_shipped.split(",") if n]:
        if name not in rows:
            raise SystemExit(f"--no-worse-than-shipped names {name}, which is not in --sets")
        figures = replay(rows[name], shipped)
        floors[name], ooc[name] = figures["truthfulness"], figures["abstain_out_of_corpus"]
    print("One threshold whatever the grade:\n")
    print("| threshold | " + " | ".join(f"{n}: false abst. / truthful. / ooc / unans." for n in rows) + " |")
    print("|---:|" + "---|" * len(rows))
    for t in [round(0.05 * i, 2) for i in range(15)]:
        figures = [replay(r, QuoteDecision.constant(t)) for r in rows.values()]
        print(f"| {t:.2f} | " + " | ".join(_cells(f) for f in figures) + " |")
    chosen = choose(rows)
    if args.objective == "trust":
        named = ", ".join(
            f"{name} truthfulness >= {100 * floors[name]:.1f}%, out of corpus >= {100 * ooc[name]:.1f}%"
            for name in names
        )
        aim = f"the least false abstention with each design half at its floors ({named})"
    else:
        named = ", ".join(f"{name} {100 * cap:.1f}%" for name, cap in caps.items())
        aim = f"best mean truthfulness with false abstention within each design half's cap ({named})"
    if chosen is None:
        print(f"\nNo decision meets every design half's bound: {aim}.")
        return 1
    print(
        f"\nChosen: grade weight {chosen.grade_weight}, bias {chosen.bias}, floor {chosen.floor} (threshold "
        + ", ".join(f"{chosen.threshold(p):.2f} at place {p}" for p in (0.0, 0.5, 1.0))
        + f"): {aim}."
    )
    print("\n(false abstention / truthfulness / out of corpus / unanswerable, %)\n")
    for name, r in rows.items():
        others = [k for k in rows if k != name]
        alone = choose({k: rows[k] for k in others}) if others else None
        transfer = "" if alone is None else f"; fitted on the others alone: {_cells(replay(r, alone))}"
        print(f"- {name}: {_cells(replay(r, chosen))}{transfer}")
    if args.write:
        meta = json.loads((PACKAGED_DIR / META_FILE).read_text(encoding="utf-8"))
        meta.pop("thresholds", None)
        meta.pop("thresholds_chosen_on", None)
        meta["decision"] = chosen.to_dict()
        meta["decision_chosen_on"] = f"design halves of {', '.join(rows)}: benchmarks/quote_threshold.py " + " ".join(
            [f"--limit {name}={n}" for name, n in limits.items()]
            + (
                [f"--min-truthfulness {name}={floors[name]:.4f}" for name in names]
                + [f"--min-out-of-corpus {name}={ooc[name]:.4f}" for name in names]
                + ([f"--no-worse-than-shipped {args.no_worse_than_shipped}"] if args.no_worse_than_shipped else [])
                if args.objective == "trust"
                else ["--objective truthfulness"]
                + [f"--max-false-abstention {name}={cap}" for name, cap in caps.items()]
            )
        )
        (PACKAGED_DIR / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        print(f"\nWrote it to {PACKAGED_DIR / META_FILE}.")
    return 0


def _shipped_decision() -> QuoteDecision:
    """The decision the packaged answer model ships."""
    meta = json.loads((PACKAGED_DIR / META_FILE).read_text(encoding="utf-8"))
    chosen = meta["decision"]
    return QuoteDecision(chosen["grade_weight"], chosen["bias"], chosen["floor"])


def _per_set(given: Sequence[str], kind: Callable[[str], Any], option: str, positive: bool = True) -> Dict[str, Any]:
    """``SET=VALUE`` (or a bare ``VALUE``, keyed ``""``: every set) options as a mapping, or a clear error."""
    values: Dict[str, Any] = {}
    for item in given:
        name, _, value = item.rpartition("=")
        try:
            number = kind(value)
        except ValueError:
            raise SystemExit(f"{option} takes VALUE or SET=VALUE, not {item!r}") from None
        if positive and number <= 0:
            raise SystemExit(f"{option} must be positive, not {item!r}")
        values[name] = number
    return values


def _cells(figures: Dict[str, float]) -> str:
    keys = ("false_abstention", "truthfulness", "abstain_out_of_corpus", "abstain_unanswerable")
    return " / ".join(f"{100 * figures[k]:.1f}" for k in keys)


if __name__ == "__main__":
    raise SystemExit(main())
