"""Evaluation harness: CRAG against plain RAG, rerank-only and an LLM-judge CRAG, side by side, on one dataset."""

from llama_index_crag.evaluation.command import add_eval_parser
from llama_index_crag.evaluation.harness import EvalConfig, run_evaluation

__all__ = ["EvalConfig", "add_eval_parser", "run_evaluation"]
