"""Reader scorer: a cross-encoder trained on the user's corpus, stacked with the evidence features, run as a cascade."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from llama_index.core.base.embeddings.base import BaseEmbedding
from numpy.typing import ArrayLike

from llama_index_crag.scorers.base import fit_logistic, sigmoid
from llama_index_crag.scorers.evidence import FEATURES, EvidenceScorer, align_weights
from llama_index_crag.scorers.reader_model import (
    GRADER_FILE,
    GRADER_VERSION,
    WEIGHTS_FILE,
    GraderLoadError,
    Reader,
    base_fingerprint,
    file_sha256,
)

READER_FEATURES = FEATURES + ("reader",)
#: Words per window a passage is read in; a candidate scores as the best of its windows.
WINDOW_WORDS = 80
WINDOW_STRIDE = 60
#: (query, passage) logits kept, so that grading a batch and then explaining or re-scoring it reads it once.
READ_CACHE_SIZE = 4096


def packaged_grader_path() -> Path:
    """The reader shipped inside the package (trained on human-labelled pairs; see its NOTICE)."""
    return Path(__file__).resolve().parent.parent / "data" / "grader"


def load_reader(
    path: Path | str, base: Optional[Path] = None, quantize: Optional[bool] = None
) -> Tuple[Reader, Any, Dict[str, Any]]:
    """A trained reader from its grader directory: the reader, the encoder to score with, and its description.

    Refuses, with a ``GraderLoadError`` that says why, a directory that is not a grader, one of
    another version, one trained on another base model than ``base`` (the bundled MiniLM by
    default), and weights that do not match the SHA-256 the description records (damaged).
    """
    from llama_index_crag.local.bundled import bundled_embedding_path

    path = Path(path)
    described = path / GRADER_FILE
    if not described.exists():
        raise GraderLoadError(
            f"{path} is not a grader directory (no {GRADER_FILE}): make one with llama-crag train-grader"
        )
    try:
        info = json.loads(described.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise GraderLoadError(f"{described} is not valid JSON ({exc}): retrain or reinstall it") from exc
    if not isinstance(info, dict) or info.get("version") != GRADER_VERSION or info.get("kind") != "reader":
        found = info if not isinstance(info, dict) else f"version {info.get('version')}, kind {info.get('kind')}"
        raise GraderLoadError(
            f"{described} describes a grader of {found}; "
            f"this library reads version {GRADER_VERSION} readers: retrain it"
        )
    weights = path / WEIGHTS_FILE
    if not weights.exists():
        raise GraderLoadError(f"{path} has no {WEIGHTS_FILE}: retrain or reinstall it")
    if info.get("weights_sha256") and file_sha256(weights) != info["weights_sha256"]:
        raise GraderLoadError(
            f"{weights} does not match the SHA-256 its {GRADER_FILE} records: the file is damaged; reinstall it"
        )
    base = Path(base or bundled_embedding_path())
    if base_fingerprint(base) != info.get("base_fingerprint"):
        raise GraderLoadError(
            f"{path} was trained on base model {info.get('base_model')} ({info.get('base_fingerprint')}), "
            f"not on {base} ({base_fingerprint(base)}): retrain it with llama-crag train-grader"
        )
    reader = Reader(base, int(info["max_length"]), pooling=str(info.get("config", {}).get("pooling", "mean")))
    reader.load(weights)
    reader.model.eval()
    import torch

    # A file damaged inside its tensors (not its header) loads, and scores NaN, which clamps to 0 for every passage.
    if not all(bool(torch.isfinite(p).all()) for p in reader.model.parameters()):
        raise GraderLoadError(f"{weights} holds weights that are not finite numbers: the file is damaged; retrain it")
    quantize = bool(info.get("quantize", True)) if quantize is None else quantize
    return reader, reader.quantized_encoder() if quantize else reader.encoder, info


def windows(text: str, words: int = WINDOW_WORDS, stride: int = WINDOW_STRIDE) -> List[str]:
    """Overlapping word windows of a passage (the passage itself when it is short)."""
    tokens = text.split()
    if len(tokens) <= words:
        return [text]
    return [" ".join(tokens[i : i + words]) for i in range(0, len(tokens) - words + stride, stride)]


class ReaderScorer(EvidenceScorer):
    """Reads whether a passage answers: a trained cross-encoder's logit stacked with the eleven evidence features.

    The reader (``llama-crag train-grader``) is the bundled MiniLM fine-tuned on
    question-passage pairs made from the user's own corpus, with on-topic negatives
    (the answering sentence removed, a kept name or date swapped, sibling windows).
    A candidate's reader feature is the best logit over its word windows. One logistic
    model over the twelve features gives the score; ``llama-crag calibrate`` fits it.

    It runs as a cascade: the evidence features alone (their own logistic model) score
    first, and a batch whose best evidence score is below ``settle_below`` or at least
    ``settle_above`` keeps those scores without running the reader. Calibration sets
    both bounds where the evidence model alone was right on the calibration pairs; the
    defaults never settle. ``reader_runs`` and ``settled`` count what happened.

    Normalisation: the stacked logistic model's probability that the passage answers.

    Args:
        grader: The grader directory written by ``llama-crag train-grader`` (or ``CRAG_GRADER``).
        embed_model: The embedding model for the cosine feature (bundled MiniLM by default).
        corpus: Texts whose document frequencies give the IDF weights.
        quantize: Score with the int8 dynamically quantised encoder (the AUROC in the grader
            directory was re-measured with it); by default what the grader directory says
            (``"quantize"``), else int8.

    A grader directory may carry its fitted stacking (``"stack"`` in ``grader.json``: the
    weights, the evidence-only weights of the cascade and its settling bounds) and the
    three-band thresholds fitted with it (``"thresholds"``); the packaged grader does, so it
    grades well before any calibration on the user's data.
    """

    normalization = "stacked logistic-model probability over the evidence features and a trained reader"
    feature_names = READER_FEATURES
    #: The reader's logit weighs like a strong feature until calibration fits the model.
    DEFAULT_READER_WEIGHT = 1.0

    def __init__(
        self,
        grader: Optional[str | Path] = None,
        embed_model: Optional[BaseEmbedding] = None,
        corpus: Optional[Iterable[str]] = None,
        quantize: Optional[bool] = None,
        threads: Optional[int] = None,
    ) -> None:
        grader = grader or os.environ.get("CRAG_GRADER")
        if not grader:
            raise ValueError(
                "ReaderScorer needs a grader directory: grader=... or CRAG_GRADER (llama-crag train-grader)"
            )
        super().__init__(
            embed_model,
            weights=tuple(self.DEFAULT_WEIGHTS[:-1]) + (self.DEFAULT_READER_WEIGHT, self.DEFAULT_WEIGHTS[-1]),
            corpus=corpus,
        )
        self.reader, self._encoder, self.info = load_reader(grader, quantize=quantize)
        # The folder's name reads well; the weights' digest tells two graders in folders of one name apart,
        # so that a calibration fitted for one is never taken for the other.
        weights = file_sha256(Path(grader) / WEIGHTS_FILE)[:8]
        self.name = f"reader:{Path(grader).name}#{weights}@{self.info['base_fingerprint'][:8]}+" + self.name
        self.evidence_weights = np.asarray(self.DEFAULT_WEIGHTS, dtype=np.float64)
        self.settle_below = 0.0
        self.settle_above = 1.01
        self.reader_runs = 0
        self.settled = 0
        if self.info.get("stack"):
            self.load_state(self.info["stack"])
        if self.info.get("thresholds") and self.default_thresholds is not None:  # fitted with the bundled MiniLM
            self.default_thresholds = {k: float(v) for k, v in self.info["thresholds"].items()}
        self._threads = threads
        self._read: Dict[Tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def read(self, query: str, texts: Sequence[str]) -> np.ndarray:
        """The reader's logit for each passage: the best over its windows (recent pairs are remembered)."""
        import torch

        with self._lock:
            known = {t: self._read[(query, t)] for t in dict.fromkeys(texts) if (query, t) in self._read}
        spans: List[Tuple[str, str]] = [(t, w) for t in dict.fromkeys(texts) if t not in known for w in windows(t)]
        if spans:
            if self._threads:
                torch.set_num_threads(self._threads)
            logits = self.reader.score([query] * len(spans), [w for _, w in spans], encoder=self._encoder)
            fresh: Dict[str, float] = {}
            for (text, _), value in zip(spans, logits):
                fresh[text] = max(fresh.get(text, -np.inf), float(value))
            known.update(fresh)
            with self._lock:
                self._read.update({(query, t): v for t, v in fresh.items()})
                while len(self._read) > READ_CACHE_SIZE:
                    self._read.pop(next(iter(self._read)))
        return np.asarray([known[t] for t in texts])

    def _stack(self, query: str, texts: Sequence[str], evidence: np.ndarray) -> np.ndarray:
        self.reader_runs += 1
        return np.hstack([evidence, self.read(query, texts).reshape(-1, 1)])

    def score_texts(self, query: str, texts: Sequence[str]) -> List[float]:
        if not texts:
            return []
        evidence = self._read_features(query, texts)[0]
        first = [sigmoid(float(v)) for v in evidence @ self.evidence_weights[:-1] + self.evidence_weights[-1]]
        if max(first) < self.settle_below or max(first) >= self.settle_above:
            self.settled += 1
            return first
        self.reader_runs += 1
        rows = np.hstack([evidence, self.read(query, texts).reshape(-1, 1)])
        return [sigmoid(float(v)) for v in rows @ self.weights[:-1] + self.weights[-1]]

    def fit(self, features: np.ndarray, labels: ArrayLike, weights: Optional[ArrayLike] = None) -> ReaderScorer:
        """Fit the stacked model, the evidence-only model of the cascade, and where the cascade may settle.

        The cascade settles low below the evidence score under which at most 1% of the
        answering pairs fall, and high from the score above which at most 1% of the
        pairs do not answer (never, when on-topic noise scores that high).
        """
        y = np.asarray(labels, dtype=bool)
        super().fit(features, y, weights)
        self.evidence_weights = fit_logistic(features[:, : len(FEATURES)], y, weights)
        first = 1.0 / (
            1.0 + np.exp(-(features[:, : len(FEATURES)] @ self.evidence_weights[:-1] + self.evidence_weights[-1]))
        )
        positives = np.sort(first[y])
        self.settle_below = float(positives[int(len(positives) * 0.01)]) if len(positives) >= 100 else 0.0
        self.settle_above = 1.01
        for threshold in np.unique(np.round(first, 3)):
            above = first >= threshold
            if above.sum() >= 20 and (~y[above]).mean() <= 0.01:
                self.settle_above = float(threshold)
                break
        return self

    def state(self) -> Dict[str, Any]:
        return {
            **super().state(),
            "evidence_weights": [round(float(w), 6) for w in self.evidence_weights],
            "settle_below": round(self.settle_below, 4),
            "settle_above": round(self.settle_above, 4),
            "grader": {k: self.info[k] for k in ("base_model", "base_fingerprint", "held_out_auroc_int8", "date")},
        }

    def load_state(self, state: Mapping[str, Any]) -> ReaderScorer:
        super().load_state(state)
        fitted_for = [f for f in state.get("features", []) if f != "reader"]
        self.evidence_weights = align_weights(fitted_for, state["evidence_weights"], FEATURES)
        self.settle_below = float(state["settle_below"])
        self.settle_above = float(state["settle_above"])
        return self
