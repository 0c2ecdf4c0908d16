"""The evaluated systems, all over the same index and generator: plain RAG, rerank-only, CRAG, LLM-judge CRAG."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms import LLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, QueryBundle

from llama_index_crag.core.engine import CorrectiveQueryEngine
from llama_index_crag.core.settings import CragSettings
from llama_index_crag.errors import ConfigError
from llama_index_crag.evaluation import SYSTEM_NAMES
from llama_index_crag.evaluation.corpus import EvalCorpus
from llama_index_crag.evaluation.llm_judge import LLMJudgeQueryEngine
from llama_index_crag.scorers.base import RelevanceScorer


class ScorerRerank(BaseNodePostprocessor):
    """Reorders candidates by a relevance scorer and keeps the best ``top_n``: the rerank-only baseline.

    No cross-encoder weights exist offline, so the evaluation reranks with the scorer
    CRAG grades with (by default the bundled bi-encoder): the two systems then differ
    only in what they do with the scores.
    """

    top_n: int = Field(default=3, ge=1, description="Candidates kept after reranking.")
    _scorer: RelevanceScorer = PrivateAttr()

    def __init__(self, scorer: RelevanceScorer, top_n: int = 3) -> None:
        super().__init__(top_n=top_n)
        self._scorer = scorer

    @classmethod
    def class_name(cls) -> str:
        return "ScorerRerank"

    def _postprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        if query_bundle is None:
            raise ValueError("ScorerRerank needs the query: pass query_bundle or query_str")
        scores = self._scorer.score_nodes(query_bundle, nodes)
        ranked = sorted(zip(nodes, scores), key=lambda pair: pair[1], reverse=True)[: self.top_n]
        return [NodeWithScore(node=n.node, score=score) for n, score in ranked]


@dataclass(frozen=True)
class SystemParts:
    """What every system is built from, so that they differ only in their own logic.

    Each system gets its own scorer (``make_scorer``): scorers cache passage
    embeddings, and one system must not grade from another's warm cache.
    """

    corpus: EvalCorpus
    make_scorer: Callable[[], RelevanceScorer]
    #: The generator; None where none is installed (CRAG then rewrites with the question's keywords).
    llm: Optional[LLM]
    synthesizer: BaseSynthesizer
    top_k: int
    rerank_top_k: int
    rerank_top_n: int
    calibration: Optional[Path]
    #: CRAG's own settings for this run (answer mode, answer check); the baselines do not read them.
    crag_settings: Mapping[str, Any] = field(default_factory=dict)


def plain(parts: SystemParts) -> BaseQueryEngine:
    """Top-k, then generate (our engine with CRAG off: the ``CRAG_ENABLED=false`` baseline)."""
    return _engine(parts, parts.top_k, enabled=False)


def rerank(parts: SystemParts) -> BaseQueryEngine:
    """Top-k, rerank, top-n, then generate."""
    scorer = parts.make_scorer()
    return _engine(
        parts,
        parts.rerank_top_k,
        enabled=False,
        scorer=scorer,
        postprocessors=[ScorerRerank(scorer, parts.rerank_top_n)],
    )


def crag(parts: SystemParts) -> BaseQueryEngine:
    """Ours: grade, then generate, refine, fall back or abstain."""
    return _engine(parts, parts.top_k, enabled=True, **parts.crag_settings)


def llm_judge(parts: SystemParts) -> BaseQueryEngine:
    """CRAG with the generator as a per-chunk yes/no judge (CorrectiveRAGPack, LangGraph's tutorial)."""
    if parts.llm is None:
        raise ConfigError("llm-judge judges each chunk with the generator: make local, or leave it out of --systems")
    return LLMJudgeQueryEngine(
        retriever=parts.corpus.retriever(parts.top_k),
        llm=parts.llm,
        fallback=parts.corpus.fallback_retriever(parts.top_k),
        response_synthesizer=parts.synthesizer,
        abstain_text=CragSettings.model_fields["abstain_text"].default,
    )


#: ``--systems`` values, in the order the report shows them.
SYSTEMS: Dict[str, Callable[[SystemParts], BaseQueryEngine]] = {
    "plain": plain,
    "rerank": rerank,
    "crag": crag,
    "llm-judge": llm_judge,
}
assert tuple(SYSTEMS) == SYSTEM_NAMES, "evaluation.SYSTEM_NAMES lists the systems, in order"


def _engine(
    parts: SystemParts,
    top_k: int,
    enabled: bool,
    scorer: Optional[RelevanceScorer] = None,
    postprocessors: Optional[List[BaseNodePostprocessor]] = None,
    **settings: Any,
) -> CorrectiveQueryEngine:
    return CorrectiveQueryEngine.from_defaults(
        retriever=parts.corpus.retriever(top_k),
        llm=parts.llm,
        scorer=scorer or parts.make_scorer(),
        fallback=parts.corpus.fallback_retriever(parts.top_k),
        response_synthesizer=parts.synthesizer,
        node_postprocessors=postprocessors,
        calibration_path=str(parts.calibration) if parts.calibration else None,
        enabled=enabled,
        **settings,
    )
