"""The one interface every relevance scorer implements, and the numbers a fitted scorer's state is made of."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle
from numpy.typing import ArrayLike

from llama_index_crag.errors import ConfigError, DatasetError


def sigmoid(value: float) -> float:
    """Map a logit to (0, 1) without overflowing on large magnitudes."""
    if value >= 0:
        return 1.0 / (1.0 + math.exp(-value))
    exp = math.exp(value)
    return exp / (1.0 + exp)


def node_text(node: NodeWithScore) -> str:
    """The text a scorer judges: what the embedding model saw, metadata included."""
    return node.node.get_content(metadata_mode=MetadataMode.EMBED)


class RelevanceScorer(ABC):
    """Scores how well passages answer a query, each score in [0, 1].

    Every scorer states its normalisation in ``normalization`` so that a reader of a
    trace or a calibration file knows what a 0.7 means. ``name`` identifies the scorer
    and its model; calibration files record it and refuse to load for another one.
    """

    name: str = "scorer"
    normalization: str = "scores are already in [0, 1]"
    reuses_upstream_scores: bool = False
    #: What went wrong in building this scorer that a user should see (a grader that could not be
    #: loaded, say); every trace of an engine grading with it carries these in ``warnings``.
    warnings: Tuple[str, ...] = ()
    #: The thresholds (``upper``, ``lower``, ``strip_threshold``) this scorer ships with, fitted for its
    #: scale; ``None`` when it has none (the settings' own defaults apply).
    default_thresholds: Optional[Dict[str, float]] = None
    #: The bi-encoder inside this scorer, if any: the engine hands it the retriever's embeddings so that
    #: grading does not embed the same texts again (``scorers.bi_encoder.reuse_retrieval_embeddings``).
    bi_encoder: Optional[Any] = None

    def shipped_threshold(self, name: str, part: str) -> float:
        """The threshold ``name`` from ``default_thresholds`` (``strip_threshold`` falls back to ``lower``, as the
        engine's settings do), for a ``part`` ("RelevanceGrader") given none; a ``ConfigError`` when it ships none.
        """
        shipped = self.default_thresholds or {}
        value = shipped.get(name, shipped.get("lower")) if name == "strip_threshold" else shipped.get(name)
        if value is None:
            raise ConfigError(
                f"{part} needs {name}=: the scorer {self.name} ships no thresholds for its scale; fit them on "
                "your data (llama-crag calibrate) and pass them"
            )
        return float(value)

    def state(self) -> Optional[Dict[str, Any]]:
        """What calibration fitted inside the scorer (weights), JSON-ready; ``None`` when nothing is fitted."""
        return None

    def load_state(self, state: Mapping[str, Any]) -> RelevanceScorer:
        """Take back what ``state()`` returned (from a calibration file); a scorer with no state ignores it."""
        return self

    @abstractmethod
    def score_texts(self, query: str, texts: Sequence[str]) -> List[float]:
        """Score raw passages (used for knowledge strips)."""

    def explain(self, query: str, texts: Sequence[str]) -> Optional[List[Dict[str, Any]]]:
        """Why each passage scored what it did, one JSON-ready dict a passage; ``None`` when the scorer cannot say.

        Only scorers whose score is built from inspectable parts (the evidence scorer)
        explain themselves; a model's single logit has nothing more to show.
        """
        return None

    def explain_nodes(
        self, query_bundle: QueryBundle, nodes: Sequence[NodeWithScore]
    ) -> Optional[List[Dict[str, Any]]]:
        """``explain`` for retrieved nodes; an empty passage is explained as such (it scores 0 unread)."""
        texts = [node_text(n) for n in nodes]
        live = [i for i, text in enumerate(texts) if text.strip()]
        found = self.explain(query_bundle.query_str, [texts[i] for i in live]) if live else []
        if found is None:
            return None
        explanations: List[Dict[str, Any]] = [{"empty_passage": True} for _ in texts]
        for i, explanation in zip(live, found):
            explanations[i] = explanation
        return explanations

    def score_nodes(self, query_bundle: QueryBundle, nodes: Sequence[NodeWithScore]) -> List[float]:
        """Score retrieved nodes. Empty passages score 0 without a model call."""
        texts = [node_text(n) for n in nodes]
        return self._score_nonempty(query_bundle, texts)

    def _score_nonempty(self, query_bundle: QueryBundle, texts: Sequence[str]) -> List[float]:
        scores = [0.0] * len(texts)
        live = [i for i, text in enumerate(texts) if text.strip()]
        if live:
            found = self.score_texts(query_bundle.query_str, [texts[i] for i in live])
            for i, score in zip(live, found):
                scores[i] = min(1.0, max(0.0, float(score)))
        return scores


def finite_numbers(values: Any, what: str) -> np.ndarray:
    """``values`` as a flat array of finite floats, or a ``ConfigError`` naming ``what`` of the calibration."""
    try:
        array = np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"the calibration's {what} are not a list of numbers: {values!r}") from exc
    if isinstance(values, (str, bytes, Mapping)) or not np.isfinite(array).all():
        raise ConfigError(f"the calibration's {what} must be finite numbers: {values!r}")
    return array


def _mean_one(weight: Optional[ArrayLike]) -> Optional[np.ndarray]:
    """Row weights scaled to a mean of 1, so that the regularisation weighs as it does unweighted."""
    if weight is None:
        return None
    w = np.asarray(weight, dtype=np.float64)
    return w * (len(w) / w.sum())


def fit_logistic(features: np.ndarray, labels: ArrayLike, sample_weight: Optional[ArrayLike] = None) -> np.ndarray:
    """Class-balanced logistic regression: one weight per feature column, then the bias (``sample_weight``: one
    weight a row, multiplied into the class balance)."""
    from sklearn.linear_model import LogisticRegression

    y = np.asarray(labels, dtype=bool)
    if y.all() or not y.any():
        raise DatasetError("fitting a scorer's weights needs both relevant and irrelevant pairs")
    model = LogisticRegression(C=1.0, max_iter=2000, class_weight="balanced").fit(
        features, y, sample_weight=_mean_one(sample_weight)
    )
    return np.concatenate([model.coef_[0], model.intercept_])
