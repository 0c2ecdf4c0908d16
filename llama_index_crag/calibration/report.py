"""The grader measured alone: calibration and the out-of-sample grade report behind ``llama-crag``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from llama_index_crag.calibration.fit import (
    IN_CORPUS,
    OUT_OF_CORPUS,
    UNANSWERABLE,
    Batch,
    StripSet,
    fit_strip_threshold,
    labelled_batches,
    labelled_strips,
    score_batches,
    score_strips,
    strip_counts,
)
from llama_index_crag.calibration.labelled import group_folds
from llama_index_crag.calibration.report_figures import Outcome, against_default, auroc, figures, plot, table
from llama_index_crag.calibration.thresholds import fit_thresholds
from llama_index_crag.errors import ConfigError, DatasetError
from llama_index_crag.scorers.base import RelevanceScorer, sigmoid
from llama_index_crag.scorers.evidence import EvidenceScorer
from llama_index_crag.scorers.registry import report_scorers
from llama_index_crag.settings_sources import read_calibration


def _evidence_aggregate(
    features: Sequence[np.ndarray],
    batches: Sequence[Batch],
    train: np.ndarray,
    test: np.ndarray,
    scorer: EvidenceScorer,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fit the evidence weights on the training batches; batch scores of train and test with them, and the weights."""
    rows = np.concatenate([f for f, t in zip(features, train) if t])
    labels = np.concatenate([np.asarray(b.gold) & b.has_answer for b, t in zip(batches, train) if t])
    weights = scorer.fit(rows, labels).weights.copy()

    def aggregate(mask: np.ndarray) -> np.ndarray:
        return np.asarray(
            [max(sigmoid(float(v)) for v in f @ weights[:-1] + weights[-1]) for f, m in zip(features, mask) if m]
        )

    return aggregate(train), aggregate(test), weights


def cross_validate(
    scorer: RelevanceScorer,
    batches: List[Batch],
    folds: int = 5,
    targets: Optional[Mapping[str, float]] = None,
    progress: bool = True,
    strips: Optional[StripSet] = None,
) -> Outcome:
    """Score every batch with weights and thresholds fitted on the other folds only.

    With ``strips``, the knowledge-strip threshold is cross-validated the same way:
    fitted on the strips of the training folds' questions, measured on the others.
    """
    targets = dict(targets or {"target_precision": 0.9, "target_recall": 0.9})
    scored = score_batches(scorer, batches, progress=progress)
    fixed = scored.aggregate()
    kinds = np.asarray([b.kind for b in batches])
    questions = len({b.question.qid for b in batches})
    if questions < folds:
        raise DatasetError(
            f"{questions} question(s) cannot be split into {folds} folds: ask more (--limit) or fewer folds"
        )
    fold_of = group_folds([b.question.qid for b in batches], folds)  # a question's two batches together
    features = (
        [scorer.features(b.question.question, b.texts) for b in batches] if isinstance(scorer, EvidenceScorer) else []
    )
    aggregate = np.zeros(len(batches))
    upper = np.zeros(len(batches))
    lower = np.zeros(len(batches))
    strip_cv = _StripCV(scorer, strips, progress) if strips else None
    qids = np.asarray([b.question.qid for b in batches])
    for fold in range(folds):
        test = fold_of == fold
        train = ~test
        if not test.any():
            continue
        weights = None
        if isinstance(scorer, EvidenceScorer):
            train_scores, test_scores, weights = _evidence_aggregate(features, batches, train, test, scorer)
        else:
            train_scores, test_scores = fixed[train], fixed[test]
        fitted = fit_thresholds(train_scores, kinds[train], **targets)
        aggregate[test] = test_scores
        upper[test], lower[test] = fitted["upper"], fitted["lower"]
        if strip_cv is not None:
            strip_cv.fold(set(qids[train]), set(qids[test]), weights, fitted["lower"])
    return Outcome(
        scorer.name,
        scorer.normalization,
        batches,
        aggregate,
        upper,
        lower,
        scored.pairs_per_second,
        strip_cv.result() if strip_cv else None,
    )


class _StripCV:
    """Cross-validated strip figures: a threshold fitted per fold on the training questions' strips.

    Measures the fitted strip threshold, and for comparison the fold's passage-level
    ``lower`` (what the refiner uses when no strip threshold is set).
    """

    def __init__(self, scorer: RelevanceScorer, strips: StripSet, progress: bool) -> None:
        self.strips = strips
        self.evidence = scorer if isinstance(scorer, EvidenceScorer) else None
        if self.evidence is not None:
            self.features = [self.evidence.features(q, t) for q, t in zip(strips.questions, strips.strips)]
            self.scores: List[List[float]] = []
        else:
            self.scores = score_strips(scorer, strips, progress)
        self.counts = {"fitted": np.zeros(4), "lower": np.zeros(4)}
        self.thresholds: List[float] = []

    def fold(self, train: set, test: set, weights: Optional[np.ndarray], lower: float) -> None:
        scores = self.scores
        if self.evidence is not None and weights is not None:
            scores = [[sigmoid(float(v)) for v in f @ weights[:-1] + weights[-1]] for f in self.features]
        in_train = [qid in train for qid in self.strips.qids]
        in_test = [qid in test for qid in self.strips.qids]
        train_scores = [s for s, m in zip(scores, in_train) if m]
        train_labels = [lab for lab, m in zip(self.strips.labels, in_train) if m]
        test_scores = [s for s, m in zip(scores, in_test) if m]
        test_labels = [lab for lab, m in zip(self.strips.labels, in_test) if m]
        if not test_scores or not train_scores:
            return
        threshold = fit_strip_threshold(train_scores, train_labels, at_most=lower)["strip_threshold"]
        self.thresholds.append(threshold)
        for key, value in (("fitted", threshold), ("lower", lower)):
            self.counts[key] += np.asarray(strip_counts(test_scores, test_labels, value))

    def result(self) -> Dict[str, Any]:
        mean = float(np.mean(self.thresholds)) if self.thresholds else None
        return {
            **_strip_figures(len(self.strips), self.counts["fitted"], mean),
            "at_lower": _shares(self.counts["lower"]),
        }


def _strip_figures(passages: int, counts: np.ndarray, threshold: Optional[float]) -> Dict[str, Any]:
    """The strip figures of the report, from ``strip_counts`` at ``threshold``."""
    return {
        "passages": passages,
        "evidence_strips": int(counts[1]),
        "other_strips": int(counts[3]),
        "strip_threshold_mean": threshold,
        **_shares(counts),
    }


def _shares(counts: np.ndarray) -> Dict[str, Optional[float]]:
    """Evidence kept and others dropped, from ``strip_counts`` (summed over folds)."""
    return {
        "evidence_kept": float(counts[0] / counts[1]) if counts[1] else None,
        "other_dropped": float(counts[2] / counts[3]) if counts[3] else None,
    }


def with_calibration(
    scorer: RelevanceScorer,
    batches: List[Batch],
    calibration: Mapping[str, Any],
    progress: bool = True,
    strips: Optional[StripSet] = None,
) -> Outcome:
    """Score the batches the calibration file was not fitted on, with its thresholds."""
    fitted = set(calibration.get("fitted_qids", []))
    held_out = [b for b in batches if b.question.qid not in fitted]
    if not held_out:
        raise ConfigError("every question of this dataset was used to fit the calibration: calibrate on a split")
    if isinstance(scorer, EvidenceScorer) and "scorer_state" in calibration:
        scorer.load_state(calibration["scorer_state"])
    scored = score_batches(scorer, held_out, progress=progress)
    n = len(held_out)
    thresholds = calibration["thresholds"]
    strip_figures = None
    if strips:
        test = strips.subset({b.question.qid for b in held_out})
        if len(test):
            strip_threshold = thresholds.get("strip_threshold", thresholds["lower"])
            counts = np.asarray(strip_counts(score_strips(scorer, test, progress), test.labels, strip_threshold))
            strip_figures = _strip_figures(len(test), counts, float(strip_threshold))
    return Outcome(
        scorer.name,
        scorer.normalization,
        held_out,
        scored.aggregate(),
        np.full(n, thresholds["upper"]),
        np.full(n, thresholds["lower"]),
        scored.pairs_per_second,
        strip_figures,
    )


def run_report(
    dataset: Path,
    scorers: Sequence[str],
    calibration: Optional[Path],
    out: Path,
    k: int,
    folds: int,
    limit: Optional[int],
    judge_limit: int,
    targets: Mapping[str, float],
    min_tokens: int,
    progress: bool = True,
    split: str = "all",
    best_sentence: bool = False,
) -> Dict[str, Any]:
    """Measure each scorer on ``dataset`` out of sample; write JSON, Markdown and a PNG to ``out``.

    The first row is always the engine's default scorer (``default``), whatever ``scorers`` names. ``split``
    measures one half of the set (``datasets.Halves``): ``check`` for figures, after fitting on ``design``.
    ``best_sentence`` adds how well the answer model's best-strip probability alone tells the batches with the
    answer from the others (``best_sentence_figures``).
    """
    labelled = labelled_batches(dataset, k=k, limit=limit, progress=progress, split=split)
    batches, corpus = labelled.batches, labelled.corpus
    strips = labelled_strips(dataset, batches, min_tokens)
    calibration_data = read_calibration(calibration, None) if calibration else None
    outcomes: List[Outcome] = []
    results: List[Dict[str, Any]] = []
    for name, scorer in report_scorers(scorers, corpus):
        labelled.prime(scorer)
        subset = batches
        if name == "llm-judge":
            keep = {b.question.qid for b in batches[:judge_limit]}
            subset = [b for b in batches if b.question.qid in keep]
        fitted = calibration_data if calibration_data and calibration_data.get("scorer") == scorer.name else None
        try:
            if fitted is not None:
                outcome = with_calibration(scorer, subset, fitted, progress, strips)
            else:
                outcome = cross_validate(scorer, subset, folds=folds, targets=targets, progress=progress, strips=strips)
        except DatasetError as exc:
            if subset is batches:
                raise
            raise DatasetError(
                f"{name}: --judge-limit {judge_limit} leaves {len(subset)} batches, too few to measure it ({exc}); "
                "raise --judge-limit"
            ) from exc
        result = figures(outcome, targets.get("max_false_reject"))
        result["strips"] = outcome.strips
        result["default"] = name == "default"
        result["protocol"] = "calibration file, held-out rows" if fitted else f"{folds}-fold cross-validation"
        outcomes.append(outcome)
        results.append(result)
    against_default(results)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "dataset": str(dataset),
        "split": split,
        "k": k,
        "protocol": _protocol(results, calibration_data, folds),
        "targets": dict(targets),
        "results": results,
    }
    if best_sentence:
        report["best_sentence"] = best_sentence_figures(batches, corpus, progress)
    (out / "grade-report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "grade-report.md").write_text(table(results) + "\n", encoding="utf-8")
    plot(outcomes, out / "grade-report.png")
    return report


def _protocol(results: Sequence[Mapping[str, Any]], calibration: Optional[Mapping[str, Any]], folds: int) -> str:
    """How the rows were measured, said whole: a calibration file fitted for no row's scorer is named as unused."""
    crossed = f"{folds}-fold cross-validation"
    used = [r["scorer"] for r in results if r["protocol"] != crossed]
    if calibration is None:
        return crossed
    if not used:
        return f"{crossed} (the calibration file was fitted for {calibration.get('scorer')!r}, which no row is)"
    if len(used) == len(results):
        return "calibration file, held-out rows"
    return f"calibration file, held-out rows, for {', '.join(used)}; {crossed} for the others"


def best_sentence_figures(batches: Sequence[Batch], corpus: Sequence[str], progress: bool = True) -> Dict[str, Any]:
    """The answer model's probability for the best strip of each batch's candidates, as a grader feature: its AUROC
    for the batches with the answer against the out-of-corpus and the unanswerable ones."""
    from llama_index.core.schema import NodeWithScore, TextNode
    from tqdm import tqdm

    from llama_index_crag.answers.extract import EvidenceQuoter

    quoter = EvidenceQuoter(EvidenceScorer(corpus=corpus), answer_threshold=0.0)
    scores = np.asarray(
        [
            quoter.quote(b.question.question, [NodeWithScore(node=TextNode(text=t)) for t in b.texts]).grade or 0.0
            for b in tqdm(batches, desc="best sentence", disable=not progress)
        ]
    )
    kinds = np.asarray([b.kind for b in batches])
    return {other: auroc(scores[kinds == IN_CORPUS], scores[kinds == other]) for other in (OUT_OF_CORPUS, UNANSWERABLE)}
