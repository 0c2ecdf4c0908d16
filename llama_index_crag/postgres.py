"""The engine over PostgreSQL with pgvector: chunks, windows, full-text search and word statistics in one store.

One store is a handful of tables named after it (``crag`` by default):

- ``data_crag``: the chunks, laid out as LlamaIndex's ``PGVectorStore`` lays them out
  with ``hybrid_search=True, use_jsonb=True`` (text, metadata, a pgvector embedding
  with an HNSW index, and a generated ``tsvector`` with a GIN index), so the stock
  ``PGVectorStore`` reads the same table;
- ``crag_windows``: one row per sentence with its window of neighbouring sentences,
  the sentence's embedding and an HNSW index (the fallback's sentence windows);
- ``crag_terms``: each word's document frequency over the chunks, as the evidence
  scorer counts words (``scorers.evidence.terms``), for its IDF weights;
- ``crag_lexemes``: each full-text lexeme's document frequency, for the IDF of the
  BM25-like full-text ranking;
- ``crag_documents``: each document's content hash and chunk count (incremental ingest);
- ``crag_meta``: the embedding model, the chunk count and the last ingest.

``ingest`` keeps them consistent in one transaction per batch of documents;
``engine_from_store`` builds the corrective engine whose every step reads the store
and nothing else: dense retrieval, the full-text and sentence-window fallback,
grading with the stored embeddings and with the IDF of the query's words only.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, Document, MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.core.vector_stores.utils import metadata_dict_to_node, node_to_metadata_dict

from llama_index_crag.datasets import clean_text
from llama_index_crag.engine import RetrievalUnavailableError
from llama_index_crag.fallback import sentence_windows
from llama_index_crag.scorers.base import RelevanceScorer, node_text
from llama_index_crag.scorers.bi_encoder import bi_encoder_of
from llama_index_crag.scorers.evidence import EvidenceScorer, idf, terms

if TYPE_CHECKING:
    from psycopg import Connection
    from psycopg_pool import ConnectionPool

    from llama_index_crag.engine import CorrectiveQueryEngine
    from llama_index_crag.server.store import IngestReport

FORMAT = 1
DEFAULT_TABLE = "crag"
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")
_INSTALL = "pip install 'llama-index-crag[postgres]'"
PRECISIONS = ("full", "half")


def _psycopg() -> Any:
    try:
        import pgvector.psycopg
        import psycopg
        import psycopg_pool
    except ImportError as exc:
        raise ImportError(f"the PostgreSQL store needs psycopg, psycopg-pool and pgvector: {_INSTALL}") from exc
    return psycopg, psycopg_pool, pgvector.psycopg


class StoreError(ValueError):
    """The store is missing, of another format, or was embedded with another model; the message names the fix."""


class StoreUnavailableError(StoreError, RetrievalUnavailableError):
    """The store's PostgreSQL cannot be reached now (down, restarting, or every connection busy past the timeout)."""


class PostgresStore:
    """One CRAG store in PostgreSQL: its connection pool, its table names, its schema and its statistics.

    Args:
        url: ``postgresql://user:password@host:port/database`` (a SQLAlchemy URL such as
            ``postgresql+psycopg2://...`` is accepted too).
        table: The store's name: the chunks live in ``data_<table>``, the rest in ``<table>_*``.
        schema: The PostgreSQL schema that holds the tables.
        embed_dim: The embedding size (384 for the bundled MiniLM).
        text_search_config: The full-text configuration (stemming and stopwords), e.g. ``english``.
        hnsw_m: HNSW graph degree of the vector indexes (pgvector's default 16).
        hnsw_ef_construction: HNSW build-time candidate list (pgvector's default 64).
        ef_search: HNSW query-time candidate list, set on every connection (pgvector's default 40).
        pool_size: Connections this process keeps open at most.
        connect_timeout_s: How long a query waits for a connection before it fails with
            ``StoreUnavailableError`` (the server answers 503 rather than hanging).
        fulltext_candidates: At most this many chunks are ranked by the full-text fallback:
            it matches the query's rarest lexemes whose frequencies add up to this, so the
            cost of a query stays flat as the store grows (see ``PostgresFullTextRetriever``).
        index_precision: ``"full"`` indexes the vectors as they are stored (4 bytes a
            dimension); ``"half"`` builds the HNSW indexes over ``halfvec`` casts (2 bytes),
            about half the index's size and memory, while the table keeps the full vectors
            for scores and grading. Fixed when the store is created; ``None`` takes what the
            store was built with (``"full"`` for a new one).
    """

    def __init__(
        self,
        url: str,
        table: str = DEFAULT_TABLE,
        schema: str = "public",
        embed_dim: int = 384,
        text_search_config: str = "english",
        hnsw_m: int = 16,
        hnsw_ef_construction: int = 64,
        ef_search: int = 40,
        pool_size: int = 8,
        fulltext_candidates: int = 1000,
        connect_timeout_s: float = 5.0,
        index_precision: Optional[str] = None,
    ) -> None:
        if index_precision not in (None, *PRECISIONS):
            raise StoreError(f"index_precision must be one of {', '.join(PRECISIONS)}, not {index_precision!r}")
        if fulltext_candidates < 1:
            raise StoreError(f"fulltext_candidates must be at least 1, not {fulltext_candidates}")
        for name in (table, schema, text_search_config):
            if not _NAME.match(name):
                raise StoreError(f"{name!r} is not a plain lower-case SQL name: use letters, digits and _")
        self.url = re.sub(r"^postgres(ql)?(\+\w+)?://", "postgresql://", url)
        self.table, self.schema, self.embed_dim = table, schema, embed_dim
        self.text_search_config = text_search_config
        self.hnsw_m, self.hnsw_ef_construction, self.ef_search = hnsw_m, hnsw_ef_construction, ef_search
        self.pool_size, self.fulltext_candidates = pool_size, fulltext_candidates
        self.connect_timeout_s = connect_timeout_s
        self.index_precision = index_precision
        self._built_precision: Optional[str] = None
        self._pool: Optional[ConnectionPool] = None
        self._lock = threading.Lock()

    @classmethod
    def from_vector_store(cls, vector_store: Any, **kwargs: Any) -> PostgresStore:
        """The store over the table of a LlamaIndex ``PGVectorStore`` (its connection, table and schema)."""
        table = str(vector_store.table_name).lower()
        return cls(
            vector_store.connection_string,
            table=table[5:] if table.startswith("data_") else table,
            schema=vector_store.schema_name,
            embed_dim=vector_store.embed_dim,
            text_search_config=vector_store.text_search_config,
            **kwargs,
        )

    @property
    def precision(self) -> str:
        """The precision of the store's vector indexes (``full`` or ``half``), as the store was built."""
        if self._built_precision is None:
            self._resolve_precision(self.meta(), f"{_redacted(self.url)} (table {self.table})")
        assert self._built_precision is not None
        return self._built_precision

    def nearest(self, column: str = "embedding", precision: Optional[str] = None) -> str:
        """SQL ordering rows by cosine distance to the query vector (one ``%s``), in the form that the store's
        index (or the index of ``precision``) serves."""
        if (precision or self.precision) == "half":
            d = int(self.embed_dim)
            return f"{column}::halfvec({d}) <=> %s::halfvec({d})"
        return f"{column} <=> %s"

    def _resolve_precision(self, meta: Mapping[str, Any], where: str) -> str:
        """The index precision of the store that ``meta`` describes (``full`` for one made before the setting, the
        requested one, or ``full``, for a new store); a ``StoreError`` where the request contradicts the store."""
        built = meta.get("index_precision", "full" if meta else None)
        if built and self.index_precision and built != self.index_precision:
            raise StoreError(
                f"the store at {where} has {built}-precision vector indexes, not {self.index_precision}: "
                f"open it with index_precision={built!r} (or None), or ingest into another table"
            )
        self._built_precision = built or self.index_precision or "full"
        return self._built_precision

    def name(self, part: str) -> str:
        """The qualified name of one of the store's tables: ``chunks``, ``windows``, ``terms``, ``lexemes``,
        ``documents`` or ``meta``."""
        table = f"data_{self.table}" if part == "chunks" else f"{self.table}_{part}"
        return f"{self.schema}.{table}"

    def vector_store(self, **kwargs: Any) -> Any:
        """A LlamaIndex ``PGVectorStore`` over the same chunks table (for pipelines of your own)."""
        try:
            from llama_index.vector_stores.postgres import PGVectorStore
        except ImportError as exc:
            raise ImportError(f"PGVectorStore needs llama-index-vector-stores-postgres: {_INSTALL}") from exc
        from sqlalchemy.engine import make_url

        parts = make_url(self.url)
        return PGVectorStore.from_params(
            host=parts.host,
            port=str(parts.port or 5432),
            database=parts.database,
            user=parts.username,
            password=parts.password or "",
            table_name=self.table,
            schema_name=self.schema,
            embed_dim=self.embed_dim,
            hybrid_search=True,
            text_search_config=self.text_search_config,
            use_jsonb=True,
            perform_setup=False,
            **kwargs,
        )

    def _configure(self, conn: Connection[Any]) -> None:
        _, _, pgvector = _psycopg()
        pgvector.register_vector(conn)
        conn.execute(f"SET hnsw.ef_search = {int(self.ef_search)}")

    def pool(self) -> ConnectionPool:
        """The process's connection pool, opened on first use (a forked server worker opens its own)."""
        with self._lock:
            if self._pool is None:
                psycopg, psycopg_pool, _ = _psycopg()
                self.ensure_extension()
                self._pool = psycopg_pool.ConnectionPool(
                    self.url,
                    min_size=1,
                    max_size=self.pool_size,
                    kwargs={"autocommit": True, "connect_timeout": max(1, round(self.connect_timeout_s))},
                    configure=self._configure,
                    check=psycopg_pool.ConnectionPool.check_connection,  # one left broken by a restart is replaced
                    timeout=self.connect_timeout_s,
                    open=True,
                )
            return self._pool

    @contextmanager
    def connection(self) -> Iterator[Connection[Any]]:
        """A pooled connection (autocommit; use ``conn.transaction()`` for several statements at once).

        Raises ``StoreUnavailableError`` when the server cannot be reached, before or during the work.
        """
        psycopg, _, _ = _psycopg()
        try:
            with self.pool().connection() as conn:
                yield conn
        except psycopg.OperationalError as exc:  # the pool's timeout too (PoolTimeout)
            raise StoreUnavailableError(
                f"the PostgreSQL store at {_redacted(self.url)} cannot be reached: {type(exc).__name__}: {exc}"
            ) from exc

    def ensure_extension(self) -> None:
        """Create the ``vector`` extension if the database lacks it (needs the right to create extensions)."""
        psycopg, _, _ = _psycopg()
        try:
            with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        except psycopg.OperationalError as exc:
            raise StoreError(f"cannot connect to PostgreSQL at {_redacted(self.url)}: {exc}") from exc
        except psycopg.Error as exc:
            raise StoreError(
                f"the database at {_redacted(self.url)} has no pgvector and this user cannot create it ({exc}): "
                "install pgvector on the server (or pick a managed PostgreSQL that ships it) and run "
                "CREATE EXTENSION vector as its owner"
            ) from exc

    def close(self) -> None:
        """Close this process's connections."""
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def create_schema(self) -> None:
        """Create the store's tables and indexes where missing (an existing ``PGVectorStore`` table is kept)."""
        d, cfg = int(self.embed_dim), self.text_search_config
        precision = self._resolve_precision(self.meta(), f"{_redacted(self.url)} (table {self.table})")
        hnsw = (
            f"USING hnsw {self.hnsw_columns(precision)} "
            f"WITH (m = {int(self.hnsw_m)}, ef_construction = {int(self.hnsw_ef_construction)})"
        )
        chunks, windows = self.name("chunks"), self.name("windows")
        short = f"{self.table}"
        statements = [
            f"CREATE SCHEMA IF NOT EXISTS {self.schema}",
            f"""CREATE TABLE IF NOT EXISTS {chunks} (
                id BIGSERIAL PRIMARY KEY, text VARCHAR NOT NULL, metadata_ JSONB, node_id VARCHAR,
                embedding VECTOR({d}),
                text_search_tsv TSVECTOR GENERATED ALWAYS AS (to_tsvector('{cfg}', text)) STORED)""",
            f"""ALTER TABLE {chunks} ADD COLUMN IF NOT EXISTS text_search_tsv TSVECTOR
                GENERATED ALWAYS AS (to_tsvector('{cfg}', text)) STORED""",
            f"CREATE INDEX IF NOT EXISTS {short}_idx ON {chunks} USING gin (text_search_tsv)",
            f"CREATE INDEX IF NOT EXISTS {short}_idx_1 ON {chunks} ((metadata_->>'ref_doc_id'))",
            f"CREATE INDEX IF NOT EXISTS {self.vector_index('chunks', precision)} ON {chunks} {hnsw}",
            f"""CREATE TABLE IF NOT EXISTS {windows} (
                id BIGSERIAL PRIMARY KEY, ref_doc_id VARCHAR NOT NULL, node_id VARCHAR NOT NULL,
                text VARCHAR NOT NULL, window_text VARCHAR NOT NULL, metadata_ JSONB, embedding VECTOR({d}))""",
            f"CREATE INDEX IF NOT EXISTS {short}_windows_doc ON {windows} (ref_doc_id)",
            f"CREATE INDEX IF NOT EXISTS {self.vector_index('windows', precision)} ON {windows} {hnsw}",
            f"CREATE TABLE IF NOT EXISTS {self.name('terms')} (term VARCHAR PRIMARY KEY, df INTEGER NOT NULL)",
            f"CREATE TABLE IF NOT EXISTS {self.name('lexemes')} (lexeme VARCHAR PRIMARY KEY, df INTEGER NOT NULL)",
            f"""CREATE TABLE IF NOT EXISTS {self.name("documents")} (
                ref_doc_id VARCHAR PRIMARY KEY, hash VARCHAR NOT NULL, chunks INTEGER NOT NULL,
                updated TIMESTAMPTZ NOT NULL DEFAULT now())""",
            f"CREATE TABLE IF NOT EXISTS {self.name('meta')} (key VARCHAR PRIMARY KEY, value JSONB NOT NULL)",
        ]
        with self.connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (self.name("meta"),))
            for statement in statements:
                conn.execute(statement)

    def vector_index(self, part: str, precision: Optional[str] = None) -> str:
        """The (unqualified) name of the HNSW index on ``part`` (``chunks`` or ``windows``) of ``precision``."""
        suffix = "_half" if (precision or self.precision) == "half" else ""
        if part == "chunks":
            return f"data_{self.table}_embedding{suffix}_idx"  # the name PGVectorStore gives its index
        return f"{self.table}_windows_embedding{suffix}"

    def hnsw_columns(self, precision: str) -> str:
        """The indexed expression and operator class of HNSW indexes of ``precision``, for ``CREATE INDEX``."""
        if precision == "half":
            return f"((embedding::halfvec({int(self.embed_dim)})) halfvec_cosine_ops)"
        return "(embedding vector_cosine_ops)"

    def meta(self) -> Dict[str, Any]:
        """The store's metadata (format, embedding model, chunk count, last ingest); empty for no store."""
        with self.connection() as conn:
            exists = conn.execute("SELECT to_regclass(%s)", (self.name("meta"),)).fetchone()
            if not exists or exists[0] is None:
                return {}
            return {k: v for k, v in conn.execute(f"SELECT key, value FROM {self.name('meta')}").fetchall()}

    def require(self, embed_model: Optional[BaseEmbedding] = None) -> Dict[str, Any]:
        """The store's metadata, or a ``StoreError`` that says how to make the store this version can serve."""
        meta = self.meta()
        where = f"{_redacted(self.url)} (table {self.table})"
        if not meta:
            raise StoreError(f"no CRAG store at {where}: make one with llama-crag ingest DOCS --store URL")
        if meta.get("format") != FORMAT:
            raise StoreError(f"the store at {where} is of format {meta.get('format')}, not {FORMAT}: ingest again")
        self._resolve_precision(meta, where)
        if embed_model is not None and Path(meta["embed_model"]).name != Path(embed_model.model_name).name:
            raise StoreError(
                f"the store at {where} was embedded with {meta['embed_model']}, not {embed_model.model_name}: "
                "ingest it again with this model, or serve it with the model it was built with"
            )
        return meta

    def chunk_count(self) -> int:
        """How many chunks the store holds (kept in its metadata by every ingest)."""
        with self.connection() as conn:
            row = conn.execute(f"SELECT value FROM {self.name('meta')} WHERE key = 'chunks'").fetchone()
        return int(row[0]) if row else 0

    def term_frequencies(self, words: Sequence[str]) -> Dict[str, int]:
        """The document frequency of each of ``words`` over the chunks (words the corpus lacks are left out)."""
        if not words:
            return {}
        with self.connection() as conn:
            rows = conn.execute(
                f"SELECT term, df FROM {self.name('terms')} WHERE term = ANY(%s)", (list(words),)
            ).fetchall()
        return {t: int(df) for t, df in rows}

    def describe(self) -> Dict[str, Any]:
        """What the server's health and index routes show about the store."""
        meta = self.meta()
        return {
            "store": _redacted(self.url),
            "table": self.table,
            "documents": meta.get("documents"),
            "chunks": meta.get("chunks"),
            "updated": meta.get("updated"),
            "embed_model": meta.get("embed_model"),
            "index_precision": meta.get("index_precision", "full"),
        }


def _redacted(url: str) -> str:
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --- ingest -------------------------------------------------------------------------------------------------------


def ingest(
    source: Union[Path, str],
    store: PostgresStore,
    embed_model: Optional[BaseEmbedding] = None,
    window_size: int = 3,
    batch_documents: int = 64,
    progress: bool = False,
) -> IngestReport:
    """Write or update the documents of ``source`` into ``store``: chunks, windows, and their statistics.

    Only documents added or changed since the last ingest are chunked and embedded;
    documents gone from ``source`` are deleted with their rows. Each batch of documents
    is one transaction (rows and word counts move together), and concurrent ingests
    into one store wait for each other. Chunk ids are stable (``doc_id#n``).
    """
    from tqdm import tqdm

    from llama_index_crag.evaluation.corpus import chunk
    from llama_index_crag.models import default_embed_model
    from llama_index_crag.server.store import IndexFolderError, IngestReport, read_documents

    started = time.monotonic()
    documents, skipped = read_documents(Path(source))
    if not documents:
        raise IndexFolderError(f"{source} holds no document with text to index")
    embed_model = embed_model or default_embed_model()
    store.create_schema()
    old_meta = store.meta()
    if old_meta.get("embed_model") and Path(old_meta["embed_model"]).name != Path(embed_model.model_name).name:
        raise StoreError(
            f"the store {store.table} was embedded with {old_meta['embed_model']}, not {embed_model.model_name}: "
            "ingest into another table (--table) or with the same model"
        )
    with store.connection() as conn:
        known = dict(conn.execute(f"SELECT ref_doc_id, hash FROM {store.name('documents')}").fetchall())
    report = IngestReport(index_dir=f"{_redacted(store.url)}#{store.table}", documents=len(documents), nodes=0)
    report.skipped = skipped
    todo = []
    for document in documents:
        if known.get(document.id_) == document.hash:
            report.unchanged += 1
            continue
        (report.updated if document.id_ in known else report.added).append(document.id_)
        todo.append(document)
    report.removed = sorted(set(known) - {d.id_ for d in documents})
    bar = tqdm(total=len(todo), unit="doc", desc="ingest", disable=not progress)
    for start in range(0, len(todo), batch_documents):
        batch = todo[start : start + batch_documents]
        chunks = chunk(batch)
        chunk_vectors = embed_model.get_text_embedding_batch(
            [c.get_content(metadata_mode=MetadataMode.EMBED) for c in chunks]
        )
        windows = sentence_windows(chunks, window_size)
        window_vectors = embed_model.get_text_embedding_batch(
            [w.get_content(metadata_mode=MetadataMode.EMBED) for w in windows]
        )
        with store.connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (store.name("meta"),))
            _delete_documents(conn, store, [d.id_ for d in batch if d.id_ in known])
            _insert(conn, store, batch, chunks, chunk_vectors, windows, window_vectors)
        bar.update(len(batch))
    bar.close()
    with store.connection() as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (store.name("meta"),))
        _delete_documents(conn, store, report.removed)
        counts = conn.execute(f"SELECT count(*), coalesce(sum(chunks), 0) FROM {store.name('documents')}").fetchone()
        assert counts is not None
        report.nodes = int(counts[1])
        report.seconds = round(time.monotonic() - started, 2)
        meta = {
            "format": FORMAT,
            "created": old_meta.get("created") or _now(),
            "updated": _now(),
            "source": str(Path(source).resolve()),
            "embed_model": embed_model.model_name,
            "embed_dim": store.embed_dim,
            "index_precision": store.precision,
            "window_size": window_size,
            "documents": int(counts[0]),
            "chunks": int(counts[1]),
            "last_ingest": {k: v for k, v in asdict(report).items() if k != "index_dir"},
        }
        _write_meta(conn, store, meta)
    return report


def _write_meta(conn: Connection[Any], store: PostgresStore, meta: Mapping[str, Any]) -> None:
    from psycopg.types.json import Jsonb

    conn.cursor().executemany(
        f"INSERT INTO {store.name('meta')} (key, value) VALUES (%s, %s) "
        "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
        [(k, Jsonb(v)) for k, v in meta.items()],
    )


def _insert(
    conn: Connection[Any],
    store: PostgresStore,
    documents: Sequence[Document],
    chunks: Sequence[BaseNode],
    chunk_vectors: Sequence[Sequence[float]],
    windows: Sequence[BaseNode],
    window_vectors: Sequence[Sequence[float]],
) -> None:
    """Insert the rows of freshly chunked documents and add their words to the frequency tables."""
    from psycopg.types.json import Jsonb

    owner = {c.node_id: c.ref_doc_id or "" for c in chunks}
    cursor = conn.cursor()
    cursor.executemany(
        f"INSERT INTO {store.name('chunks')} (node_id, text, metadata_, embedding) VALUES (%s, %s, %s, %s)",
        [
            (
                c.node_id,
                c.get_content(metadata_mode=MetadataMode.NONE),
                Jsonb(node_to_metadata_dict(c, remove_text=True, flat_metadata=False)),
                np.asarray(v, dtype=np.float32),
            )
            for c, v in zip(chunks, chunk_vectors)
        ],
    )
    cursor.executemany(
        f"INSERT INTO {store.name('windows')} (ref_doc_id, node_id, text, window_text, metadata_, embedding) "
        "VALUES (%s, %s, %s, %s, %s, %s)",
        [
            (
                owner.get(w.ref_doc_id or "", ""),
                w.ref_doc_id or "",
                w.get_content(metadata_mode=MetadataMode.NONE),
                w.metadata.get("window") or w.get_content(),
                Jsonb({k: v for k, v in w.metadata.items() if k not in ("window", "original_text")}),
                np.asarray(v, dtype=np.float32),
            )
            for w, v in zip(windows, window_vectors)
        ],
    )
    per_doc = Counter(c.ref_doc_id for c in chunks)
    cursor.executemany(
        f"INSERT INTO {store.name('documents')} (ref_doc_id, hash, chunks) VALUES (%s, %s, %s)",
        [(d.id_, d.hash, per_doc.get(d.id_, 0)) for d in documents],
    )
    _add_terms(conn, store, Counter(t for c in chunks for t in set(terms(c.get_content(MetadataMode.EMBED)))), 1)
    _add_lexemes(conn, store, [d.id_ for d in documents], 1)


def _delete_documents(conn: Connection[Any], store: PostgresStore, doc_ids: Sequence[str]) -> None:
    """Remove documents' rows, taking their words out of the frequency tables first (while the rows still tell)."""
    if not doc_ids:
        return
    chunks = store.name("chunks")
    texts = conn.execute(
        f"SELECT text, metadata_ FROM {chunks} WHERE metadata_->>'ref_doc_id' = ANY(%s)", (list(doc_ids),)
    ).fetchall()
    words: Counter[str] = Counter()
    for text, metadata in texts:
        words.update(set(terms(_node(text, metadata).get_content(MetadataMode.EMBED))))
    _add_terms(conn, store, words, -1)
    _add_lexemes(conn, store, doc_ids, -1)
    conn.execute(f"DELETE FROM {chunks} WHERE metadata_->>'ref_doc_id' = ANY(%s)", (list(doc_ids),))
    conn.execute(f"DELETE FROM {store.name('windows')} WHERE ref_doc_id = ANY(%s)", (list(doc_ids),))
    conn.execute(f"DELETE FROM {store.name('documents')} WHERE ref_doc_id = ANY(%s)", (list(doc_ids),))


def _add_terms(conn: Connection[Any], store: PostgresStore, counts: Mapping[str, int], sign: int) -> None:
    if not counts:
        return
    words = sorted(counts)
    table = store.name("terms")
    conn.execute(
        f"INSERT INTO {table} (term, df) SELECT * FROM unnest(%s::varchar[], %s::int[]) "
        f"ON CONFLICT (term) DO UPDATE SET df = {table}.df + EXCLUDED.df",
        (words, [sign * counts[w] for w in words]),
    )
    if sign < 0:
        conn.execute(f"DELETE FROM {table} WHERE term = ANY(%s) AND df <= 0", (words,))


def _add_lexemes(conn: Connection[Any], store: PostgresStore, doc_ids: Sequence[str], sign: int) -> None:
    """Add (or with ``sign=-1`` subtract) the documents' chunks' full-text lexemes to their frequency table."""
    table = store.name("lexemes")
    conn.execute(
        f"""INSERT INTO {table} (lexeme, df)
            SELECT u.lexeme, {int(sign)} * count(*) FROM {store.name("chunks")} c, unnest(c.text_search_tsv) u
            WHERE c.metadata_->>'ref_doc_id' = ANY(%s) GROUP BY u.lexeme
            ON CONFLICT (lexeme) DO UPDATE SET df = {table}.df + EXCLUDED.df""",
        (list(doc_ids),),
    )
    if sign < 0:
        conn.execute(f"DELETE FROM {table} WHERE df <= 0")


def _node(text: str, metadata: Mapping[str, Any]) -> BaseNode:
    """A chunk row back as the node that was stored (as ``PGVectorStore`` reads it)."""
    try:
        node = metadata_dict_to_node(dict(metadata))
        node.set_content(text)
    except (ValueError, KeyError, TypeError):
        node = TextNode(text=text, metadata=dict(metadata or {}))
    return node


# --- retrieval ----------------------------------------------------------------------------------------------------


class _StoreRetriever(BaseRetriever):
    """A retriever that reads one store; async runs the same query in a worker thread (psycopg's pool is sync)."""

    def __init__(self, store: PostgresStore, similarity_top_k: int) -> None:
        self._store = store
        self._top_k = similarity_top_k
        super().__init__()

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


class _EmbeddingRetriever(_StoreRetriever):
    """A store retriever that embeds the query (and puts the vector on the bundle, for grading to reuse)."""

    def __init__(self, store: PostgresStore, embed_model: BaseEmbedding, similarity_top_k: int) -> None:
        self._embed_model = embed_model
        super().__init__(store, similarity_top_k)

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


class PostgresVectorRetriever(_EmbeddingRetriever):
    """Dense retrieval of chunks through pgvector's HNSW index, each hit carrying its stored embedding.

    The embeddings come back with the rows, so grading scores the candidates without
    embedding them again (``StoredEvidence``, or ``reuse_retrieval_embeddings``).

    Args:
        store: The store.
        embed_model: The model the store was embedded with.
        similarity_top_k: Chunks per query.
    """

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        vector = self._query_vector(query_bundle)
        with self._store.connection() as conn:
            rows = conn.execute(
                f"SELECT text, metadata_, embedding, 1 - (embedding <=> %s) FROM {self._store.name('chunks')} "
                f"ORDER BY {self._store.nearest()} LIMIT %s",
                (vector, vector, self._top_k),
            ).fetchall()
        return _hits(rows)


class PostgresSentenceWindowRetriever(_EmbeddingRetriever):
    """Sentence-level dense retrieval in the windows table, each hit widened to its window of neighbours.

    The PostgreSQL twin of ``fallback.SentenceWindowRetriever``: the same sentences,
    embedded the same way at ingest, searched through an HNSW index; it returns twice
    ``similarity_top_k`` windows, as the in-memory one does.
    """

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        vector = self._query_vector(query_bundle)
        with self._store.connection() as conn:
            rows = conn.execute(
                f"SELECT window_text, metadata_, 1 - (embedding <=> %s) FROM {self._store.name('windows')} "
                f"ORDER BY {self._store.nearest()} LIMIT %s",
                (vector, vector, 2 * self._top_k),
            ).fetchall()
        return [
            NodeWithScore(node=TextNode(text=text, metadata=dict(metadata or {})), score=float(score))
            for text, metadata, score in rows
        ]


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
            # Rank on the tsvectors alone, then read text, metadata and vector (TOASTed) of the top k only.
            rows = conn.execute(
                f"""WITH t AS MATERIALIZED (
                    SELECT quote_literal(u.lexeme)::tsquery AS q, u.idf
                    FROM unnest(%s::text[], %s::float8[]) AS u(lexeme, idf)),
                candidates AS (
                    SELECT id, text_search_tsv FROM {store.name("chunks")}
                    WHERE text_search_tsv @@ %s::tsquery LIMIT %s),
                ranked AS (
                    SELECT c.id, (SELECT sum(t.idf * ts_rank(c.text_search_tsv, t.q, 1)) FROM t) AS score
                    FROM candidates c ORDER BY score DESC LIMIT %s)
                SELECT chunk.text, chunk.metadata_, chunk.embedding, ranked.score
                FROM ranked JOIN {store.name("chunks")} chunk ON chunk.id = ranked.id
                ORDER BY ranked.score DESC""",
                (
                    lexemes,
                    weights,
                    " | ".join(_quoted(lexeme) for lexeme in matched),
                    store.fulltext_candidates,
                    self._top_k,
                ),
            ).fetchall()
        return _hits(rows)


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
        node = _node(text, metadata)
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


def store_fallback(
    store: PostgresStore,
    embed_model: BaseEmbedding,
    similarity_top_k: int = 5,
    sources: Sequence[str] = ("fulltext", "sentence_window"),
) -> BaseRetriever:
    """The ``FallbackRetriever`` of the INCORRECT branch over the store: full-text search, then sentence windows."""
    from llama_index_crag.fallback import FallbackRetriever

    built: Dict[str, BaseRetriever] = {}
    for source in sources:
        if source in ("fulltext", "bm25"):
            built[source] = PostgresFullTextRetriever(store, similarity_top_k)
        elif source == "sentence_window":
            built[source] = PostgresSentenceWindowRetriever(store, embed_model, similarity_top_k)
        else:
            raise ValueError(f"unknown fallback source {source!r}: use 'fulltext' or 'sentence_window'")
    return FallbackRetriever(built, similarity_top_k=similarity_top_k)


# --- grading ------------------------------------------------------------------------------------------------------


class StoredIdf(Mapping[str, float]):
    """The evidence scorer's IDF table, read from the store a word at a time and kept for a while.

    Only the words queries use are ever read (about ten a query); each is kept for
    ``ttl_s`` seconds so that documents ingested meanwhile change the weights soon.
    ``prefetch`` reads a query's words in one round trip.

    Args:
        store: The store.
        ttl_s: How long a word's weight (and the chunk count) is trusted.
        max_words: Words kept at most.
    """

    def __init__(self, store: PostgresStore, ttl_s: float = 60.0, max_words: int = 100_000) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._max_words = max_words
        self._weights: Dict[str, Tuple[float, Optional[float]]] = {}
        self._lock = threading.Lock()
        self._size = 0
        self._size_at = -math.inf

    @property
    def size(self) -> int:
        """The store's chunk count (re-read after ``ttl_s``)."""
        if time.monotonic() - self._size_at > self._ttl_s:
            self._size, self._size_at = self._store.chunk_count(), time.monotonic()
        return self._size

    def prefetch(self, words: Sequence[str]) -> None:
        """Read the weights of those of ``words`` not known (or known too long) in one query."""
        now = time.monotonic()
        with self._lock:
            stale = [w for w in set(words) if w not in self._weights or now - self._weights[w][0] > self._ttl_s]
        if not stale:
            return
        size = self.size
        found = self._store.term_frequencies(stale)
        with self._lock:
            if len(self._weights) + len(stale) > self._max_words:
                self._weights.clear()
            for word in stale:
                self._weights[word] = (now, idf(size, found[word]) if word in found else None)

    def _weight(self, word: str) -> Optional[float]:
        self.prefetch([word])
        with self._lock:
            return self._weights[word][1]

    def __getitem__(self, word: str) -> float:
        weight = self._weight(word)
        if weight is None:
            raise KeyError(word)
        return weight

    def __contains__(self, word: object) -> bool:
        return isinstance(word, str) and self._weight(word) is not None

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[str]:
        """Every word of the store, streamed (for export; the scorer never iterates)."""
        with self._store.connection() as conn, conn.transaction():
            cursor = conn.cursor(name="crag_terms_export")
            cursor.execute(f"SELECT term FROM {self._store.name('terms')}")
            for (term,) in cursor:
                yield term


class StoredEvidence(BaseNodePostprocessor):
    """Hands the scorer what the store already holds for a query, before grading.

    For every candidate that carries a stored embedding (the store's retrievers return
    them), the scorer's bi-encoder is given that vector instead of embedding the text
    again; the vector is then dropped from the node so it travels no further. And the
    IDF weights of the query's words are read from the store in one round trip. Runs as
    the engine's node postprocessor, so it sees both the primary and the fallback hits.
    """

    idf_ttl_s: float = Field(default=60.0, description="How long a word's IDF weight is trusted.")
    _scorer: RelevanceScorer = PrivateAttr()
    _idf: Optional[StoredIdf] = PrivateAttr()

    def __init__(self, scorer: RelevanceScorer, idf: Optional[StoredIdf] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._scorer = scorer
        self._idf = idf

    @classmethod
    def class_name(cls) -> str:
        return "StoredEvidence"

    def _postprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        bi_encoder = bi_encoder_of(self._scorer)
        texts, vectors, kept = [], [], []
        for hit in nodes:
            if hit.node.embedding is not None:
                texts.append(node_text(hit))
                vectors.append(hit.node.embedding)
                node = hit.node.model_copy()
                node.embedding = None
                hit = NodeWithScore(node=node, score=hit.score)
            kept.append(hit)
        if bi_encoder is not None and texts:
            bi_encoder.remember(texts, vectors)
        if self._idf is not None and query_bundle is not None:
            self._idf.prefetch(terms(query_bundle.query_str))
        return kept


def stored_scorer(
    store: PostgresStore, embed_model: BaseEmbedding, grader: Optional[str] = None, idf_ttl_s: float = 60.0
) -> Tuple[EvidenceScorer, StoredIdf]:
    """The evidence scorer (or the reader cascade of ``grader``) weighing words by the store's IDF, read on demand."""
    scorer: EvidenceScorer
    if grader:
        from llama_index_crag.scorers.reader import ReaderScorer

        scorer = ReaderScorer(grader, embed_model)
    else:
        scorer = EvidenceScorer(embed_model)
    weights = StoredIdf(store, ttl_s=idf_ttl_s)
    scorer.use_idf(weights, weights.size)
    return scorer, weights


# --- the engine ---------------------------------------------------------------------------------------------------


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
    from llama_index_crag.engine import CorrectiveQueryEngine
    from llama_index_crag.models import default_embed_model

    if isinstance(store, str):
        store = PostgresStore(store, table=table)
    elif not isinstance(store, PostgresStore):
        store = PostgresStore.from_vector_store(store)
    embed_model = embed_model or default_embed_model()
    store.require(embed_model)
    stored_idf = None
    if scorer is None:
        scorer, stored_idf = stored_scorer(store, embed_model, grader or _env_grader())
    top_k = _top_k(engine_kwargs, scorer)
    postprocessors = [StoredEvidence(scorer, stored_idf), *(engine_kwargs.pop("node_postprocessors", None) or [])]
    return CorrectiveQueryEngine.from_defaults(
        retriever=PostgresVectorRetriever(store, embed_model, top_k),
        llm=llm,
        scorer=scorer,
        embed_model=embed_model,
        fallback=store_fallback(store, embed_model, top_k, fallback_sources),
        node_postprocessors=postprocessors,
        **engine_kwargs,
    )


def _env_grader() -> Optional[str]:
    import os

    return os.environ.get("CRAG_GRADER") or None


def _top_k(engine_kwargs: Mapping[str, Any], scorer: RelevanceScorer) -> int:
    """The ``similarity_top_k`` the engine will resolve (argument, ``CRAG_*`` variable, calibration file)."""
    from llama_index_crag.settings import CragSettings

    given = {k: v for k, v in engine_kwargs.items() if k in CragSettings.model_fields}
    return CragSettings.resolve(
        given,
        calibration_path=engine_kwargs.get("calibration_path"),
        scorer_name=scorer.name,
        scorer_defaults=getattr(scorer, "default_thresholds", None),
    ).similarity_top_k
