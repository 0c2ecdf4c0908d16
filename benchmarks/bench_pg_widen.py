"""What a sentence the PostgreSQL fallback finds costs to regrade: widened to its window (a text nobody embedded)
or to the chunk that holds it (read back with the vector the store holds), on the INCORRECT branch.

Starts a throwaway PostgreSQL (as ``bench_postgres.py`` does), ingests the first ``--documents`` SciFact abstracts
(passage vectors from the corpus cache, so ingest is quick), then asks ``--queries`` claims of engines over the
store with ``fallback_widen="window"`` and ``"chunk"``, in turn, twice each. The engines embed with the bundled
model uncached, as an application does, so a window is embedded each time it is graded. Prints p50 / p95 ms per
stage over the claims that took the INCORRECT branch.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_pg_widen.py --documents 1500 --queries 80
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_engine import FixedLLM  # noqa: E402
from benchmarks.bench_postgres import bench_server  # noqa: E402
from llama_index_crag.core.persisted import engine_from_store  # noqa: E402
from llama_index_crag.datasets import load_documents  # noqa: E402
from llama_index_crag.evaluation.dataset import load_eval_questions  # noqa: E402
from llama_index_crag.local.embedding_cache import corpus_cache  # noqa: E402
from llama_index_crag.local.models import default_embed_model  # noqa: E402
from llama_index_crag.stores.postgres import PostgresStore, ingest  # noqa: E402

STAGES = ("retrieve", "grade", "fallback", "regrade", "crag_ms")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="../shared/datasets/scifact", help="folder in the shared dataset format")
    parser.add_argument("--documents", type=int, default=1500, help="abstracts ingested")
    parser.add_argument("--queries", type=int, default=80, help="claims sampled")
    parser.add_argument("--cache-dir", default=".crag-cache", help="where corpus embeddings are cached")
    args = parser.parse_args(argv)
    server = bench_server()
    try:
        cached = corpus_cache(default_embed_model(), Path(args.dataset) / "corpus.jsonl", Path(args.cache_dir), True)
        store = PostgresStore(server.url, table="scifact")
        ingest(load_documents(args.dataset)[: args.documents], store, cached)
        claims = [q.question.question for q in load_eval_questions(args.dataset)]
        sample = random.Random(0).sample(claims, min(args.queries, len(claims)))
        embed = default_embed_model()  # what an application embeds queries and ungraded texts with: no cache
        print("| fallback_widen | pass | INCORRECT claims | " + " | ".join(f"{s} p50 / p95 ms" for s in STAGES) + " |")
        print("|---|---:|---:|" + "---:|" * len(STAGES))
        for turn, widen in enumerate(("window", "chunk", "window", "chunk")):
            engine = engine_from_store(store, FixedLLM(), embed_model=embed, fallback_widen=widen)
            stages: Dict[str, List[float]] = {}
            for claim in sample:
                start = time.perf_counter()
                trace = engine.query(claim).metadata["crag"]  # type: ignore[index]
                if trace["action"] != "incorrect":
                    continue
                timings = {**trace["timings_ms"], "total": (time.perf_counter() - start) * 1000.0}
                for stage in STAGES:
                    stages.setdefault(stage, []).append(float(timings.get(stage, 0.0)))
            cells = [
                f"{np.percentile(stages[s], 50):.1f} / {np.percentile(stages[s], 95):.1f}" if s in stages else "-"
                for s in STAGES
            ]
            count = len(stages.get("retrieve", []))
            print(f"| {widen} | {turn // 2 + 1} | {count} | " + " | ".join(cells) + " |", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
