"""Reuse of the scores an upstream reranker already put on the nodes (no second model call)."""

from __future__ import annotations

import math
from typing import Any, Callable, List, Literal, Optional, Sequence

from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from llama_index_crag.scorers.base import RelevanceScorer, sigmoid

Normalization = Literal["identity", "sigmoid"]


class UpstreamScoreScorer(RelevanceScorer):
    """Grades with the scores an upstream reranker in the pipeline already computed.

    Put the reranker in the engine's ``node_postprocessors``; grading then reads
    ``NodeWithScore.score`` and makes no model call of its own. Knowledge strips have
    no upstream score, so they are scored by the reranker's own model (same model, same
    scale, none cut by its ``top_n``) when one is given. Fallback results go through the
    pipeline's postprocessors before they are graded, so they carry the same scores.

    Normalisation: ``"identity"`` for rerankers that already output probabilities
    (sentence-transformers ``SentenceTransformerRerank`` applies the model's sigmoid),
    ``"sigmoid"`` for rerankers that output logits (``FlagEmbeddingReranker``).
    ``from_reranker`` picks it for you.

    Args:
        reranker: The upstream reranker, used only to score knowledge strips.
        normalization: How to map the upstream scores to [0, 1].
    """

    reuses_upstream_scores = True

    def __init__(
        self,
        reranker: Optional[BaseNodePostprocessor] = None,
        normalization: Normalization = "identity",
    ) -> None:
        if normalization not in ("identity", "sigmoid"):
            raise ValueError(f"normalization must be 'identity' or 'sigmoid', not {normalization!r}")
        self.reranker = reranker
        self.normalization = (
            "upstream score as is (must be in [0, 1])"
            if normalization == "identity"
            else "sigmoid of the upstream logit"
        )
        self._map: Callable[[float], float] = sigmoid if normalization == "sigmoid" else float
        self._identity = normalization == "identity"
        model = getattr(reranker, "model", None) if reranker is not None else None
        self.name = f"upstream:{reranker.class_name() if reranker else 'scores'}:{model or 'unknown'}"

    @classmethod
    def from_reranker(cls, reranker: BaseNodePostprocessor) -> UpstreamScoreScorer:
        """Reuse a known reranker's scores with the right normalisation."""
        normalization: Normalization = "sigmoid" if reranker.class_name() == "FlagEmbeddingReranker" else "identity"
        return cls(reranker=reranker, normalization=normalization)

    def _normalise(self, raw: Optional[float]) -> float:
        if raw is not None and math.isnan(raw):
            raise ValueError("a node reached the grader with a NaN score: the upstream reranker failed on it")
        if raw is None:
            raise ValueError(
                "a node reached the grader without a score: UpstreamScoreScorer needs a "
                "reranker in node_postprocessors, before grading"
            )
        if self._identity and not 0.0 <= raw <= 1.0:
            raise ValueError(
                f"upstream score {raw:.3f} is outside [0, 1]: the reranker outputs logits, "
                "so use UpstreamScoreScorer(normalization='sigmoid')"
            )
        return self._map(raw)

    def score_nodes(self, query_bundle: QueryBundle, nodes: Sequence[NodeWithScore]) -> List[float]:
        return [self._normalise(n.score) for n in nodes]

    def score_texts(self, query: str, texts: Sequence[str]) -> List[float]:
        if self.reranker is None:
            raise ValueError(
                "scoring knowledge strips needs the reranker itself: "
                "build the scorer with UpstreamScoreScorer.from_reranker(reranker)"
            )
        model: Any = getattr(self.reranker, "_model", None)
        pairs = [(query, text) for text in texts]
        if hasattr(model, "compute_score"):  # FlagEmbedding's FlagReranker
            raw = model.compute_score(pairs)
            return [self._normalise(float(v)) for v in ([raw] if isinstance(raw, float) else raw)]
        if hasattr(model, "predict"):  # sentence-transformers' CrossEncoder
            return [self._normalise(float(v)) for v in model.predict(pairs, show_progress_bar=False)]
        candidates = [NodeWithScore(node=TextNode(text=t, id_=str(i))) for i, t in enumerate(texts)]
        ranked = self.reranker.postprocess_nodes(candidates, QueryBundle(query))
        by_id = {n.node.node_id: self._normalise(n.score) for n in ranked}
        return [by_id.get(str(i), 0.0) for i in range(len(texts))]
