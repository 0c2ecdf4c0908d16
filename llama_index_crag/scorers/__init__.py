"""Relevance scorers behind one interface; each maps its raw output to [0, 1]."""

from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.scorers.bi_encoder import BiEncoderScorer
from llama_index_crag.scorers.cross_encoder import CrossEncoderScorer
from llama_index_crag.scorers.evidence import EvidenceScorer
from llama_index_crag.scorers.llm_judge import LLMJudgeScorer
from llama_index_crag.scorers.reuse import UpstreamScoreScorer

__all__ = [
    "BiEncoderScorer",
    "CrossEncoderScorer",
    "EvidenceScorer",
    "LLMJudgeScorer",
    "RelevanceScorer",
    "UpstreamScoreScorer",
]
