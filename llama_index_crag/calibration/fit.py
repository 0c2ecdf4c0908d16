"""Labelled candidate batches from a dataset, threshold fitting, and the versioned calibration file."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import MetadataMode
from tqdm import tqdm

from llama_index_crag.datasets import Question, load_documents, load_questions, normalise_text, read_jsonl, words_in
from llama_index_crag.errors import DatasetError
from llama_index_crag.local.embedding_cache import DEFAULT_CACHE_DIR, corpus_cache, unit_vectors
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.scorers.bi_encoder import bi_encoder_of
from llama_index_crag.settings_sources import CALIBRATION_VERSION, embed_model_of

IN_CORPUS = "in-corpus"
OUT_OF_CORPUS = "out-of-corpus"
UNANSWERABLE = "unanswerable"


@dataclass
class Batch:
    """The candidates one question gets, and whether the answer's passage is among them.

    ``kind`` is ``in-corpus`` (an answerable question whose gold passage was
    retrieved), ``out-of-corpus`` (the same question asked of the index without its
    gold passages: the right outcome is to abstain) or ``unanswerable``.
    """

    question: Question
    kind: str
    doc_ids: List[str]
    texts: List[str]
    gold: List[bool] = field(default_factory=list)

    @property
    def has_answer(self) -> bool:
        """True for the batches the engine should answer from."""
        return self.kind == IN_CORPUS


@dataclass
class LabelledSet:
    """The labelled batches of a dataset, with the corpus and the embeddings retrieval computed."""

    batches: List[Batch]
    corpus: List[str]
    corpus_vectors: np.ndarray
    questions: List[str]
    question_vectors: List[List[float]]

    def prime(self, scorer: RelevanceScorer) -> None:
        """Give a bi-encoder-based scorer the embeddings retrieval already computed, as an index would."""
        bi_encoder = bi_encoder_of(scorer)
        if bi_encoder is not None:
            bi_encoder.remember(self.corpus, self.corpus_vectors)
            bi_encoder.remember_queries(self.questions, self.question_vectors)


def labelled_batches(
    folder: Path | str,
    k: int = 5,
    embed_model: Optional[BaseEmbedding] = None,
    limit: Optional[int] = None,
    progress: bool = True,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    split: str = "all",
) -> LabelledSet:
    """Dense top-``k`` candidates for every question, labelled by the out-of-corpus protocol.

    Each answerable question gives an in-corpus batch (when retrieval found a gold
    passage) and an out-of-corpus batch (the top ``k`` once the gold passages are
    dropped, as if the index had been built without them); each unanswerable question
    gives one batch. ``split`` keeps one half of the set, its documents and questions (``datasets.Halves``).
    """
    from llama_index_crag.local.models import default_embed_model

    folder = Path(folder)
    embed_model = embed_model or default_embed_model()
    documents = load_documents(folder, split)
    texts = [d.get_content(metadata_mode=MetadataMode.EMBED) for d in documents]
    ids = [d.doc_id for d in documents]
    questions = load_questions(folder, split)[:limit]
    if not documents or not questions:
        raise DatasetError(f"{folder} holds no {'documents' if not documents else 'questions'}: nothing to measure")
    matrix = unit_vectors(corpus_cache(embed_model, folder / "corpus.jsonl", cache_dir, progress), texts)
    queries = embed_model.get_text_embedding_batch([q.question for q in questions])
    batches: List[Batch] = []
    for question, vector in zip(questions, queries):
        order = ranking(matrix, vector)
        gold = set(question.relevant_doc_ids) if question.answerable else set()
        top = [int(i) for i in order[:k]]
        if not question.answerable:
            batches.append(make_batch(question, UNANSWERABLE, top, ids, texts, gold))
            continue
        if gold & {ids[i] for i in top}:
            batches.append(make_batch(question, IN_CORPUS, top, ids, texts, gold))
        without = [int(i) for i in order[: k + len(gold)] if ids[int(i)] not in gold][:k]
        batches.append(make_batch(question, OUT_OF_CORPUS, without, ids, texts, gold))
    return LabelledSet(batches, texts, matrix, [q.question for q in questions], queries)


def ranking(matrix: np.ndarray, vector: Sequence[float]) -> np.ndarray:
    """Row indices of the unit-length ``matrix``, most cosine-similar to ``vector`` first (dense retrieval)."""
    query = np.asarray(vector, dtype=np.float32)
    return np.argsort(-(matrix @ (query / max(float(np.linalg.norm(query)), 1e-12))))


def make_batch(question: Question, kind: str, rows: List[int], ids: List[str], texts: List[str], gold: set) -> Batch:
    """The batch of ``question`` made of the corpus rows ``rows``; ``gold`` holds the ids of the answer's passages."""
    return Batch(
        question=question,
        kind=kind,
        doc_ids=[ids[i] for i in rows],
        texts=[texts[i] for i in rows],
        gold=[ids[i] in gold for i in rows],
    )


@dataclass
class Scored:
    """Per-candidate scores of every batch, and how fast they were computed."""

    scores: List[List[float]]
    pairs: int
    seconds: float

    @property
    def pairs_per_second(self) -> float:
        return self.pairs / self.seconds if self.seconds > 0 else float("inf")

    def aggregate(self) -> np.ndarray:
        """The batch score the grader compares with the thresholds (max)."""
        return np.asarray([max(s) if s else 0.0 for s in self.scores])


def score_batches(scorer: RelevanceScorer, batches: Sequence[Batch], progress: bool = True, desc: str = "") -> Scored:
    """Score every candidate of every batch with ``scorer``, timing the scoring alone."""
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

    scores: List[List[float]] = []
    seconds = 0.0
    for batch in tqdm(batches, desc=desc or f"scoring ({scorer.name})", unit="batch", disable=not progress):
        nodes = [NodeWithScore(node=TextNode(text=t)) for t in batch.texts]
        start = time.perf_counter()
        scores.append(scorer.score_nodes(QueryBundle(batch.question.question), nodes))
        seconds += time.perf_counter() - start
    return Scored(scores=scores, pairs=sum(len(b.texts) for b in batches), seconds=seconds)


def write_calibration(
    path: Path | str,
    scorer: RelevanceScorer,
    thresholds: Mapping[str, float],
    targets: Mapping[str, float],
    counts: Mapping[str, int],
    dataset: str,
    fitted_qids: Sequence[str],
    scorer_state: Optional[Mapping[str, Any]] = None,
    strips: Optional[Mapping[str, float]] = None,
) -> Dict[str, Any]:
    """Write the versioned calibration file that ``core.settings_sources.load_calibration`` reads; it records the
    scorer and the embedding model its scores came from (None for a scorer that embeds nothing).

    ``strips`` (from ``fit_strip_threshold``) adds the knowledge-strip threshold and
    what it achieved, when the set labels evidence sentences or short answers."""
    data: Dict[str, Any] = {
        "version": CALIBRATION_VERSION,
        "scorer": scorer.name,
        "embed_model": embed_model_of(scorer.name),
        "normalization": scorer.normalization,
        "thresholds": {"upper": thresholds["upper"], "lower": thresholds["lower"]},
        "targets": dict(targets),
        "achieved": {
            "precision_correct": thresholds["precision_correct"],
            "recall_incorrect": thresholds["recall_incorrect"],
            "false_reject": thresholds["false_reject"],
        },
        "samples": dict(counts),
        "dataset": dataset,
        "fitted_qids": sorted(fitted_qids),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if strips is not None:
        data["thresholds"]["strip_threshold"] = strips["strip_threshold"]
        data["strips"] = {k: strips[k] for k in ("evidence_kept", "other_dropped", "passages")}
    if scorer_state is not None:
        data["scorer_state"] = dict(scorer_state)
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return data


@dataclass
class StripSet:
    """Knowledge strips of the gold passages of answerable questions, each labelled evidence or not.

    A strip is evidence when it overlaps a sentence the dataset marks as evidence
    (SciFact's ``evidence``), or, in a set with short answers (SQuAD), when it holds
    a gold answer string. Only in-corpus batches contribute: the strips are what the
    refiner sees on the AMBIGUOUS branch when retrieval did find the passage.
    """

    qids: List[str] = field(default_factory=list)
    questions: List[str] = field(default_factory=list)
    strips: List[List[str]] = field(default_factory=list)  # as graded: a strip that refers back carries its context
    labels: List[List[bool]] = field(default_factory=list)
    kept: List[List[str]] = field(default_factory=list)  # as kept and labelled: the strip's own text

    def __len__(self) -> int:
        return len(self.qids)

    def subset(self, qids: set) -> StripSet:
        """The passages of the questions in ``qids``."""
        keep = [i for i, qid in enumerate(self.qids) if qid in qids]
        return StripSet(
            [self.qids[i] for i in keep],
            [self.questions[i] for i in keep],
            [self.strips[i] for i in keep],
            [self.labels[i] for i in keep],
        )


def labelled_strips(
    folder: Path | str | Mapping[str, Mapping[str, Any]], batches: Sequence[Batch], min_tokens: int
) -> StripSet:
    """The strips ``StripRefiner`` would cut from each in-corpus batch's gold passages, labelled.

    ``folder`` is a dataset folder, whose ``corpus.jsonl`` rows hold the passages, or those rows by id (``text``
    and ``title``: an index folder's chunks)."""
    from llama_index_crag.text.strips import decompose

    if isinstance(folder, Mapping):
        rows = dict(folder)
    else:
        rows = {str(r["doc_id"]): r for r in read_jsonl(Path(folder) / "corpus.jsonl")}
    found = StripSet()
    for batch in batches:
        if batch.kind != IN_CORPUS:
            continue
        question = batch.question
        answers = [a for a in (normalise_text(answer) for answer in question.answers) if a]
        for doc_id in dict.fromkeys(d for d, g in zip(batch.doc_ids, batch.gold) if g):
            row = rows.get(doc_id)
            if row is None:
                continue
            sentences = row.get("sentences") if doc_id in question.evidence else None
            text = " ".join(sentences) if sentences else str(row["text"])
            cut = decompose(text, min_tokens, str(row.get("title") or ""))
            strips = [s.graded_text for s in cut]  # scored as the refiner scores them, labelled by their own text
            normalised = [normalise_text(s.text) for s in cut]
            if sentences:
                wanted = [normalise_text(sentences[i]) for i in question.evidence[doc_id] if i < len(sentences)]
                labels = [any(words_in(w, s) or words_in(s, w) for w in wanted) for s in normalised]
            elif answers:
                labels = [any(words_in(a, s) for a in answers) for s in normalised]
            else:
                continue
            if len(strips) > 1 and any(labels):
                found.qids.append(question.qid)
                found.questions.append(question.question)
                found.strips.append(strips)
                found.labels.append(labels)
                found.kept.append([s.text for s in cut])
    return found


def score_strips(scorer: RelevanceScorer, strips: StripSet, progress: bool = True) -> List[List[float]]:
    """The scorer's score of every strip, passage by passage."""
    return [
        scorer.score_texts(question, texts)
        for question, texts in tqdm(
            list(zip(strips.questions, strips.strips)), desc="scoring strips", unit="passage", disable=not progress
        )
    ]


def fit_strip_threshold(
    scores: Sequence[Sequence[float]], labels: Sequence[Sequence[bool]], at_most: Optional[float] = None
) -> Dict[str, float]:
    """The strip threshold that best separates evidence strips from the rest (Youden's J), as the refiner applies it.

    A strip counts as kept when it clears the threshold or when no strip of its
    passage does (``StripRefiner`` then passes the passage whole), so a threshold
    above every strip of most passages keeps nearly everything and is not chosen.
    ``at_most`` caps it: pass the passage threshold ``lower``, since a strip that
    would pass as a passage should not be dropped as a strip. (Synthetic questions
    copy their sentence, so on a small corpus their answer strips can all score far
    above real ones; uncapped, the fit then lands above every real strip.)
    Returns it with the share of evidence strips it keeps and of other strips it
    drops on these rows.
    """
    flat, passage_best, truth = _flat_strips(scores, labels)
    if truth.all() or not truth.any():
        raise ValueError("fitting the strip threshold needs both evidence and other strips")
    candidates = np.unique(flat)
    if at_most is not None:
        candidates = np.unique(np.append(candidates[candidates <= at_most], at_most))
    best, best_j = float(candidates[0]), -np.inf
    for start in range(0, len(candidates), 256):
        block = candidates[start : start + 256]
        kept = _kept(flat, passage_best, block)
        j = kept[:, truth].mean(axis=1) - kept[:, ~truth].mean(axis=1)
        i = int(np.argmax(j))
        if j[i] > best_j:
            best, best_j = float(block[i]), float(j[i])
    return {"strip_threshold": round(best, 6), **strip_outcome(scores, labels, best), "passages": len(scores)}


def strip_counts(
    scores: Sequence[Sequence[float]], labels: Sequence[Sequence[bool]], threshold: float
) -> Tuple[int, int, int, int]:
    """Evidence strips kept, evidence strips, other strips dropped, other strips, at ``threshold`` as
    ``StripRefiner`` applies it (a passage where no strip clears the threshold is passed on whole)."""
    flat, passage_best, truth = _flat_strips(scores, labels)
    kept = _kept(flat, passage_best, np.asarray([threshold], dtype=np.float64))[0]
    return int(kept[truth].sum()), int(truth.sum()), int((~kept[~truth]).sum()), int((~truth).sum())


def _flat_strips(
    scores: Sequence[Sequence[float]], labels: Sequence[Sequence[bool]]
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every strip's score, the best score of its passage, and whether it is evidence, as flat arrays."""
    flat = np.asarray([s for row in scores for s in row], dtype=np.float64)
    passage_best = np.asarray([max(row) for row in scores for _ in row], dtype=np.float64)
    truth = np.asarray([lab for row in labels for lab in row], dtype=bool)
    return flat, passage_best, truth


def _kept(flat: np.ndarray, passage_best: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Which strips ``StripRefiner`` keeps at each threshold (one row a threshold): those that clear it, and
    every strip of a passage where none does (the passage is passed on whole)."""
    bar = thresholds[:, None]
    return (flat[None, :] >= bar) | (bar > passage_best[None, :])


def strip_outcome(
    scores: Sequence[Sequence[float]], labels: Sequence[Sequence[bool]], threshold: float
) -> Dict[str, float]:
    """Shares of evidence strips kept and of other strips dropped at ``threshold`` (see ``strip_counts``)."""
    kept_evidence, total_evidence, dropped_other, total_other = strip_counts(scores, labels, threshold)
    return {
        "evidence_kept": kept_evidence / total_evidence if total_evidence else 0.0,
        "other_dropped": dropped_other / total_other if total_other else 0.0,
    }
