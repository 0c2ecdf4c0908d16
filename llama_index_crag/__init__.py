"""Corrective RAG for LlamaIndex: grade retrieval, then refine, fall back, rewrite or abstain.

The names below are loaded on first use, so that importing a submodule (the CLI, the
errors, a store) does not load the engine, its models and torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

from llama_index_crag._lazy import LazyExports

#: Each public name and the module that defines it.
_EXPORTS: Dict[str, str] = {
    "AnswerCheck": "llama_index_crag.answers.grounding",
    "CorrectiveQueryEngine": "llama_index_crag.core.engine",
    "CorrectiveRetriever": "llama_index_crag.core.retriever",
    "CorrectiveTimeout": "llama_index_crag.errors",
    "CragActionEvent": "llama_index_crag.core.loop",
    "CragError": "llama_index_crag.errors",
    "CragGradeEvent": "llama_index_crag.core.grader",
    "CragSettings": "llama_index_crag.core.settings",
    "CragStepEvent": "llama_index_crag.core.loop",
    "CragTrace": "llama_index_crag.core.loop",
    "EvidenceQuoter": "llama_index_crag.answers.extract",
    "FallbackRetriever": "llama_index_crag.core.fallback",
    "GenerationError": "llama_index_crag.errors",
    "Grading": "llama_index_crag.core.grader",
    "GroundednessChecker": "llama_index_crag.answers.grounding",
    "InvalidQueryError": "llama_index_crag.errors",
    "QueryRewriter": "llama_index_crag.core.rewrite",
    "RelevanceGrader": "llama_index_crag.core.grader",
    "RetrievalUnavailableError": "llama_index_crag.errors",
    "RewriteError": "llama_index_crag.errors",
    "RewrittenQuery": "llama_index_crag.core.rewrite",
    "StripRefiner": "llama_index_crag.core.refiner",
    "Verdict": "llama_index_crag.core.grader",
    "WebSearchRetriever": "llama_index_crag.web.retriever",
    "WebSearchSettings": "llama_index_crag.web.settings",
    "load_engine": "llama_index_crag.core.persisted",
    "load_folder": "llama_index_crag.stores.folder",
    "load_index": "llama_index_crag.stores.folder",
}

__all__ = [
    "AnswerCheck",
    "CorrectiveQueryEngine",
    "CorrectiveRetriever",
    "CorrectiveTimeout",
    "CragActionEvent",
    "CragError",
    "CragGradeEvent",
    "CragSettings",
    "CragStepEvent",
    "CragTrace",
    "EvidenceQuoter",
    "FallbackRetriever",
    "GenerationError",
    "Grading",
    "GroundednessChecker",
    "InvalidQueryError",
    "QueryRewriter",
    "RelevanceGrader",
    "RetrievalUnavailableError",
    "RewriteError",
    "RewrittenQuery",
    "StripRefiner",
    "Verdict",
    "WebSearchRetriever",
    "WebSearchSettings",
    "load_engine",
    "load_folder",
    "load_index",
]


_lazy = LazyExports(__name__, _EXPORTS)


def __getattr__(name: str) -> Any:
    return _lazy.get(name)


def __dir__() -> list[str]:
    return _lazy.names()


if TYPE_CHECKING:
    from llama_index_crag.answers.extract import EvidenceQuoter
    from llama_index_crag.answers.grounding import AnswerCheck, GroundednessChecker
    from llama_index_crag.core.engine import CorrectiveQueryEngine
    from llama_index_crag.core.fallback import FallbackRetriever
    from llama_index_crag.core.grader import CragGradeEvent, Grading, RelevanceGrader, Verdict
    from llama_index_crag.core.loop import CragActionEvent, CragStepEvent, CragTrace
    from llama_index_crag.core.persisted import load_engine
    from llama_index_crag.core.refiner import StripRefiner
    from llama_index_crag.core.retriever import CorrectiveRetriever
    from llama_index_crag.core.rewrite import QueryRewriter, RewrittenQuery
    from llama_index_crag.core.settings import CragSettings
    from llama_index_crag.errors import (
        CorrectiveTimeout,
        CragError,
        GenerationError,
        InvalidQueryError,
        RetrievalUnavailableError,
        RewriteError,
    )
    from llama_index_crag.stores.folder import load_folder, load_index
    from llama_index_crag.web.retriever import WebSearchRetriever
    from llama_index_crag.web.settings import WebSearchSettings
