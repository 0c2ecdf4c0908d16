"""``llama-crag calibrate``: one calibration file fitted on one labelled set or several, or on an index folder's
own chunks (the scorer's learned weights, the three-band thresholds and the strip threshold)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import MetadataMode

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

if TYPE_CHECKING:
    from llama_index_crag.stores.folder import LoadedIndex

#: One part of a fit: where its passages' strips are read (a dataset folder, or an index's chunks by id), its
#: labelled batches and the scorer over its corpus.
Part = Tuple[Union[Path, Mapping[str, Mapping[str, Any]]], List[Batch], RelevanceScorer]


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
    embed_model: Optional[BaseEmbedding] = None,
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

    ``embed_model`` (default: the bundled MiniLM) retrieves the candidates and is the scorer's embedding model:
    the file records it, and an engine that embeds with another model refuses the file.
    """
    folders = [Path(dataset)] if isinstance(dataset, (str, Path)) else [Path(d) for d in dataset]
    if not folders:
        raise ConfigError("calibrate needs at least one dataset")
    if synthetic is not None and synthetic <= 0:
        raise ConfigError(f"--synthetic makes N questions: N must be at least 1, got {synthetic}")
    if synthetic is not None and len(folders) > 1:
        raise ConfigError("--synthetic makes questions from one corpus: name one --dataset")
    parts: List[Part] = []  # each set's passages, batches and scorer, in the order given
    for folder in folders:
        batches, scorer = _calibration_part(folder, scorer_name, k, limit, split, progress, synthetic, embed_model)
        parts.append((folder, batches, scorer))
    names = ", ".join(str(f) for f in folders)
    note = f" (corpus only: {synthetic} synthetic questions)" if synthetic is not None else ""
    return _fit(parts, out, targets, names + note, progress, min_tokens)


def calibrate_index(
    loaded: LoadedIndex,
    count: int,
    out: Path,
    scorer_name: Optional[str],
    k: int,
    targets: Mapping[str, float],
    progress: bool = True,
    min_tokens: int = 8,
) -> Dict[str, Any]:
    """Fit a calibration on ``count`` synthetic questions over an index folder's own chunks and write it to ``out``.

    No label is needed: the questions come from the chunks (``synthetic.py``), retrieved with the index's
    embedding model over the vectors ingest stored. ``scorer_name`` None fits the scorer the engine over the
    index grades with (``load_engine``'s), so that the file written into the folder is the one it reads.
    """
    from llama_index_crag.calibration.synthetic import index_synthetic_batches

    if count <= 0:
        raise ConfigError(f"--synthetic makes N questions: N must be at least 1, got {count}")
    labelled = index_synthetic_batches(loaded, count=count, k=k, progress=progress)
    scorer: RelevanceScorer
    if scorer_name is None:
        from llama_index_crag.core.persisted import index_scorer

        scorer = index_scorer(loaded)
    else:
        scorer = from_spec(scorer_name, embed_model=loaded.embed_model, corpus=labelled.corpus)
    labelled.prime(scorer)
    rows = {
        n.node_id: {"text": n.get_content(metadata_mode=MetadataMode.NONE), "title": n.metadata.get("title")}
        for n in loaded.nodes
    }
    note = f" (index chunks only: {count} synthetic questions)"
    return _fit([(rows, labelled.batches, scorer)], out, targets, str(loaded.index_dir) + note, progress, min_tokens)


def _fit(
    parts: Sequence[Part], out: Path, targets: Mapping[str, float], dataset: str, progress: bool, min_tokens: int
) -> Dict[str, Any]:
    """Fit the scorer's weights (the evidence scorer's), the thresholds and the strip threshold over ``parts``,
    each counting the same, and write the calibration file."""
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
    return write_calibration(
        out,
        first,
        thresholds,
        targets,
        counts,
        dataset=dataset,
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
    embed_model: Optional[BaseEmbedding],
) -> Tuple[List[Batch], RelevanceScorer]:
    """One set's labelled batches (its half, or its questions of a named split) and a scorer over its corpus."""
    if synthetic is not None:
        from llama_index_crag.calibration.synthetic import synthetic_batches

        labelled = synthetic_batches(folder, count=synthetic, k=k, embed_model=embed_model, progress=progress)
    else:
        half = split if split in SPLITS else "all"
        labelled = labelled_batches(folder, k=k, embed_model=embed_model, limit=limit, progress=progress, split=half)
    batches = labelled.batches
    if split is not None and split not in SPLITS:
        batches = [b for b in batches if b.question.split == split]
        if not batches:
            raise ConfigError(f"no question of {folder} has split {split!r}")
    scorer = from_spec(scorer_name, embed_model=embed_model, corpus=labelled.corpus)
    labelled.prime(scorer)
    return batches, scorer
