"""Ingest into the PostgreSQL store: documents chunked by the one chunker, embedded, and kept consistent
with the word and lexeme statistics in one transaction per batch."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Mapping, Optional, Sequence, Union

import numpy as np
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import BaseNode, Document, MetadataMode
from llama_index.core.vector_stores.utils import node_to_metadata_dict

from llama_index_crag.stores.memory import sentence_windows
from llama_index_crag.stores.postgres.store import FORMAT, PostgresStore, StoreError, now_iso, redacted, row_node
from llama_index_crag.text.split import terms

if TYPE_CHECKING:
    from psycopg import Connection

    from llama_index_crag.stores.folder import IngestReport


def ingest(
    source: Union[Path, str, Sequence[Document]],
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

    ``source`` is a folder (read by ``stores.folder.read_documents``) or the LlamaIndex ``Document``s
    themselves, which then are the whole store, as a folder would be: give each a stable ``id_``. A
    document's metadata (a tenant, a year, tags) is stored with each of its chunks and sentence windows
    (``metadata_``), where a scope's filters read it.
    """
    from tqdm import tqdm

    from llama_index_crag.local.models import default_embed_model
    from llama_index_crag.stores.chunking import chunk
    from llama_index_crag.stores.folder import IndexFolderError, IngestReport, read_documents

    started = time.monotonic()
    documents: List[Document]
    skipped: List[str]
    given = not isinstance(source, (str, Path))
    if isinstance(source, (str, Path)):
        documents, skipped = read_documents(Path(source))
        origin = str(Path(source).resolve())
    else:
        documents, skipped, origin = list(source), [], "documents given to ingest()"
    if not documents:  # never read as "delete everything": an unmounted or mistyped folder would empty the store
        raise IndexFolderError(
            f"{'no documents were given' if given else source} holds no document with text to index; the store "
            f"{store.table} keeps what it holds: to empty it, drop its tables ({store.name('chunks')} and "
            f"{store.table}_*)"
        )
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
    report = IngestReport(index_dir=f"{redacted(store.url)}#{store.table}", documents=len(documents), nodes=0)
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
            # Every id of the batch, not only those known before the lock: an ingest running beside this one
            # may have written them since (then inserting them again was a UniqueViolation).
            _delete_documents(conn, store, [d.id_ for d in batch])
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
            "created": old_meta.get("created") or now_iso(),
            "updated": now_iso(),
            "source": origin,
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
                # The chunk's metadata, which is its document's: a scope filters windows as it filters chunks.
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
        words.update(set(terms(row_node(text, metadata).get_content(MetadataMode.EMBED))))
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
