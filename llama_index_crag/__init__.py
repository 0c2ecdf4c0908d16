"""Corrective RAG for LlamaIndex: grade retrieval, then refine, fall back, rewrite or abstain."""

from llama_index_crag.answers.extract import EvidenceQuoter
from llama_index_crag.answers.grounding import AnswerCheck, GroundednessChecker
from llama_index_crag.engine import (
    CorrectiveQueryEngine,
    GenerationError,
    InvalidQueryError,
    RetrievalUnavailableError,
)
from llama_index_crag.fallback import FallbackRetriever
from llama_index_crag.grader import Grading, RelevanceGrader, Verdict
from llama_index_crag.refiner import StripRefiner
from llama_index_crag.rewrite import QueryRewriter, RewriteError, RewrittenQuery
from llama_index_crag.settings import CragSettings, WebSearchSettings
from llama_index_crag.web import WebSearchRetriever

__all__ = [
    "AnswerCheck",
    "CorrectiveQueryEngine",
    "CragSettings",
    "EvidenceQuoter",
    "FallbackRetriever",
    "GenerationError",
    "RetrievalUnavailableError",
    "Grading",
    "GroundednessChecker",
    "InvalidQueryError",
    "QueryRewriter",
    "RelevanceGrader",
    "RewriteError",
    "RewrittenQuery",
    "StripRefiner",
    "Verdict",
    "WebSearchRetriever",
    "WebSearchSettings",
]
