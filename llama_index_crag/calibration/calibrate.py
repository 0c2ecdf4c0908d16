"""``llama-crag calibrate``: one calibration file fitted on one labelled set or several (the scorer's learned
weights, the three-band thresholds and the strip threshold)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from llama_index_crag.calibration.fit import (
    Batch,
    fit_strip_threshold,
    labelled_batches,
    labelled_strips,
    score_batches,
    score_strips,
    write_calibration,
)
from llama_index_crag.calibration.report_figures import KINDS
from llama_index_crag.calibration.thresholds import fit_thresholds
from llama_index_crag.datasets import SPLITS
from llama_index_crag.errors import ConfigError
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.scorers.evidence import EvidenceScorer
from llama_index_crag.scorers.registry import from_spec


def run_calibration(
    dataset: Path | str | Sequence[Path | str],
    scorer_name: str,
    out: Path,
    k: int,
    limit: Optional[int],
    split: Optional[str],
    targets: Mapping[str, float],
    progress: bool = True,
    min_tokens: int = 8,
    synthetic: Optional[int] = None,
) -> Dict[str, Any]:
    """Fit thresholds (and the evidence scorer's weights) on ``dataset`` and write the calibration file.

    When the set labels evidence sentences or short answers, the knowledge-strip
    threshold is fitted too, on the strips of the same questions' gold passages.
    With ``synthetic``, that many questions are made from the corpus alone (see
    ``synthetic.py``) and the dataset's own questions are not read. ``split`` ``design`` or ``check`` fits on one
    half of the set (``datasets.Halves``: fit on ``design``, report ``check``); another name keeps the questions
    whose own ``split`` field has it; None or ``all``, every question.

    ``dataset`` may name several sets: one fit over all of them, each retrieved over its own corpus and
    scored with its own corpus's word weights, and each counting the same (a set's batches weigh 1 / their
    number, in the weights' fit and in the thresholds' shares), so that a large set does not decide for a
    small one. ``limit`` applies to each set.
    """
    folders = [Path(dataset)] if isinstance(dataset, (str, Path)) else [Path(d) for d in dataset]
    if not folders:
        raise ConfigError("calibrate needs at least one dataset")
    if synthetic is not None and len(folders) > 1:
        raise ConfigError("--synthetic makes questions from one corpus: name one --dataset")
    parts = []  # each set's batches, scorer and folder, in the order given
    for folder in folders:
        batches, scorer = _calibration_part(folder, scorer_name, k, limit, split, progress, synthetic)
        parts.append((folder, batches, scorer))
    weight_of = [np.full(len(batches), 1.0 / len(batches)) for _, batches, _ in parts]
    state = None
    first = parts[0][2]
    if isinstance(first, EvidenceScorer):
        rows, labels, weights = [], [], []
        for (_, batches, scorer), w in zip(parts, weight_of):
            assert isinstance(scorer, EvidenceScorer)
            for batch, batch_weight in zip(batches, w):
                rows.append(scorer.features(batch.question.question, batch.texts))
                labels.append(np.asarray(batch.gold) & batch.has_answer)
                weights.append(np.full(len(batch.texts), batch_weight))
        weights_given = None if len(parts) == 1 else np.concatenate(weights)
        state = first.fit(np.concatenate(rows), np.concatenate(labels), weights_given).state()
        for _, _, scorer in parts[1:]:
            assert isinstance(scorer, EvidenceScorer)
            scorer.load_state(state)
    aggregates = [score_batches(scorer, batches, progress=progress).aggregate() for _, batches, scorer in parts]
    all_batches = [b for _, batches, _ in parts for b in batches]
    thresholds = fit_thresholds(
        np.concatenate(aggregates),
        [b.kind for b in all_batches],
        weights=None if len(parts) == 1 else np.concatenate(weight_of),
        **targets,
    )
    counts = {kind: sum(1 for b in all_batches if b.kind == kind) for kind in KINDS}
    strip_scores: List[List[float]] = []
    strip_labels: List[List[bool]] = []
    for folder, batches, scorer in parts:
        strips = labelled_strips(folder, batches, min_tokens)
        if len(strips):
            strip_scores += score_strips(scorer, strips, progress)
            strip_labels += strips.labels
    strip_fit = None
    if strip_scores:
        try:
            strip_fit = fit_strip_threshold(strip_scores, strip_labels, at_most=thresholds["lower"])
        except ValueError:
            pass  # every strip is evidence: nothing to separate, the scorer's default strip threshold applies
    names = ", ".join(str(f) for f in folders)
    return write_calibration(
        out,
        first,
        thresholds,
        targets,
        counts,
        dataset=names + (f" (corpus only: {synthetic} synthetic questions)" if synthetic is not None else ""),
        fitted_qids=sorted({b.question.qid for b in all_batches}),
        scorer_state=state,
        strips=strip_fit,
    )


def _calibration_part(
    folder: Path,
    scorer_name: str,
    k: int,
    limit: Optional[int],
    split: Optional[str],
    progress: bool,
    synthetic: Optional[int],
) -> Tuple[List[Batch], RelevanceScorer]:
    """One set's labelled batches (its half, or its questions of a named split) and a scorer over its corpus."""
    if synthetic is not None:
        from llama_index_crag.calibration.synthetic import synthetic_batches

        labelled = synthetic_batches(folder, count=synthetic, k=k, progress=progress)
    else:
        half = split if split in SPLITS else "all"
        labelled = labelled_batches(folder, k=k, limit=limit, progress=progress, split=half)
    batches = labelled.batches
    if split is not None and split not in SPLITS:
        batches = [b for b in batches if b.question.split == split]
        if not batches:
            raise ConfigError(f"no question of {folder} has split {split!r}")
    scorer = from_spec(scorer_name, corpus=labelled.corpus)
    labelled.prime(scorer)
    return batches, scorer
