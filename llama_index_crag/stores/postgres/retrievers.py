"""Retrieval from the PostgreSQL store: pgvector for chunks and sentence windows, full-text search as BM25."""

from __future__ import annotations

import asyncio
import copy
import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, TypeVar

import numpy as np
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from llama_index_crag.scope import UNBOUNDED, Scope, ScopeLike
from llama_index_crag.stores.postgres.filters import scope_sql, sql
from llama_index_crag.stores.postgres.store import PostgresStore, row_node
from llama_index_crag.text.cleaning import clean_text

if TYPE_CHECKING:
    from psycopg import Connection

R = TypeVar("R", bound="_StoreRetriever")


class _StoreRetriever(BaseRetriever):
    """A retriever that reads one store inside a scope; async runs the same query in a worker thread (psycopg's
    pool is sync).

    ``scope`` (default: every row) is applied in the SQL of every query (``filters.scope_sql``), so the top k are
    the top k inside the scope; a scope that cannot be applied exactly raises ``ScopeError`` here, at build time.
    """

    #: The store's tables this retriever reads (``chunks`` or ``windows``), for its scope's SQL.
    _table = "chunks"

    def __init__(
        self,
        store: PostgresStore,
        similarity_top_k: int,
        scope: Optional[Scope] = None,
        callback_manager: Optional[CallbackManager] = None,
    ) -> None:
        self._store = store
        self._top_k = similarity_top_k
        self._set_scope(scope or UNBOUNDED)
        super().__init__(callback_manager=callback_manager)

    def _set_scope(self, scope: Scope) -> None:
        self.scope = scope
        self._where = scope_sql(scope, self._table)

    def scoped(self: R, scope: ScopeLike) -> R:
        """A copy narrowed to ``scope`` as well as its own (``Scope.narrow``), sharing the store and the model."""
        more = Scope.of(scope)
        if not more.bounded or more.key == self.scope.key:
            return self
        other = copy.copy(self)
        other._set_scope(self.scope.narrow(more))
        return other

    def _params(self, **query: Any) -> Dict[str, Any]:
        return {**self._where.params, **query}

    def _execute(self, conn: Connection[Any], query: Any, params: Dict[str, Any]) -> List[Any]:
        """Run a query of this retriever; a scoped one is planned for its values each time (never prepared).

        A prepared statement's generic plan cannot see the scope's values, so it guesses how many rows a
        filter keeps, and after a few executions PostgreSQL may settle on ranking all of a broad scope's rows
        exactly instead of walking the HNSW index (measured: 30 ms instead of 6 at 20,000 chunks, growing
        with the scope). Planned with the values, it walks the index for a broad scope and reads a narrow
        one through the metadata index.
        """
        return conn.execute(query, params, prepare=False if self._where.bounded else None).fetchall()

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


class _EmbeddingRetriever(_StoreRetriever):
    """A store retriever that embeds the query (and puts the vector on the bundle, for grading to reuse)."""

    def __init__(
        self,
        store: PostgresStore,
        embed_model: BaseEmbedding,
        similarity_top_k: int,
        scope: Optional[Scope] = None,
        callback_manager: Optional[CallbackManager] = None,
    ) -> None:
        self._embed_model = embed_model
        super().__init__(store, similarity_top_k, scope, callback_manager)

    def _query_vector(self, query_bundle: QueryBundle) -> np.ndarray:
        if query_bundle.embedding is None:
            query_bundle.embedding = self._embed_model.get_agg_embedding_from_queries(query_bundle.embedding_strs)
        return np.asarray(query_bundle.embedding, dtype=np.float32)

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        if query_bundle.embedding is None:
            query_bundle.embedding = await self._embed_model.aget_agg_embedding_from_queries(
                query_bundle.embedding_strs
            )
        return await asyncio.to_thread(self._retrieve, query_bundle)

    def _nearest(self, columns: str, vector: np.ndarray, limit: int) -> List[Any]:
        """The ``limit`` rows of the table nearest ``vector`` inside the scope: ``columns`` and the score.

        The HNSW index serves the search; with a scope, pgvector 0.8's iterative scan goes on through the
        graph until ``limit`` rows inside the scope are found. Where it still comes back short (a scope
        narrower than the rows one scan visits, ``hnsw.max_scan_tuples``, or an older pgvector), the rows
        inside the scope are ranked exactly, so that the scope never costs recall.
        """
        store, table = self._store, self._store.name(self._table)
        params = self._params(q_vector=vector, q_limit=limit)
        # Before taking a connection: the index's form may need the store's metadata (another connection).
        nearest = sql.SQL(
            f"SELECT {columns}, 1 - (embedding <=> %(q_vector)s) FROM {table} WHERE {{where}} "
            f"ORDER BY {store.nearest(vector='%(q_vector)s')} LIMIT %(q_limit)s"
        ).format(where=self._where.clause)
        # An exact ranking of the scope's rows (the ORDER BY is not the index's expression).
        exact = sql.SQL(
            f"SELECT {columns}, 1 - (embedding <=> %(q_vector)s) AS score FROM {table} "
            "WHERE {where} ORDER BY score DESC LIMIT %(q_limit)s"
        ).format(where=self._where.clause)
        with store.connection() as conn:
            rows = self._execute(conn, nearest, params)
            if self._where.bounded and len(rows) < limit:
                rows = self._execute(conn, exact, params)
        return rows


class PostgresVectorRetriever(_EmbeddingRetriever):
    """Dense retrieval of chunks through pgvector's HNSW index, each hit carrying its stored embedding.

    The embeddings come back with the rows, so grading scores the candidates without
    embedding them again (``StoredEvidence``, or ``reuse_retrieval_embeddings``).

    Args:
        store: The store.
        embed_model: The model the store was embedded with.
        similarity_top_k: Chunks per query.
        scope: Only chunks whose metadata it admits are searched (default: every chunk).
    """

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return _hits(self._nearest("text, metadata_, embedding", self._query_vector(query_bundle), self._top_k))


class PostgresSentenceWindowRetriever(_EmbeddingRetriever):
    """Sentence-level dense retrieval in the windows table, each hit widened to the chunk that holds it, or to its
    window of neighbours.

    The PostgreSQL twin of ``stores.memory.SentenceWindowRetriever``: the same sentences, embedded the same way
    at ingest, searched through an HNSW index (twice ``similarity_top_k`` sentences). ``widen_to="chunk"`` (small
    to big, the default) returns the chunk that holds each sentence found, each chunk once at its best sentence's
    rank, at most ``similarity_top_k``, with the vector the store holds for it, so that grading it embeds nothing
    at query time; ``"window"`` returns each sentence's window (a text nobody embedded, embedded when graded). A
    window carries its document's metadata (ingest copies it), so ``scope`` filters windows as it filters chunks,
    and the chunks read back are filtered by it too.
    """

    _table = "windows"

    def __init__(
        self,
        store: PostgresStore,
        embed_model: BaseEmbedding,
        similarity_top_k: int,
        scope: Optional[Scope] = None,
        callback_manager: Optional[CallbackManager] = None,
        widen_to: str = "chunk",
    ) -> None:
        if widen_to not in ("chunk", "window"):
            raise ValueError(f"widen_to={widen_to!r}: a sentence hit is widened to its 'chunk' or its 'window'")
        self._widen_to = widen_to
        super().__init__(store, embed_model, similarity_top_k, scope, callback_manager)

    def _set_scope(self, scope: Scope) -> None:
        super()._set_scope(scope)
        self._chunks_where = scope_sql(scope, "chunks")

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        vector = self._query_vector(query_bundle)
        if self._widen_to == "window":
            rows = self._nearest("window_text, metadata_", vector, 2 * self._top_k)
            return [
                NodeWithScore(node=TextNode(text=text, metadata=dict(metadata or {})), score=float(score))
                for text, metadata, score in rows
            ]
        best: Dict[str, float] = {}  # each chunk at its best sentence's rank (the rows come best first)
        for node_id, score in self._nearest("node_id", vector, 2 * self._top_k):
            best.setdefault(node_id, float(score))
        if not best:
            return []
        where = self._chunks_where
        query = sql.SQL(
            f"SELECT node_id, text, metadata_, embedding FROM {self._store.name('chunks')} "
            "WHERE node_id = ANY(%(q_ids)s) AND {where}"
        ).format(where=where.clause)
        with self._store.connection() as conn:
            found = conn.execute(
                query, {**where.params, "q_ids": list(best)}, prepare=False if where.bounded else None
            ).fetchall()
        by_id = {node_id: (text, metadata, embedding) for node_id, text, metadata, embedding in found}
        ranked = [(*by_id[node_id], score) for node_id, score in best.items() if node_id in by_id]
        return _hits(ranked[: self._top_k])


class PostgresFullTextRetriever(_StoreRetriever):
    """BM25-like full-text retrieval of chunks in PostgreSQL, through the GIN index on their ``tsvector``.

    The query's lexemes (PostgreSQL's stemming and stopwords) are OR-ed, so a rewritten
    query with extra words still matches; each matching chunk scores the sum over the
    query's lexemes of ``idf * ts_rank`` (``ts_rank`` saturates with repetitions and
    is normalised by the chunk's length, ``idf`` is BM25's, from the lexeme frequency
    table). Lexemes in more than half of the chunks (BM25 gives them next to no weight)
    are left out. Only chunks holding one of the query's rarest lexemes are ranked: the
    rarest first, as long as their frequencies add up to at most the store's
    ``fulltext_candidates`` (at least one lexeme, and never more rows than that), since a
    chunk that holds none of them shares only the low-IDF words and ranks low anyway.
    That keeps the cost of a query flat as the store grows, where matching every lexeme
    ranked tens of thousands of chunks. Every query lexeme still counts in the score.
    Hits carry their stored embeddings.
    """

    embeds_queries = False  #: it matches words: ``fallback_query`` hands it the rewrite, no vector

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        store = self._store
        with store.connection() as conn:
            found = conn.execute(
                f"SELECT DISTINCT u.lexeme, l.df FROM unnest(to_tsvector(%s::regconfig, %s)) u "
                f"JOIN {store.name('lexemes')} l ON l.lexeme = u.lexeme",
                (store.text_search_config, clean_text(query_bundle.query_str)),  # PostgreSQL refuses NUL
            ).fetchall()
            if not found:
                return []
            size = max(store_size(conn, store), max(df for _, df in found))
            useful = [(lexeme, df) for lexeme, df in found if df <= size / 2] or found
            lexemes = [lexeme for lexeme, _ in useful]
            weights = [math.log(1 + (size - df + 0.5) / (df + 0.5)) for _, df in useful]
            matched = candidate_lexemes(useful, store.fulltext_candidates)
            rows = self._ranked(conn, lexemes, weights, matched)
            if self._where.bounded and len(rows) < self._top_k and len(matched) < len(lexemes):
                # The rarest lexemes were chosen over the whole store (their frequencies are corpus-wide counts)
                # and may hold few chunks inside the scope: rank the scope's chunks holding any of the lexemes.
                rows = self._ranked(conn, lexemes, weights, lexemes)
        return _hits(rows)

    def _ranked(
        self, conn: Connection[Any], lexemes: List[str], weights: List[float], matched: Sequence[str]
    ) -> List[Any]:
        """The top k chunks inside the scope among at most the store's budget of candidates holding ``matched``."""
        store = self._store
        # Rank on the tsvectors alone, then read text, metadata and vector (TOASTed) of the top k only.
        query = sql.SQL(
            f"""WITH t AS MATERIALIZED (
                SELECT quote_literal(u.lexeme)::tsquery AS q, u.idf
                FROM unnest(%(q_lexemes)s::text[], %(q_weights)s::float8[]) AS u(lexeme, idf)),
            candidates AS (
                SELECT id, text_search_tsv FROM {store.name("chunks")}
                WHERE text_search_tsv @@ %(q_matched)s::tsquery AND {{where}} LIMIT %(q_budget)s),
            ranked AS (
                SELECT c.id, (SELECT sum(t.idf * ts_rank(c.text_search_tsv, t.q, 1)) FROM t) AS score
                FROM candidates c ORDER BY score DESC LIMIT %(q_limit)s)
            SELECT chunk.text, chunk.metadata_, chunk.embedding, ranked.score
            FROM ranked JOIN {store.name("chunks")} chunk ON chunk.id = ranked.id
            ORDER BY ranked.score DESC"""
        ).format(where=self._where.clause)
        params = self._params(
            q_lexemes=lexemes,
            q_weights=weights,
            q_matched=" | ".join(_quoted(lexeme) for lexeme in matched),
            q_budget=store.fulltext_candidates,
            q_limit=self._top_k,
        )
        return self._execute(conn, query, params)


def candidate_lexemes(lexemes: Sequence[Tuple[str, int]], budget: int) -> List[str]:
    """The rarest of ``(lexeme, chunk frequency)`` whose frequencies add up to at most ``budget`` (one at least)."""
    chosen: List[str] = []
    total = 0
    for lexeme, df in sorted(lexemes, key=lambda item: (item[1], item[0])):
        if chosen and total + df > budget:
            break
        chosen.append(lexeme)
        total += df
    return chosen


def _hits(rows: Sequence[Any]) -> List[NodeWithScore]:
    """Rows of (text, metadata, embedding, score) as scored nodes that carry their stored vectors."""
    hits = []
    for text, metadata, embedding, score in rows:
        node = row_node(text, metadata)
        node.embedding = _floats(embedding)
        hits.append(NodeWithScore(node=node, score=float(score)))
    return hits


def _floats(vector: Any) -> Optional[List[float]]:
    """A stored vector (pgvector's ``Vector``) as the list of floats a node carries."""
    return None if vector is None else [float(x) for x in vector.to_numpy()]


def _quoted(lexeme: str) -> str:
    return "'" + lexeme.replace("\\", "\\\\").replace("'", "''") + "'"


def store_size(conn: Connection[Any], store: PostgresStore) -> int:
    row = conn.execute(f"SELECT value FROM {store.name('meta')} WHERE key = 'chunks'").fetchone()
    return int(row[0]) if row else 0
