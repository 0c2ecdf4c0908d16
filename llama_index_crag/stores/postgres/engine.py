"""``engine_from_store``: the corrective engine whose every step reads the PostgreSQL store and nothing else."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from llama_index.core.base.embeddings.base import BaseEmbedding

from llama_index_crag.core.engine import CorrectiveQueryEngine
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.stores.postgres.parts import store_parts
from llama_index_crag.stores.postgres.store import DEFAULT_TABLE, PostgresStore


def engine_from_store(
    store: Union[str, PostgresStore, Any],
    llm: Any = None,
    embed_model: Optional[BaseEmbedding] = None,
    scorer: Optional[RelevanceScorer] = None,
    fallback_sources: Sequence[str] = ("fulltext", "sentence_window"),
    grader: Optional[str] = None,
    table: str = DEFAULT_TABLE,
    **engine_kwargs: Any,
) -> CorrectiveQueryEngine:
    """The corrective engine over a PostgreSQL store, reading nothing but what each query needs.

    ``store`` is a ``postgresql://`` URL, a ``PostgresStore``, or a LlamaIndex
    ``PGVectorStore`` whose table ``llama-crag ingest --store`` (or ``ingest``) filled.
    Retrieval is pgvector's; the fallback is full-text search and sentence windows in
    PostgreSQL; grading reuses the stored embeddings and reads the IDF of the query's
    words only. Other keywords go to ``CorrectiveQueryEngine.from_defaults`` (the LLM,
    ``calibration_path``, ``CragSettings`` fields such as ``upper`` or ``enabled``).
    """
    parts = store_parts(
        store,
        embed_model,
        scorer,
        fallback_sources,
        grader,
        table,
        settings=engine_kwargs,
        calibration_path=engine_kwargs.get("calibration_path"),
        postprocessors=engine_kwargs.pop("node_postprocessors", None),
    )
    return CorrectiveQueryEngine.from_defaults(
        retriever=parts.retriever,
        llm=llm,
        scorer=parts.scorer,
        embed_model=parts.embed_model,
        fallback=parts.fallback,
        node_postprocessors=parts.postprocessors,
        **engine_kwargs,
    )
