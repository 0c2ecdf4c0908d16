"""Full against half-precision HNSW indexes in PostgreSQL: recall against an exact scan, latency, size, build time.

``PostgresStore(index_precision="half")`` indexes ``halfvec`` casts of the stored
vectors (2 bytes a dimension instead of 4); the table keeps the full vectors. This
measures what that costs, on SciFact's real vectors (its chunks and its sentence
windows, the claims as queries) and then on the chunks grown with synthetic rows to
``--size``. Both indexes stand side by side on the same table, and each query orders
by the expression of the index it measures, so the two are compared in one run.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_index_precision.py --dataset ../shared/datasets/scifact \\
        --queries 300 --size 100000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set

import numpy as np

from benchmarks.bench_postgres import bench_server, grow, results_head, scifact_store
from llama_index_crag.datasets import load_documents
from llama_index_crag.stores.chunking import chunk
from llama_index_crag.stores.postgres import PRECISIONS, PostgresStore
from llama_index_crag.text.split import terms

EF_SEARCH = (40, 100)


def build(store: PostgresStore, part: str, precision: str) -> Dict[str, float]:
    """(Re)build the ``precision`` HNSW index on ``part``: its seconds and size."""
    index = store.vector_index(part, precision)
    with store.connection() as conn:
        conn.execute(f"DROP INDEX IF EXISTS {store.schema}.{index}")
        conn.execute("SET maintenance_work_mem = '8GB'")
        conn.execute("SET max_parallel_maintenance_workers = 2")
        started = time.perf_counter()
        conn.execute(
            f"CREATE INDEX {index} ON {store.name(part)} USING hnsw {store.hnsw_columns(precision)} "
            f"WITH (m = {store.hnsw_m}, ef_construction = {store.hnsw_ef_construction})"
        )
        seconds = time.perf_counter() - started
    return {"build_s": round(seconds, 1), "index_mb": index_mb(store, part, precision)}


def index_mb(store: PostgresStore, part: str, precision: str) -> float:
    with store.connection() as conn:
        row = conn.execute(
            "SELECT pg_relation_size(%s)", (f"{store.schema}.{store.vector_index(part, precision)}",)
        ).fetchone()
    assert row is not None
    return round(row[0] / 2**20, 1)


def measure(store: PostgresStore, part: str, vectors: Sequence[np.ndarray]) -> Dict[str, Any]:
    """recall@5 and latency of each precision's index at each ``ef_search``, against an exact full-precision scan."""
    table = store.name(part)
    found: Dict[str, Any] = {}
    with store.connection() as conn:
        truth: List[Set[int]] = []
        with conn.transaction():
            conn.execute("SET LOCAL enable_indexscan = off")
            for v in vectors:
                # not prepared: a generic plan cached now, with index scans off, would serve the full index's
                # identical query below with a sequential scan (PostgreSQL keeps it when the setting changes back)
                exact = f"SELECT id FROM {table} ORDER BY embedding <=> %s LIMIT 5"
                rows = conn.execute(exact, (v,), prepare=False).fetchall()
                truth.append({r[0] for r in rows})
        conn.execute("SET enable_seqscan = off")  # a small table would be scanned rather than searched
        for precision in PRECISIONS:
            query = f"SELECT id FROM {table} ORDER BY {store.nearest(precision=precision)} LIMIT 5"
            plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + query, (vectors[0],)))
            assert store.vector_index(part, precision) in plan, plan  # the index under test serves the query
            for ef in EF_SEARCH:
                conn.execute(f"SET hnsw.ef_search = {ef}")
                hits, times = [], []
                for v, expected in zip(vectors, truth):
                    start = time.perf_counter()
                    got = {r[0] for r in conn.execute(query, (v,)).fetchall()}
                    times.append((time.perf_counter() - start) * 1000.0)
                    hits.append(len(got & expected) / 5)
                found[f"{precision}, ef_search={ef}"] = {
                    "recall_at_5": round(float(np.mean(hits)), 4),
                    "p50_ms": round(float(np.percentile(times, 50)), 2),
                    "p95_ms": round(float(np.percentile(times, 95)), 2),
                }
        conn.execute(f"SET hnsw.ef_search = {store.ef_search}")
        conn.execute("RESET enable_seqscan")
    return found


def compare(store: PostgresStore, part: str, vectors: Sequence[np.ndarray], rebuild_full: bool) -> Dict[str, Any]:
    with store.connection() as conn:
        count = conn.execute(f"SELECT count(*) FROM {store.name(part)}").fetchone()
    assert count is not None
    row: Dict[str, Any] = {"table": part, "rows": int(count[0])}
    for precision in PRECISIONS:
        row[precision] = build(store, part, precision) if precision == "half" or rebuild_full else {}
    row["queries"] = measure(store, part, vectors)
    print(json.dumps(row, indent=1), flush=True)
    return row


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="../shared/datasets/scifact", help="folder in the shared dataset format")
    parser.add_argument("--queries", type=int, default=300, help="claims used as queries")
    parser.add_argument("--size", type=int, default=100_000, help="chunks to grow the store to (0: real data only)")
    parser.add_argument("--cache-dir", default=".crag-cache", help="where corpus embeddings are cached")
    parser.add_argument("--out", default="eval-out/bench_index_precision", help="folder for the JSON figures")
    args = parser.parse_args(argv)
    results = results_head("bench_index_precision.py", args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = bench_server()
    try:
        embed, sample = scifact_store(server.url, args)
        store = PostgresStore(server.url, table="scifact")
        vectors = [np.asarray(embed.get_query_embedding(q), dtype=np.float32) for q in sample]
        for part in ("chunks", "windows"):  # real vectors: both indexes built here, timed alike
            results["rows"].append(compare(store, part, vectors, rebuild_full=True))
        if args.size > store.chunk_count():
            with store.connection() as conn:  # grow() rebuilds the full index; the half one is built after it
                conn.execute(f"DROP INDEX IF EXISTS {store.schema}.{store.vector_index('chunks', 'half')}")
            nodes = chunk(load_documents(args.dataset))
            vocabulary = sorted({w for n in nodes[:2000] for w in n.get_content().lower().split() if w.isalpha()})
            grown = grow(store, args.size, [w for w in vocabulary if terms(w)], seed=args.size)
            row = compare(store, "chunks", vectors, rebuild_full=False)
            row["full"] = {"build_s": grown["hnsw_index_s"], "index_mb": index_mb(store, "chunks", "full")}
            results["rows"].append(row)
        (out / "bench_index_precision.json").write_text(json.dumps(results, indent=1))
        store.close()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
