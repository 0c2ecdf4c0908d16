"""The in-memory fallback's sentence-window search on SciFact: LlamaIndex's default vector store against one matrix.

The INCORRECT branch's fallback retrieval spends most of its time in a dense search
over the sentence windows (``fallback.SentenceWindowRetriever``, about 1.2 s at p50 on
SciFact in docs/evaluation.md). This measures that search alone, the query already
embedded, for the default in-memory ``VectorStoreIndex`` and for ``dense.MatrixRetriever``
(a contiguous float32 matrix, one matrix-vector product and a partial sort) over the
same sentence nodes and embeddings, and checks that both return the same windows.

Run (the sentence embeddings come from the corpus cache that ``llama-crag eval`` or
``bench_engine.py`` filled; a first run embeds them):

    OMP_NUM_THREADS=1 python benchmarks/bench_windows.py --dataset ../shared/datasets/scifact --queries 50
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
from llama_index.core import VectorStoreIndex
from llama_index.core.schema import QueryBundle

from llama_index_crag.datasets import load_documents
from llama_index_crag.evaluation.dataset import load_eval_questions
from llama_index_crag.local.embedding_cache import corpus_cache
from llama_index_crag.local.models import default_embed_model
from llama_index_crag.stores.chunking import chunk
from llama_index_crag.stores.memory import MatrixRetriever, sentence_windows

TOP_K = 10  # the fallback asks its sentence index for twice its top-5


def _p(values: Sequence[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 2)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="../shared/datasets/scifact", help="folder in the shared dataset format")
    parser.add_argument("--queries", type=int, default=50, help="claims searched")
    parser.add_argument("--cache-dir", default=".crag-cache", help="where corpus embeddings are cached")
    parser.add_argument("--out", default="eval-out/bench_windows.json", help="where to write the figures")
    args = parser.parse_args(argv)

    embed = corpus_cache(default_embed_model(), Path(args.dataset) / "corpus.jsonl", Path(args.cache_dir), True)
    sentences = sentence_windows(chunk(load_documents(args.dataset)))
    questions = [q.question.question for q in load_eval_questions(args.dataset)]
    sample = random.Random(0).sample(questions, min(args.queries, len(questions)))
    bundles = [QueryBundle(q, embedding=embed.get_query_embedding(q)) for q in sample]

    built: Dict[str, Any] = {}
    started = time.perf_counter()
    built["VectorStoreIndex (SimpleVectorStore)"] = VectorStoreIndex(sentences, embed_model=embed).as_retriever(
        similarity_top_k=TOP_K
    )
    build_s = {"VectorStoreIndex (SimpleVectorStore)": time.perf_counter() - started}
    started = time.perf_counter()
    built["MatrixRetriever (numpy)"] = MatrixRetriever(sentences, embed, TOP_K)
    build_s["MatrixRetriever (numpy)"] = time.perf_counter() - started

    results: Dict[str, Any] = {"sentences": len(sentences), "queries": len(bundles), "top_k": TOP_K, "search": {}}
    found: Dict[str, List[List[str]]] = {}
    for name, retriever in built.items():
        retriever.retrieve(bundles[0])
        times, ids = [], []
        for bundle in bundles:
            start = time.perf_counter()
            hits = retriever.retrieve(bundle)
            times.append((time.perf_counter() - start) * 1000.0)
            ids.append([h.node.node_id for h in hits])
        found[name] = ids
        results["search"][name] = {"p50_ms": _p(times, 50), "p95_ms": _p(times, 95), "build_s": round(build_s[name], 2)}
    a, b = found.values()
    results["same_top_k"] = round(float(np.mean([set(x) == set(y) for x, y in zip(a, b)])), 4)
    results["command"] = "OMP_NUM_THREADS=1 python benchmarks/bench_windows.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
