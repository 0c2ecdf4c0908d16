"""StripRefiner: decompose chunks into knowledge strips, re-score them, recompose the relevant ones."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.indices.base import BaseIndex
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, NodeRelationship, NodeWithScore, QueryBundle, TextNode

from llama_index_crag.core.grader import scorer_over
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.text.strips import STRIPS_KEY, Strip, decompose


@dataclass(frozen=True)
class StripGrade:
    """One strip as the trace shows it: its text, the candidate it came from, its score, and whether it was kept."""

    node_id: str
    text: str
    score: float
    kept: bool


@dataclass(frozen=True)
class Refinement:
    """What the refiner kept: recomposed nodes, the strip counts, and every strip graded (kept or not)."""

    nodes: List[NodeWithScore]
    kept: int
    dropped: int
    used_original: bool
    strips: List[StripGrade] = field(default_factory=list)


class StripRefiner(BaseNodePostprocessor):
    """Knowledge refinement for the AMBIGUOUS band (CRAG's decompose-then-recompose).

    Each node is split into strips (see ``decompose``), every strip is scored against
    the query with the grader's scorer in one batch, strips scoring at least
    ``threshold`` are kept, and each node's kept strips are joined in their original
    order into a new node that points back to its source. If no strip survives, the
    original nodes are returned unchanged: the original ranking beats nothing.

    ``threshold`` defaults to the scorer's own strip threshold (``default_thresholds``);
    ``from_nodes`` and ``from_index`` also give the scorer the corpus's word statistics.
    """

    threshold: float = Field(ge=0.0, le=1.0, description="Strips scoring at least this are kept.")
    strip_min_tokens: int = Field(default=8, ge=1, description="Shortest strip in words; shorter sentences are merged.")
    _scorer: RelevanceScorer = PrivateAttr()

    def __init__(
        self, scorer: RelevanceScorer, threshold: Optional[float] = None, strip_min_tokens: int = 8, **kwargs: Any
    ) -> None:
        if threshold is None:
            threshold = scorer.shipped_threshold("strip_threshold", "StripRefiner")
        super().__init__(threshold=threshold, strip_min_tokens=strip_min_tokens, **kwargs)
        self._scorer = scorer

    @classmethod
    def class_name(cls) -> str:
        return "StripRefiner"

    @property
    def scorer(self) -> RelevanceScorer:
        """The scorer the strips are graded with (the grader's, in the engine)."""
        return self._scorer

    @classmethod
    def from_nodes(
        cls,
        nodes: Sequence[BaseNode],
        scorer: Optional[RelevanceScorer] = None,
        embed_model: Optional[BaseEmbedding] = None,
        **kwargs: Any,
    ) -> StripRefiner:
        """A refiner whose scorer (the default one when None) knows the word statistics of ``nodes``.

        Args:
            nodes: The corpus the retriever searches.
            scorer: The scorer; an evidence-feature scorer learns its IDF weights from ``nodes``.
            embed_model: The embedding model of the default scorer.
            **kwargs: The refiner's other arguments (``threshold``, ``strip_min_tokens``).
        """
        return cls(scorer_over(nodes, scorer, embed_model), **kwargs)

    @classmethod
    def from_index(cls, index: BaseIndex, **kwargs: Any) -> StripRefiner:
        """``from_nodes`` over the nodes of ``index``'s docstore (``kwargs`` as ``from_nodes`` takes them)."""
        return cls.from_nodes(list(index.docstore.docs.values()), **kwargs)

    def refine(self, query_bundle: QueryBundle, nodes: Sequence[NodeWithScore]) -> Refinement:
        """Decompose, re-score and recompose ``nodes`` for ``query_bundle``."""
        per_node = [
            decompose(n.node.get_content(), self.strip_min_tokens, str(n.node.metadata.get("title") or ""))
            for n in nodes
        ]
        flat = [strip.graded_text for strips in per_node for strip in strips]
        scores = self._scorer.score_texts(query_bundle.query_str, flat) if flat else []
        refined: List[NodeWithScore] = []
        graded: List[StripGrade] = []
        kept = 0
        cursor = 0
        for source, strips in zip(nodes, per_node):
            strip_scores = scores[cursor : cursor + len(strips)]
            cursor += len(strips)
            chosen = [(s, score) for s, score in zip(strips, strip_scores) if score >= self.threshold]
            graded.extend(
                StripGrade(source.node.node_id, s.text, round(float(score), 4), score >= self.threshold)
                for s, score in zip(strips, strip_scores)
            )
            if not chosen:
                continue
            kept += len(chosen)
            refined.append(_recompose(source, chosen))
        if not refined:
            return Refinement(nodes=list(nodes), kept=0, dropped=len(flat), used_original=True, strips=graded)
        return Refinement(nodes=refined, kept=kept, dropped=len(flat) - kept, used_original=False, strips=graded)

    async def arefine(self, query_bundle: QueryBundle, nodes: Sequence[NodeWithScore]) -> Refinement:
        """``refine`` off the event loop (scoring is CPU-bound)."""
        return await asyncio.to_thread(self.refine, query_bundle, nodes)

    def _postprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        if query_bundle is None:
            raise ValueError("StripRefiner needs the query: pass query_bundle or query_str")
        return self.refine(query_bundle, nodes).nodes


def _recompose(source: NodeWithScore, chosen: List[tuple[Strip, float]]) -> NodeWithScore:
    original = source.node
    if len(chosen) == 1 and chosen[0][0].text == original.get_content().strip():
        return NodeWithScore(node=original, score=chosen[0][1])
    text = "\n".join(strip.text for strip, _ in chosen)
    graded = [
        {"text": s.text, "whole_block": s.whole_block, "context": s.context, "score": round(float(score), 6)}
        for s, score in chosen
    ]
    node = TextNode(
        id_=f"{original.node_id}#strips",
        text=text,
        metadata={**original.metadata, STRIPS_KEY: json.dumps(graded)},
        excluded_embed_metadata_keys=[*original.excluded_embed_metadata_keys, STRIPS_KEY],
        excluded_llm_metadata_keys=[*original.excluded_llm_metadata_keys, STRIPS_KEY],
        relationships={NodeRelationship.SOURCE: original.as_related_node_info()},
    )
    return NodeWithScore(node=node, score=max(score for _, score in chosen))
