"""The PostgreSQL store: its connection pool, its tables and what it knows about itself.

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
"""

from __future__ import annotations

import re
import threading
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, Mapping, Optional, Sequence

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import BaseNode, TextNode
from llama_index.core.vector_stores.utils import metadata_dict_to_node
from sqlalchemy.dialects.postgresql.base import RESERVED_WORDS

from llama_index_crag.errors import MissingDependency, StoreError, StoreUnavailableError

if TYPE_CHECKING:
    from psycopg import Connection
    from psycopg_pool import ConnectionPool


FORMAT = 1
DEFAULT_TABLE = "crag"
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")
_INSTALL = "pip install 'llama-index-crag[postgres]'"
PRECISIONS = ("full", "half")
#: The pgvector version whose HNSW scans can go on past the rows a filter drops (``hnsw.iterative_scan``).
ITERATIVE_SCAN_SINCE = (0, 8, 0)


def _psycopg() -> Any:
    try:
        import pgvector.psycopg
        import psycopg
        import psycopg_pool
    except ImportError as exc:
        raise MissingDependency(f"the PostgreSQL store needs psycopg, psycopg-pool and pgvector: {_INSTALL}") from exc
    return psycopg, psycopg_pool, pgvector.psycopg


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
        if schema in RESERVED_WORDS or schema.startswith("pg_"):  # written unquoted in every statement
            raise StoreError(f"schema {schema!r} is a word PostgreSQL reserves: name another schema")
        scheme = re.match(r"^([A-Za-z][\w+.-]*)://", url)
        if scheme and not re.fullmatch(r"postgres(ql)?(\+\w+)?", scheme.group(1), re.IGNORECASE):
            raise StoreError(
                f"{redacted(url)} is a {scheme.group(1)} URL: the store needs PostgreSQL "
                "(postgresql://user:password@host:port/database)"
            )
        self.url = re.sub(r"^postgres(ql)?(\+\w+)?://", "postgresql://", url, flags=re.IGNORECASE)
        self.table, self.schema, self.embed_dim = table, schema, embed_dim
        self.text_search_config = text_search_config
        self.hnsw_m, self.hnsw_ef_construction, self.ef_search = hnsw_m, hnsw_ef_construction, ef_search
        self.pool_size, self.fulltext_candidates = pool_size, fulltext_candidates
        self.connect_timeout_s = connect_timeout_s
        self.index_precision = index_precision
        self._built_precision: Optional[str] = None
        #: Whether the server's pgvector continues an HNSW scan past rows a WHERE clause drops (0.8 and later);
        #: None until the first connection asks.
        self.iterative_scan: Optional[bool] = None
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
            self._resolve_precision(self.meta(), f"{redacted(self.url)} (table {self.table})")
        assert self._built_precision is not None
        return self._built_precision

    def nearest(self, column: str = "embedding", precision: Optional[str] = None, vector: str = "%s") -> str:
        """SQL ordering rows by cosine distance to the query vector (the placeholder ``vector``), in the form that
        the store's index (or the index of ``precision``) serves."""
        if (precision or self.precision) == "half":
            d = int(self.embed_dim)
            return f"{column}::halfvec({d}) <=> {vector}::halfvec({d})"
        return f"{column} <=> {vector}"

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
            raise MissingDependency(f"PGVectorStore needs llama-index-vector-stores-postgres: {_INSTALL}") from exc
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
        if self.iterative_scan is None:
            row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
            self.iterative_scan = row is not None and _version(str(row[0])) >= ITERATIVE_SCAN_SINCE
        if self.iterative_scan:
            # A scoped HNSW search goes on through the graph until it has its LIMIT of rows inside the scope
            # (or has visited hnsw.max_scan_tuples); an unscoped one never needs to.
            conn.execute("SET hnsw.iterative_scan = strict_order")

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
            if not _unreachable(exc):  # an operational error about the work (a row past an index's size limit)
                raise StoreError(
                    f"the PostgreSQL store at {redacted(self.url)} refused the work: {type(exc).__name__}: {exc}"
                ) from exc
            raise StoreUnavailableError(
                f"the PostgreSQL store at {redacted(self.url)} cannot be reached: {type(exc).__name__}: {exc}"
            ) from exc

    def ensure_extension(self) -> None:
        """Create the ``vector`` extension if the database lacks it (needs the right to create extensions)."""
        psycopg, _, _ = _psycopg()
        try:
            with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        except psycopg.OperationalError as exc:
            raise StoreError(f"cannot connect to PostgreSQL at {redacted(self.url)}: {exc}") from exc
        except psycopg.Error as exc:
            raise StoreError(
                f"the database at {redacted(self.url)} has no pgvector and this user cannot create it ({exc}): "
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
        precision = self._resolve_precision(self.meta(), f"{redacted(self.url)} (table {self.table})")
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
            # The fallback reads the chunks that hold the sentences it found by their node ids (small to big).
            f"CREATE INDEX IF NOT EXISTS {short}_node_id ON {chunks} (node_id)",
            f"CREATE INDEX IF NOT EXISTS {self.vector_index('chunks', precision)} ON {chunks} {hnsw}",
            f"""CREATE TABLE IF NOT EXISTS {windows} (
                id BIGSERIAL PRIMARY KEY, ref_doc_id VARCHAR NOT NULL, node_id VARCHAR NOT NULL,
                text VARCHAR NOT NULL, window_text VARCHAR NOT NULL, metadata_ JSONB, embedding VECTOR({d}))""",
            f"CREATE INDEX IF NOT EXISTS {short}_windows_doc ON {windows} (ref_doc_id)",
            # Scopes (metadata filters) test containment in metadata_ first where they can (stores.postgres.filters).
            f"CREATE INDEX IF NOT EXISTS {short}_metadata ON {chunks} USING gin (metadata_ jsonb_path_ops)",
            f"CREATE INDEX IF NOT EXISTS {short}_windows_metadata ON {windows} USING gin (metadata_ jsonb_path_ops)",
            f"CREATE INDEX IF NOT EXISTS {self.vector_index('windows', precision)} ON {windows} {hnsw}",
            f"CREATE TABLE IF NOT EXISTS {self.name('terms')} (term VARCHAR PRIMARY KEY, df INTEGER NOT NULL)",
            f"CREATE TABLE IF NOT EXISTS {self.name('lexemes')} (lexeme VARCHAR PRIMARY KEY, df INTEGER NOT NULL)",
            f"""CREATE TABLE IF NOT EXISTS {self.name("documents")} (
                ref_doc_id VARCHAR PRIMARY KEY, hash VARCHAR NOT NULL, chunks INTEGER NOT NULL,
                updated TIMESTAMPTZ NOT NULL DEFAULT now())""",
            f"CREATE TABLE IF NOT EXISTS {self.name('meta')} (key VARCHAR PRIMARY KEY, value JSONB NOT NULL)",
        ]
        psycopg, _, _ = _psycopg()
        try:
            with self.connection() as conn, conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (self.name("meta"),))
                for statement in statements:
                    conn.execute(statement)
        except psycopg.errors.UndefinedObject as exc:  # the one name the server knows or not: a text search config
            raise StoreError(
                f"the PostgreSQL store at {redacted(self.url)} has no text search configuration {cfg!r} "
                f"(SELECT cfgname FROM pg_ts_config lists those it has): {exc}"
            ) from exc

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
        where = f"{redacted(self.url)} (table {self.table})"
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
            "store": redacted(self.url),
            "table": self.table,
            "documents": meta.get("documents"),
            "chunks": meta.get("chunks"),
            "updated": meta.get("updated"),
            "embed_model": meta.get("embed_model"),
            "index_precision": meta.get("index_precision", "full"),
        }


def _unreachable(exc: Exception) -> bool:
    """Whether an ``OperationalError`` says the server cannot be reached or used now (no SQLSTATE: the connection
    failed or the pool timed out; class 08 connection exception, 57 operator intervention such as a shutdown, 53
    insufficient resources such as too many connections), rather than that it refused this work."""
    state = getattr(exc, "sqlstate", None)
    return state is None or state[:2] in ("08", "53", "57")


def _version(text: str) -> tuple[int, ...]:
    """``0.8.5`` as ``(0, 8, 5)`` (a part that is not a number counts 0)."""
    return tuple(int(part) if part.isdigit() else 0 for part in text.split("."))


def redacted(url: str) -> str:
    """The connection string without its password, in every form libpq takes: ``user:pass@`` and
    ``?password=`` in a URL, ``password=...`` among key=value pairs. It is shown on /healthz and in errors."""
    if "://" in url:
        url = re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)
        return re.sub(r"([?&]password=)[^&#]*", r"\1***", url, flags=re.IGNORECASE)
    return re.sub(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", url, flags=re.IGNORECASE)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def row_node(text: str, metadata: Mapping[str, Any]) -> BaseNode:
    """A chunk row back as the node that was stored (as ``PGVectorStore`` reads it)."""
    try:
        node = metadata_dict_to_node(dict(metadata))
        node.set_content(text)
    except (ValueError, KeyError, TypeError):
        node = TextNode(text=text, metadata=dict(metadata or {}))
    return node
