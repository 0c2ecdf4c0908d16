"""Choosing the grader's thresholds from labelled batch scores: ``upper``, ``lower`` and the false-reject cap,
each share weighted when several sets are fitted at once."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
from numpy.typing import ArrayLike

from llama_index_crag.calibration.fit import IN_CORPUS, OUT_OF_CORPUS
from llama_index_crag.errors import ConfigError, DatasetError


def fit_thresholds(
    aggregate: ArrayLike,
    kinds: Sequence[str],
    target_precision: float = 0.9,
    target_recall: float = 0.9,
    max_false_reject: Optional[float] = None,
    weights: Optional[ArrayLike] = None,
) -> Dict[str, float]:
    """Choose ``upper`` and ``lower`` from batch scores and their kinds.

    ``upper`` is the lowest score at which the batches graded CORRECT reach
    ``target_precision`` (share of them that truly hold the answer); ``lower`` is the
    highest score below which at least ``target_recall`` of the out-of-corpus batches
    fall (all batches without the answer when the set has no out-of-corpus ones).
    With ``max_false_reject``, ``lower`` is also held low enough that at most that
    share of the batches that hold the answer fall under it (graded INCORRECT, which
    the engine answers from the fallback or abstains on): a cap on false abstention
    that wins over ``target_recall`` where the two disagree.
    ``lower`` never exceeds ``upper``. ``weights`` (one a batch, all 1 by default) make every share a weighted
    one: calibrating on several sets at once weighs each set's batches by 1 / their number, so that each set
    counts the same however many questions it has. Returns both and what they achieve on these rows.
    """
    scores = np.asarray(aggregate, dtype=np.float64)
    kind = np.asarray(kinds)
    weight = np.ones(len(scores)) if weights is None else np.asarray(weights, dtype=np.float64)
    if weight.shape != scores.shape or not np.isfinite(weight).all() or (weight <= 0).any():
        raise ConfigError(f"calibration weights must be one positive number a batch ({len(scores)})")
    truth = kind == IN_CORPUS
    if truth.all() or not truth.any():
        raise DatasetError("calibration needs batches both with and without the answer")
    upper = float(scores.max()) + 1e-9
    for threshold in np.unique(scores):
        graded = scores >= threshold
        if _share(truth[graded], weight[graded]) >= target_precision - 1e-12:
            upper = float(threshold)
            break
    caught = kind == OUT_OF_CORPUS if (kind == OUT_OF_CORPUS).any() else ~truth
    order = np.argsort(scores[caught], kind="stable")
    negatives, below = scores[caught][order], np.cumsum(weight[caught][order]) / weight[caught].sum()
    # The lowest negative at or under which target_recall of the negatives' weight lies (unweighted: the
    # ceil(target_recall * n)-th): a threshold just above it catches that share.
    index = min(len(negatives) - 1, int(np.searchsorted(below, target_recall - 1e-9)))
    lower = min(float(negatives[index]) + 1e-6, upper)
    if max_false_reject is not None:
        lower = min(lower, _capped_lower(scores[truth], max_false_reject, weight[truth]))
    # Rounded down, so that no score the cap counted as answered falls under the written threshold.
    lower = float(np.floor(min(lower, 1.0) * 1e6) / 1e6)
    graded_correct = scores >= upper
    return {
        "upper": round(min(upper, 1.0), 6),
        "lower": lower,
        "precision_correct": _share(truth[graded_correct], weight[graded_correct]) if graded_correct.any() else 0.0,
        "recall_incorrect": _share(scores[caught] < lower, weight[caught]),
        "false_reject": _share(scores[truth] < lower, weight[truth]),
    }


def _share(flags: np.ndarray, weight: np.ndarray) -> float:
    """The weighted share of ``flags`` that are true."""
    return float(weight[flags].sum() / weight.sum())


def _capped_lower(positives: np.ndarray, cap: float, weight: Optional[np.ndarray] = None) -> float:
    """The highest threshold under which at most ``cap`` of ``positives`` (weighted by ``weight``) fall."""
    if not 0.0 <= cap < 1.0:
        raise ConfigError(f"max_false_reject must be at least 0 and below 1, got {cap}")
    weight = np.ones(len(positives)) if weight is None else weight
    order = np.argsort(positives, kind="stable")
    ranked = positives[order]
    # The share of the weight strictly before each rank: a threshold at ranked[i] leaves that much under it.
    before = np.concatenate([[0.0], np.cumsum(weight[order])[:-1]]) / weight.sum()
    return float(ranked[int(np.searchsorted(before, cap + 1e-9, side="right")) - 1])
