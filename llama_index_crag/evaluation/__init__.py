"""Evaluation harness: CRAG against plain RAG, rerank-only and an LLM-judge CRAG, side by side, on one dataset.

``harness.run_evaluation`` runs it; ``command`` is ``llama-crag eval``; ``systems`` builds the engines.
"""

#: The evaluated systems (``--systems``), in the order the report shows them (``systems.SYSTEMS`` builds each).
SYSTEM_NAMES = ("plain", "rerank", "crag", "llm-judge")
