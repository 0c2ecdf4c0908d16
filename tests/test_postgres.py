"""The engine over a real PostgreSQL with pgvector: ingest, incremental updates, retrieval, grading, serving."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import numpy as np
import pytest
from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.schema import MetadataMode, QueryBundle

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.core.persisted import engine_from_store
from llama_index_crag.datasets import SAMPLE_DIR, load_documents, load_questions
from llama_index_crag.local.embedding_cache import DiskCachedEmbedding
from llama_index_crag.scorers.evidence import EvidenceScorer
from llama_index_crag.stores.chunking import chunk
from llama_index_crag.stores.postgres import (
    PostgresFullTextRetriever,
    PostgresSentenceWindowRetriever,
    PostgresStore,
    PostgresVectorRetriever,
    StoreError,
    ingest,
)
from llama_index_crag.text.split import terms
from tests.conftest import ScriptedLLM, write_hostile_documents
from tests.loadtest import ServerProcess, free_port, run_load
from tests.pg_server import pg_url  # noqa: F401  (the session fixture)


class CountingEmbedding(BaseEmbedding):
    """The bundled model, counting the passages and queries it embeds."""

    _inner: BaseEmbedding = PrivateAttr()
    _passages: List[str] = PrivateAttr(default_factory=list)
    _queries: List[str] = PrivateAttr(default_factory=list)

    def __init__(self, inner: BaseEmbedding) -> None:
        super().__init__(model_name=inner.model_name, embed_batch_size=inner.embed_batch_size)
        self._inner = inner

    def _get_query_embedding(self, query: str) -> Embedding:
        self._queries.append(query)
        return self._inner.get_query_embedding(query)

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._get_text_embeddings([text])[0]

    def _get_text_embeddings(self, texts: List[str]) -> List[Embedding]:
        self._passages.extend(texts)
        return self._inner.get_text_embedding_batch(texts)

    def reset(self) -> None:
        self._passages.clear()
        self._queries.clear()


@pytest.fixture(scope="module")
def cached_embed(embed_model: Any, tmp_path_factory: pytest.TempPathFactory) -> BaseEmbedding:
    """The bundled model, keeping the sample's passage vectors for a second store over the same documents."""
    return DiskCachedEmbedding(embed_model, tmp_path_factory.mktemp("vectors") / "passages.npz")


@pytest.fixture(scope="module")
def sample_store(pg_url: str, cached_embed: BaseEmbedding) -> Iterator[PostgresStore]:  # noqa: F811
    store = PostgresStore(pg_url, table="sample")
    ingest(SAMPLE_DIR, store, cached_embed)
    yield store
    store.close()


def _copy_sample(folder: Path, count: int) -> List[Path]:
    """The first ``count`` sample documents as text files (a folder ``ingest`` re-reads as it changes)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for document in load_documents()[:count]:
        path = folder / f"{document.id_}.txt"
        path.write_text(document.text)
        paths.append(path)
    return paths


def _df(store: PostgresStore, table: str, column: str, value: str) -> int:
    with store.connection() as conn:
        row = conn.execute(f"SELECT df FROM {store.name(table)} WHERE {column} = %s", (value,)).fetchone()
    return int(row[0]) if row else 0


# --- ingest ---------------------------------------------------------------------------------------------------


def test_ingest_writes_the_chunks_windows_and_word_frequencies_of_the_in_memory_index(
    sample_store: PostgresStore, embed_model: Any
) -> None:
    chunks = chunk(load_documents())
    texts = [c.get_content(metadata_mode=MetadataMode.EMBED) for c in chunks]
    in_memory = EvidenceScorer(corpus=texts).corpus_stats()
    meta = sample_store.meta()
    assert meta["chunks"] == len(chunks) and meta["documents"] == len(load_documents())
    with sample_store.connection() as conn:
        stored = dict(conn.execute(f"SELECT term, df FROM {sample_store.name('terms')}").fetchall())
        windows = conn.execute(f"SELECT count(*) FROM {sample_store.name('windows')}").fetchone()
    assert set(stored) == set(in_memory["idf"])
    from llama_index_crag.stores.postgres import stored_scorer

    scorer, weights = stored_scorer(sample_store, CountingEmbedding(embed_model))
    for word in list(in_memory["idf"])[:50]:
        assert weights[word] == pytest.approx(in_memory["idf"][word], abs=1e-5)
    assert windows is not None and windows[0] > len(chunks)  # several sentences a chunk


def test_ingest_again_updates_only_what_changed_and_keeps_the_frequencies_right(
    pg_url: str,  # noqa: F811
    embed_model: Any,
    tmp_path: Path,
) -> None:
    store = PostgresStore(pg_url, table="incremental")
    paths = _copy_sample(tmp_path / "docs", 4)
    first = ingest(tmp_path / "docs", store, embed_model)
    assert len(first.added) == 4 and not first.updated and not first.removed

    gone = paths[0]
    gone_words = set(terms(gone.read_text()))
    gone.unlink()
    paths[1].write_text(paths[1].read_text() + " Zyxquartz flanges are audited every Tuesday.")
    (tmp_path / "docs" / "new.txt").write_text("The Quillmore observatory opened in 1931 on a basalt ridge.")
    second = ingest(tmp_path / "docs", store, embed_model)

    assert second.removed == [gone.name] and second.updated == [paths[1].name] and second.added == ["new.txt"]
    assert second.unchanged == 2
    kept_text = " ".join(p.read_text() for p in (tmp_path / "docs").iterdir())
    only_gone = sorted(gone_words - set(terms(kept_text)))
    assert only_gone and all(_df(store, "terms", "term", w) == 0 for w in only_gone)
    assert _df(store, "terms", "term", "zyxquartz") == 1 and _df(store, "terms", "term", "quillmor") == 1
    assert _df(store, "lexemes", "lexeme", "zyxquartz") == 1
    with store.connection() as conn:
        rows = conn.execute(
            f"SELECT metadata_->>'ref_doc_id', count(*) FROM {store.name('chunks')} GROUP BY 1"
        ).fetchall()
        windows = conn.execute(f"SELECT DISTINCT ref_doc_id FROM {store.name('windows')}").fetchall()
    assert {r[0] for r in rows} == {p.name for p in (tmp_path / "docs").iterdir()}
    assert {r[0] for r in windows} == {r[0] for r in rows}
    assert store.meta()["chunks"] == sum(r[1] for r in rows)

    third = ingest(tmp_path / "docs", store, embed_model)
    assert third.unchanged == 4 and not (third.added or third.updated or third.removed)
    store.close()


def test_two_ingests_of_one_folder_at_once_both_finish_and_the_store_holds_each_document_once(
    pg_url: str,  # noqa: F811
    embed_model: Any,
    tmp_path: Path,
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    paths = _copy_sample(tmp_path / "docs", 12)
    stores = [PostgresStore(pg_url, table="concurrent") for _ in range(2)]
    # Each reads what the store holds before the lock; the second used to insert again what the first had
    # written meanwhile (UniqueViolation). batch_documents=2: many transactions, so the two interleave.
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(ingest, tmp_path / "docs", store, embed_model, 3, 2) for store in stores]
        reports = [run.result() for run in runs]
    assert all(r.documents == len(paths) for r in reports)
    with stores[0].connection() as conn:
        rows = conn.execute(f"SELECT ref_doc_id, chunks FROM {stores[0].name('documents')}").fetchall()
        chunks = conn.execute(f"SELECT count(*) FROM {stores[0].name('chunks')}").fetchone()
    assert sorted(r[0] for r in rows) == sorted(p.name for p in paths)
    assert chunks is not None and chunks[0] == sum(r[1] for r in rows) == stores[0].meta()["chunks"]
    for store in stores:
        store.close()


def test_a_store_embedded_with_another_model_is_refused_with_the_fix(sample_store: PostgresStore) -> None:
    from llama_index.core.embeddings import MockEmbedding

    with pytest.raises(StoreError, match="ingest it again"):
        engine_from_store(sample_store, ScriptedLLM(), embed_model=MockEmbedding(embed_dim=384))


# --- retrieval ------------------------------------------------------------------------------------------------


def test_the_full_text_fallback_finds_a_passage_by_its_rare_words(sample_store: PostgresStore) -> None:
    documents = load_documents()
    document = documents[7]
    elsewhere = {w for d in documents if d.id_ != document.id_ for w in terms(d.text)}
    rare = sorted(set(terms(document.text)) - elsewhere, key=lambda w: (-len(w), w))[:2]
    hits = PostgresFullTextRetriever(sample_store, 3).retrieve(QueryBundle(" ".join(rare) + " weather football"))
    assert hits and hits[0].node.ref_doc_id == document.id_
    assert hits[0].node.embedding is not None  # stored vectors come back for grading


def test_the_full_text_fallback_ranks_only_chunks_holding_the_rarest_lexemes_within_its_budget(
    sample_store: PostgresStore,
) -> None:
    document = load_documents()[7]
    with sample_store.connection() as conn:
        size = conn.execute(f"SELECT count(*) FROM {sample_store.name('chunks')}").fetchone()[0]
        frequencies = dict(conn.execute(f"SELECT lexeme, df FROM {sample_store.name('lexemes')}").fetchall())
        own = {
            r[0]
            for r in conn.execute(
                f"SELECT DISTINCT u.lexeme FROM {sample_store.name('chunks')} c, unnest(c.text_search_tsv) u "
                "WHERE c.metadata_->>'ref_doc_id' = %s",
                (document.id_,),
            )
        }
    rare = sorted((w for w in own if frequencies[w] == 1 and w.isalpha()), key=lambda w: (-len(w), w))[0]
    common = sorted((w for w in frequencies if w not in own and frequencies[w] <= size / 2), key=frequencies.get)[-3:]
    query = QueryBundle(" ".join([rare, *common]))

    everything = PostgresFullTextRetriever(sample_store, 5).retrieve(query)  # budget above the corpus: all match
    assert {h.node.ref_doc_id for h in everything} - {document.id_}, "common words should reach other documents"
    capped_store = PostgresStore(sample_store.url, table=sample_store.table, fulltext_candidates=1)
    try:
        capped = PostgresFullTextRetriever(capped_store, 5).retrieve(query)
    finally:
        capped_store.close()
    assert capped and {h.node.ref_doc_id for h in capped} == {document.id_}


def test_the_candidate_lexemes_are_the_rarest_within_the_budget_and_never_none() -> None:
    from llama_index_crag.stores.postgres import candidate_lexemes

    found = [("common", 900), ("rare", 3), ("middling", 200), ("odd", 40)]
    assert candidate_lexemes(found, 1000) == ["rare", "odd", "middling"]
    assert candidate_lexemes(found, 243) == ["rare", "odd", "middling"]
    assert candidate_lexemes(found, 242) == ["rare", "odd"]
    assert candidate_lexemes([("common", 900)], 10) == ["common"]
    with pytest.raises(StoreError, match="at least 1"):
        PostgresStore("postgresql://x@127.0.0.1/y", fulltext_candidates=0)


def test_sentence_windows_return_the_sentence_with_its_neighbours(
    sample_store: PostgresStore, embed_model: Any
) -> None:
    document = load_documents()[3]
    sentences = [s for s in document.text.split(". ") if len(s.split()) > 4]
    hits = PostgresSentenceWindowRetriever(sample_store, embed_model, 2, widen_to="window").retrieve(sentences[1])
    assert len(hits) == 4
    best = hits[0].node.get_content()
    assert sentences[1] in best and len(best) > len(sentences[1]) + 20
    assert hits[0].node.metadata["doc_id"] == document.id_
    with pytest.raises(ValueError, match="'chunk' or its 'window'"):
        PostgresSentenceWindowRetriever(sample_store, embed_model, 2, widen_to="page")


def test_sentence_hits_are_widened_to_their_chunks_with_the_vectors_the_store_holds(
    sample_store: PostgresStore, embed_model: Any
) -> None:
    document = load_documents()[3]
    sentence = [s for s in document.text.split(". ") if len(s.split()) > 4][1]
    hits = PostgresSentenceWindowRetriever(sample_store, embed_model, 2).retrieve(sentence)
    assert 1 <= len(hits) <= 2 and len({h.node.node_id for h in hits}) == len(hits)  # each chunk once
    assert sentence in hits[0].node.get_content() and hits[0].node.metadata["doc_id"] == document.id_
    chunks = {c.get_content(): c for c in chunk([document])}
    stored = chunks[hits[0].node.get_content()]  # the chunk as ingest cut it, not a window
    assert hits[0].node.node_id == stored.node_id
    vector = np.asarray(hits[0].node.embedding)
    expected = np.asarray(embed_model.get_text_embedding(stored.get_content(metadata_mode=MetadataMode.EMBED)))
    assert vector.shape == expected.shape and float(vector @ expected) > 0.999  # the vector the store holds


# --- the engine -----------------------------------------------------------------------------------------------


def test_the_engine_over_the_store_takes_the_in_memory_engines_actions(
    sample_store: PostgresStore, embed_model: Any
) -> None:
    in_memory = CorrectiveQueryEngine.from_defaults(
        nodes=chunk(load_documents()), llm=ScriptedLLM(), embed_model=embed_model
    )
    stored = engine_from_store(sample_store, ScriptedLLM(), embed_model=embed_model)
    differences: Dict[str, Any] = {}
    for question in load_questions():
        a = in_memory.query(question.question).metadata["crag"]  # type: ignore[index]
        b = stored.query(question.question).metadata["crag"]  # type: ignore[index]
        assert a["action"] == b["action"], question.question
        assert a["top_score"] == pytest.approx(b["top_score"], abs=1e-3), question.question
        if a["abstained"] != b["abstained"]:
            differences[question.question] = (a["fallback_sources"], b["fallback_sources"])
    # Only the INCORRECT branch's second retrieval differs (BM25 in memory, ts_rank with BM25's IDF here).
    assert len(differences) <= 2, differences


def test_grading_reuses_the_stored_embeddings_and_embeds_only_the_query(
    sample_store: PostgresStore, embed_model: Any
) -> None:
    counting = CountingEmbedding(embed_model)
    engine = engine_from_store(sample_store, ScriptedLLM(), embed_model=counting, max_rewrites=0)
    counting.reset()
    trace = engine.query("Who is the CEO of Harbor Analytics?").metadata["crag"]  # type: ignore[index]
    assert trace["action"] == "correct"
    assert counting._passages == [] and counting._queries == ["Who is the CEO of Harbor Analytics?"]


def test_an_incorrect_correction_over_the_store_embeds_only_the_question(
    sample_store: PostgresStore, embed_model: Any
) -> None:
    counting = CountingEmbedding(embed_model)
    engine = engine_from_store(sample_store, ScriptedLLM(), embed_model=counting)
    counting.reset()
    question = "What colour is the roof of the Kestrel Bridge tollhouse?"
    trace = engine.query(question).metadata["crag"]  # type: ignore[index]
    assert trace["action"] == "incorrect" and "sentence_window" in trace["fallback_sources"], trace
    # The fallback's sentence hits come back as chunks with their stored vectors: the regrade embeds no passage.
    assert counting._passages == [] and counting._queries == [question], counting._passages[:3]


def test_answering_reads_only_what_each_query_needs_never_a_whole_table(sample_store: PostgresStore) -> None:
    class NoSeqScan(PostgresStore):
        def _configure(self, conn: Any) -> None:
            super()._configure(conn)
            conn.execute("SET enable_seqscan = off")  # a small table would be scanned even where an index serves

    store = NoSeqScan(sample_store.url, table=sample_store.table)
    sample_store.close()  # backends flush their table statistics when they exit (the ingest's ones too)
    time.sleep(1.0)
    before = _seq_scans(sample_store)
    engine = engine_from_store(store, ScriptedLLM(), fallback_sources=("fulltext", "sentence_window"))
    for question in ("Who is the CEO of Harbor Analytics?", "Who wrote the novel Moby-Dick?"):
        engine.query(question)
    store.close()  # its backends exit, which flushes their table statistics
    time.sleep(1.0)
    after = _seq_scans(sample_store)
    assert after == before, f"sequential scans during queries: {before} -> {after}"


def _seq_scans(store: PostgresStore) -> Dict[str, int]:
    names = [store.name(p).split(".")[1] for p in ("chunks", "windows", "terms", "lexemes", "documents")]
    with store.connection() as conn:
        rows = conn.execute(
            "SELECT relname, seq_scan FROM pg_stat_user_tables WHERE relname = ANY(%s)", (names,)
        ).fetchall()
    return dict(rows)


def test_half_precision_indexes_find_the_same_chunks_with_exact_scores_and_fix_the_stores_precision(
    sample_store: PostgresStore, embed_model: Any, cached_embed: BaseEmbedding
) -> None:
    half = PostgresStore(sample_store.url, table="sample_half", index_precision="half")
    ingest(SAMPLE_DIR, half, cached_embed)  # the sample's vectors again, from the cache
    with half.connection() as conn:
        indexes = [
            row[0] for row in conn.execute("SELECT indexdef FROM pg_indexes WHERE indexdef LIKE %s", ("%hnsw%",))
        ]
        assert sum("sample_half" in i and "halfvec(384)) halfvec_cosine_ops" in i for i in indexes) == 2
        conn.execute("SET enable_seqscan = off")  # the sample's table is small enough to be scanned otherwise
        vector = np.asarray(embed_model.get_query_embedding("Who is the CEO of Harbor Analytics?"), dtype=np.float32)
        plan = conn.execute(
            f"EXPLAIN SELECT id FROM {half.name('chunks')} ORDER BY {half.nearest()} LIMIT 5", (vector,)
        )
        assert "Index Scan using data_sample_half_embedding_half_idx" in "\n".join(r[0] for r in plan)
    for question in [q.question for q in load_questions()[:8]]:
        full_hits = PostgresVectorRetriever(sample_store, embed_model, 5).retrieve(question)
        half_hits = PostgresVectorRetriever(half, embed_model, 5).retrieve(question)
        assert [h.node.get_content() for h in half_hits] == [h.node.get_content() for h in full_hits], question
        assert [h.score for h in half_hits] == pytest.approx([h.score for h in full_hits], abs=1e-6)
        assert half_hits[0].node.embedding == full_hits[0].node.embedding  # the table keeps the full vectors
    reopened = PostgresStore(sample_store.url, table="sample_half")  # serving takes the store's own precision
    assert reopened.require()["index_precision"] == "half" and reopened.precision == "half"
    assert reopened.describe()["index_precision"] == "half"
    with pytest.raises(StoreError, match="half-precision vector indexes, not full"):
        PostgresStore(sample_store.url, table="sample_half", index_precision="full").require()
    with pytest.raises(StoreError, match="full-precision vector indexes, not half"):
        ingest(
            SAMPLE_DIR, PostgresStore(sample_store.url, table=sample_store.table, index_precision="half"), embed_model
        )
    with pytest.raises(StoreError, match="index_precision must be one of full, half"):
        PostgresStore(sample_store.url, index_precision="quarter")
    for store in (half, reopened):
        store.close()


def test_a_stock_pgvectorstore_reads_the_store_and_opens_the_engine(
    sample_store: PostgresStore, embed_model: Any
) -> None:
    from llama_index.core import VectorStoreIndex

    vector_store = sample_store.vector_store()
    hits = (
        VectorStoreIndex.from_vector_store(vector_store, embed_model=embed_model)
        .as_retriever()
        .retrieve("Who is the CEO of Harbor Analytics?")
    )
    assert hits and "Harbor Analytics" in hits[0].node.get_content()
    engine = CorrectiveQueryEngine.from_defaults(vector_store=vector_store, llm=ScriptedLLM(), embed_model=embed_model)
    assert engine.query("Who is the CEO of Harbor Analytics?").metadata["crag"]["action"] == "correct"  # type: ignore[index]


async def test_the_async_engine_over_the_store_answers_as_the_sync_one(
    sample_store: PostgresStore, embed_model: Any
) -> None:
    engine = engine_from_store(sample_store, ScriptedLLM(), embed_model=embed_model)
    for question in ("Who is the CEO of Harbor Analytics?", "Who wrote the novel Moby-Dick?"):
        sync = engine.query(question).metadata["crag"]  # type: ignore[index]
        not_sync = (await engine.aquery(question)).metadata["crag"]  # type: ignore[index]
        assert (sync["action"], sync["abstained"]) == (not_sync["action"], not_sync["abstained"])


# --- serving --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_serve_store_with_two_workers_answers_a_bounded_load_without_errors(
    sample_store: PostgresStore, tmp_path: Path
) -> None:
    questions = [q.question for q in load_questions()][:10]
    extra = ["--store", sample_store.url, "--table", sample_store.table, "--llm", "none"]
    with ServerProcess("", free_port(), workers=2, extra=extra) as server:
        result = run_load(server.url, questions, total=60, concurrency=8)
        memory = server.memory_mb()
    assert len(memory) >= 3 and min(memory) > 0, memory  # the supervisor and its two workers, each measured
    *others, first, second = sorted(memory)
    assert min(first, second) - max(others) > 300, f"two workers hold the models, the supervisors do not: {memory}"
    summary = result.summary()
    assert summary["errors"] == 0 and summary["cross_talk"] == 0, summary
    assert summary["queries"] == 60


def test_ingest_takes_documents_with_nul_surrogates_odd_names_and_a_huge_word(
    pg_url: str,  # noqa: F811
    embed_model: Any,
    tmp_path: Path,
) -> None:
    folders = write_hostile_documents(tmp_path / "docs")
    stores = {name: PostgresStore(pg_url, table=f"hostile_{name}") for name in folders}
    for name, folder in folders.items():
        report = ingest(folder, stores[name], embed_model)
        assert report.added and not report.skipped
    files = PostgresFullTextRetriever(stores["files"], similarity_top_k=2)
    hits = files.retrieve("Brill\x00Saturdays")  # a NUL in the query too
    assert hits and "sold in Brill on Saturdays" in hits[0].node.get_content()
    assert "\ufffd" in PostgresFullTextRetriever(stores["jsonl"], 2).retrieve("rye flour")[0].node.get_content()
    with stores["files"].connection() as conn:
        ids = {row[0] for row in conn.execute(f"SELECT ref_doc_id FROM {stores['files'].name('documents')}")}
    assert ids == {"nul.txt", "word.txt", "latin1-\\xe9t\\xe9.txt"}
    for store in stores.values():
        store.close()


def test_a_row_the_database_refuses_is_a_store_error_not_an_outage(pg_url: str, tmp_path: Path) -> None:  # noqa: F811
    from llama_index_crag.stores.postgres import StoreUnavailableError

    docs = tmp_path / "docs"
    docs.mkdir()
    rows = [{"doc_id": "nul\u0000id", "text": "The Ostmoor creamery ages Vell Blue for nine weeks."}]
    (docs / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = PostgresStore(pg_url, table="odd_ids")
    assert ingest(docs, store).added == ["nul id"]  # PostgreSQL refuses NUL in text: the id is cleaned as text is
    random_id = os.urandom(4000).hex()  # past the btree index's row size limit (2,704 bytes) even compressed
    rows.append({"doc_id": random_id, "text": "An id past the btree index's row size limit."})
    (docs / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(StoreError, match="refused the work: ProgramLimitExceeded") as raised:
        ingest(docs, store)
    assert not isinstance(raised.value, StoreUnavailableError)  # the server answers; the row is what is wrong
    store.close()


def test_ingest_refuses_a_folder_without_documents(pg_url: str, tmp_path: Path) -> None:  # noqa: F811
    from llama_index_crag.stores.folder import IndexFolderError

    (tmp_path / "empty").mkdir()
    with pytest.raises(IndexFolderError, match="the store empty keeps what it holds: to empty it, drop its tables"):
        ingest(tmp_path / "empty", PostgresStore(pg_url, table="empty"))
    shutil.rmtree(tmp_path / "empty")


def test_a_killed_test_process_leaves_no_postgresql_behind() -> None:
    import os
    import signal
    import subprocess
    import sys

    import psycopg

    script = (
        "import os, signal, sys\n"
        "from tests.pg_server import LocalPostgres\n"
        "server = LocalPostgres().start()\n"
        "print(server.url, server.data, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    url, data = done.stdout.split()
    deadline = time.monotonic() + 60
    while Path(data).exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not Path(data).exists(), "the watchdog should stop the server and remove its folder"
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url, connect_timeout=5)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://crag:s3cret@db:5432/rag", "postgresql://crag:***@db:5432/rag"),
        (
            "postgresql://crag@db/rag?password=s3cret&sslmode=require",
            "postgresql://crag@db/rag?password=***&sslmode=require",
        ),
        ("postgresql://db/rag?sslmode=require&PASSWORD=s3cret", "postgresql://db/rag?sslmode=require&PASSWORD=***"),
        ("host=db password=s3cret dbname=rag", "host=db password=*** dbname=rag"),
        ("host=db password='s3 cret' dbname=rag", "host=db password=*** dbname=rag"),
        ("postgresql://crag@db/rag", "postgresql://crag@db/rag"),
    ],
)
def test_the_password_is_hidden_in_every_form_of_the_connection_string(url: str, shown: str) -> None:
    # What /healthz (open without the API key), errors and the ingest summary show of the store.
    from llama_index_crag.stores.postgres.store import redacted

    assert redacted(url) == shown


@pytest.mark.parametrize(
    "url", ["postgresql://x@db/y", "postgres://x@db/y", "POSTGRESQL+psycopg2://x@db/y", "host=db dbname=y"]
)
def test_a_postgresql_connection_string_is_taken_in_each_form(url: str) -> None:
    assert PostgresStore(url).url in ("postgresql://x@db/y", "host=db dbname=y")


@pytest.mark.parametrize("schema", ["order", "user", "pg_catalog"])
def test_a_schema_named_with_a_reserved_word_is_refused_when_the_store_is_made(schema: str) -> None:
    # Written unquoted in every statement: it passed the name check and failed in a psycopg SyntaxError.
    with pytest.raises(StoreError, match=f"schema '{schema}' is a word PostgreSQL reserves"):
        PostgresStore("postgresql://x@db/y", schema=schema)


def test_a_text_search_configuration_the_server_lacks_is_named(pg_url: str) -> None:  # noqa: F811
    store = PostgresStore(pg_url, table="no_such_config", text_search_config="klingon")
    with pytest.raises(StoreError, match="has no text search configuration 'klingon'"):
        store.create_schema()
    store.close()


@pytest.mark.parametrize("url", ["mysql://crag:s3cret@db/rag", "sqlite:///rag.db", "redis://db:6379"])
def test_a_connection_string_for_another_database_is_refused_by_name(url: str) -> None:
    # It used to reach the server check and be reported as a PostgreSQL "with no pgvector".
    with pytest.raises(StoreError, match="URL: the store needs PostgreSQL") as refused:
        PostgresStore(url)
    assert "s3cret" not in str(refused.value)


def test_an_unreachable_store_is_a_clear_error_and_the_store_recovers_when_it_is_back(tmp_path: Path) -> None:
    import httpx

    from llama_index_crag import RetrievalUnavailableError
    from llama_index_crag.server.app import create_app
    from llama_index_crag.server.service import ServerConfig
    from llama_index_crag.stores.postgres import StoreUnavailableError
    from tests.live_server import LiveServer
    from tests.pg_server import LocalPostgres

    _copy_sample(tmp_path / "docs", 4)
    with LocalPostgres() as server:
        store = PostgresStore(server.url, table="outage", connect_timeout_s=2)
        ingest(tmp_path / "docs", store)
        engine = engine_from_store(store, ScriptedLLM(), max_rewrites=0)
        question = "Who is the CEO of Harbor Analytics?"
        assert engine.query(question).metadata["crag"]["action"] == "correct"  # type: ignore[index]
        with LiveServer(create_app(engine, ServerConfig())) as live:
            server.halt()
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="cannot be reached") as raised:
                engine.query(question)
            assert time.monotonic() - started < 30, "a dead store fails within its timeouts, it does not hang"
            assert isinstance(raised.value, RetrievalUnavailableError)
            reply = httpx.post(live.url + "/query", json={"query": question}, timeout=60)
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "retrieval_unavailable"
            assert "PostgreSQL store at postgresql://postgres@127.0.0.1" in reply.json()["error"]["message"]
            server.launch()
            back = time.monotonic()
            reply = httpx.post(live.url + "/query", json={"query": question}, timeout=60)
            while reply.status_code == 503 and time.monotonic() - back < 60:  # the pool reconnects with backoff
                time.sleep(1.0)
                reply = httpx.post(live.url + "/query", json={"query": question}, timeout=60)
            assert reply.status_code == 200 and reply.json()["action"] == "correct", reply.text
        store.close()
