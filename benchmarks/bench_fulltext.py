"""The full-text fallback's cost and reach in PostgreSQL as the store grows, by candidate budget, cold and warm.

Grows SciFact's store with synthetic chunks to each ``--sizes`` (as ``bench_postgres.py``
does, without the HNSW index: only the full-text search runs here) and, for each
``--budgets`` value of ``PostgresStore(fulltext_candidates=)``, runs the full-text
retriever over the claims twice: cold (PostgreSQL restarted and, where this user may,
the kernel's page cache dropped, so the chunks' ``tsvector`` values come from disk) and
warm (again, with what the first pass read in memory). Reports p50 / p95 of each pass
and each budget's top-5 overlap with the largest budget's.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_fulltext.py --dataset ../shared/datasets/scifact \\
        --sizes 5183,1000000 --budgets 1000,300,100 --queries 200
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from benchmarks.bench_postgres import bench_server, grow, results_head, scifact_store
from llama_index_crag.datasets import load_documents
from llama_index_crag.stores.chunking import chunk
from llama_index_crag.stores.postgres import PostgresFullTextRetriever, PostgresStore
from llama_index_crag.text.split import terms


def drop_page_cache() -> bool:
    """Drop the kernel's page cache (root only); False where it cannot."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def run_pass(store: PostgresStore, claims: Sequence[str]) -> Dict[str, Any]:
    retriever = PostgresFullTextRetriever(store, similarity_top_k=5)
    times: List[float] = []
    tops: List[List[str]] = []
    for claim in claims:
        start = time.perf_counter()
        hits = retriever.retrieve(claim)
        times.append((time.perf_counter() - start) * 1000.0)
        tops.append([h.node.get_content()[:80] for h in hits])
    return {
        "p50_ms": round(float(np.percentile(times, 50)), 1),
        "p95_ms": round(float(np.percentile(times, 95)), 1),
        "tops": tops,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="../shared/datasets/scifact", help="folder in the shared dataset format")
    parser.add_argument("--sizes", default="5183,1000000", help="chunk counts to measure at (the first is SciFact)")
    parser.add_argument("--budgets", default="1000,300,100", help="fulltext_candidates values, largest first")
    parser.add_argument("--queries", type=int, default=200, help="claims used as queries")
    parser.add_argument("--cache-dir", default=".crag-cache", help="where corpus embeddings are cached")
    parser.add_argument("--out", default="eval-out/bench_fulltext", help="folder for the JSON figures")
    args = parser.parse_args(argv)
    budgets = sorted((int(b) for b in args.budgets.split(",")), reverse=True)
    results = results_head("bench_fulltext.py", args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = bench_server()
    try:
        _, sample = scifact_store(server.url, args)
        nodes = chunk(load_documents(args.dataset))
        vocabulary = sorted({w for n in nodes[:2000] for w in n.get_content().lower().split() if w.isalpha()})
        vocabulary = [w for w in vocabulary if terms(w)]
        for size in (int(s) for s in args.sizes.split(",")):
            grower = PostgresStore(server.url, table="scifact")
            phases = grow(grower, size, vocabulary, seed=size, vector_index=False)
            row: Dict[str, Any] = {"chunks": grower.chunk_count(), "grow_phases": phases, "budgets": {}}
            grower.close()
            reference: List[List[str]] = []
            for budget in budgets:
                server.halt()
                row["page_cache_dropped"] = drop_page_cache()
                server.launch()
                store = PostgresStore(server.url, table="scifact", fulltext_candidates=budget)
                cold, warm = run_pass(store, sample), run_pass(store, sample)
                store.close()
                reference = reference or warm["tops"]
                overlap = [len(set(a) & set(b)) / max(1, len(b)) for a, b in zip(warm["tops"], reference)]
                row["budgets"][budget] = {
                    "cold": {k: v for k, v in cold.items() if k != "tops"},
                    "warm": {k: v for k, v in warm.items() if k != "tops"},
                    f"top5_overlap_with_{budgets[0]}": round(float(np.mean(overlap)), 3),
                }
            print(json.dumps(row, indent=1), flush=True)
            results["rows"].append(row)
            (out / "bench_fulltext.json").write_text(json.dumps(results, indent=1))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
