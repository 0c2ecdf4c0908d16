"""RelevanceGrader: scores and labels each candidate and sets the batch verdict."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Dict, List, Literal, Optional, Sequence

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.indices.base import BaseIndex
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.base import BaseEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle

from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.scorers.evidence import EvidenceScorer
from llama_index_crag.scorers.registry import default_scorer

dispatcher = get_dispatcher(__name__)

Aggregation = Literal["max", "mean", "count"]


class CragGradeEvent(BaseEvent):
    """Emitted each time a batch of candidates is graded."""

    query: str
    node_ids: List[str]
    scores: List[float]
    labels: List[str]
    aggregate: float
    verdict: str

    @classmethod
    def class_name(cls) -> str:
        return "CragGradeEvent"


class Verdict(str, Enum):
    """The three bands of CRAG, for one candidate (its label) or for the batch."""

    CORRECT = "correct"
    AMBIGUOUS = "ambiguous"
    INCORRECT = "incorrect"


def band(score: float, upper: float, lower: float) -> Verdict:
    """Place a score in its band: correct at or above ``upper``, incorrect below ``lower``."""
    if score >= upper:
        return Verdict.CORRECT
    if score >= lower:
        return Verdict.AMBIGUOUS
    return Verdict.INCORRECT


def scorer_over(
    nodes: Sequence[BaseNode], scorer: Optional[RelevanceScorer] = None, embed_model: Optional[BaseEmbedding] = None
) -> RelevanceScorer:
    """``scorer`` (the default one when None, as ``from_defaults`` chooses it) with the word statistics of the
    corpus ``nodes`` make, so that a passage grades alone as it does in an engine over the same nodes."""
    corpus = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes]
    if scorer is None:
        return default_scorer(embed_model, corpus or None)
    if isinstance(scorer, EvidenceScorer) and corpus:
        scorer.fit_corpus(corpus)
    return scorer


@dataclass(frozen=True)
class Grading:
    """The grader's judgement of one batch of candidates."""

    scores: List[float]
    labels: List[Verdict]
    aggregate: float
    top_score: float
    verdict: Verdict
    #: Per candidate, why it scored what it did (``RelevanceScorer.explain``); ``None`` unless asked for.
    explanations: Optional[List[Dict[str, Any]]] = None


class RelevanceGrader(BaseNodePostprocessor):
    """Scores each retrieved node for relevance and decides the batch's band.

    Used inside ``CorrectiveQueryEngine`` it routes the query. Used alone as a node
    postprocessor (for example in ``RetrieverQueryEngine``) it replaces each node's
    score with its relevance, drops the nodes graded incorrect, and returns nothing
    when the whole batch is incorrect, so the stock synthesizer never answers from a
    passage that does not hold the answer.

    Aggregation turns per-node scores into the batch score compared with the bands:
    ``max`` (the best candidate decides), ``mean``, or ``count`` (the
    ``min_relevant``-th best score: at least that many candidates must clear a band).

    ``upper`` and ``lower`` default to the scorer's own (``default_thresholds``, fitted
    for its scale); a scorer that ships none needs them given. ``from_nodes`` and
    ``from_index`` also give the scorer the corpus's word statistics.
    """

    upper: float = Field(description="Batch score at or above which retrieval is CORRECT.")
    lower: float = Field(description="Batch score below which retrieval is INCORRECT.")
    aggregation: Aggregation = Field(default="max", description="How node scores become the batch score.")
    min_relevant: int = Field(
        default=2, ge=1, description="For aggregation='count': candidates that must clear a band."
    )
    explain: bool = Field(
        default=False,
        description="Also ask the scorer why each candidate scored what it did (the evidence scorer can say).",
    )
    _scorer: RelevanceScorer = PrivateAttr()

    def __init__(
        self,
        scorer: RelevanceScorer,
        upper: Optional[float] = None,
        lower: Optional[float] = None,
        aggregation: Aggregation = "max",
        min_relevant: int = 2,
        explain: bool = False,
        **kwargs: Any,
    ) -> None:
        upper = scorer.shipped_threshold("upper", "RelevanceGrader") if upper is None else upper
        lower = scorer.shipped_threshold("lower", "RelevanceGrader") if lower is None else lower
        if not 0.0 <= lower <= upper <= 1.0:
            raise ValueError(f"thresholds must satisfy 0 <= lower <= upper <= 1, got lower={lower}, upper={upper}")
        super().__init__(
            upper=upper, lower=lower, aggregation=aggregation, min_relevant=min_relevant, explain=explain, **kwargs
        )
        self._scorer = scorer

    @classmethod
    def class_name(cls) -> str:
        return "RelevanceGrader"

    @classmethod
    def from_nodes(
        cls,
        nodes: Sequence[BaseNode],
        scorer: Optional[RelevanceScorer] = None,
        embed_model: Optional[BaseEmbedding] = None,
        **kwargs: Any,
    ) -> RelevanceGrader:
        """A grader whose scorer (the default one when None) knows the word statistics of ``nodes``.

        Args:
            nodes: The corpus the retriever searches.
            scorer: The scorer; an evidence-feature scorer learns its IDF weights from ``nodes``.
            embed_model: The embedding model of the default scorer.
            **kwargs: The grader's other arguments (``upper``, ``lower``, ``aggregation`` ...).
        """
        return cls(scorer_over(nodes, scorer, embed_model), **kwargs)

    @classmethod
    def from_index(cls, index: BaseIndex, **kwargs: Any) -> RelevanceGrader:
        """``from_nodes`` over the nodes of ``index``'s docstore (``kwargs`` as ``from_nodes`` takes them)."""
        return cls.from_nodes(list(index.docstore.docs.values()), **kwargs)

    @property
    def scorer(self) -> RelevanceScorer:
        """The scorer behind the grades (also used for knowledge strips)."""
        return self._scorer

    def grade(self, query_bundle: QueryBundle, nodes: Sequence[NodeWithScore]) -> Grading:
        """Score and label ``nodes`` for ``query_bundle`` and decide the batch verdict."""
        scores = self._scorer.score_nodes(query_bundle, nodes) if nodes else []
        grading = self._judge(scores)
        if self.explain and nodes:
            grading = replace(grading, explanations=self._scorer.explain_nodes(query_bundle, nodes))
        dispatcher.event(
            CragGradeEvent(
                query=query_bundle.query_str,
                node_ids=[n.node.node_id for n in nodes],
                scores=grading.scores,
                labels=[label.value for label in grading.labels],
                aggregate=grading.aggregate,
                verdict=grading.verdict.value,
            )
        )
        return grading

    async def agrade(self, query_bundle: QueryBundle, nodes: Sequence[NodeWithScore]) -> Grading:
        """``grade`` off the event loop (scoring is CPU-bound)."""
        return await asyncio.to_thread(self.grade, query_bundle, nodes)

    def _judge(self, scores: List[float]) -> Grading:
        ranked = sorted(scores, reverse=True)
        if not ranked:
            aggregate = 0.0
        elif self.aggregation == "max":
            aggregate = ranked[0]
        elif self.aggregation == "mean":
            aggregate = sum(ranked) / len(ranked)
        else:
            aggregate = ranked[self.min_relevant - 1] if len(ranked) >= self.min_relevant else 0.0
        return Grading(
            scores=scores,
            labels=[band(s, self.upper, self.lower) for s in scores],
            aggregate=aggregate,
            top_score=ranked[0] if ranked else 0.0,
            verdict=band(aggregate, self.upper, self.lower),
        )

    def _postprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        if query_bundle is None:
            raise ValueError("RelevanceGrader needs the query: pass query_bundle or query_str")
        grading = self.grade(query_bundle, nodes)
        if grading.verdict is Verdict.INCORRECT:
            return []
        return [
            NodeWithScore(node=n.node, score=s)
            for n, s, label in zip(nodes, grading.scores, grading.labels)
            if label is not Verdict.INCORRECT
        ]
