"""Grading cost with and without reusing the index's embeddings, on the correct path.

A dense retriever has already embedded the question and holds every candidate's
embedding; the engine hands them to a bi-encoder-based scorer (the evidence scorer's
cosine feature) instead of embedding again. This runs the same SQuAD 2.0 questions
through the engine with the reuse switched off and on, twice in alternation, with a
fixed fake LLM and no rewrite, and prints the grading time and the end-to-end time
of the queries graded CORRECT.

    OMP_NUM_THREADS=1 python benchmarks/bench_reuse.py [DATASET] [QUESTIONS]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

from llama_index.core import VectorStoreIndex

import llama_index_crag.core.engine as engine_module
from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.datasets import load_documents, load_questions
from llama_index_crag.local.embedding_cache import corpus_cache
from llama_index_crag.local.models import default_embed_model

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import FixedLLM  # noqa: E402


def main(argv: List[str]) -> int:
    dataset = Path(argv[0] if argv else "../shared/datasets/squad2")
    count = int(argv[1]) if len(argv) > 1 else 80
    embed = corpus_cache(default_embed_model(), dataset / "corpus.jsonl")
    index = VectorStoreIndex(load_documents(dataset), embed_model=embed)
    questions = [q.question for q in load_questions(dataset)][:count]
    reuse = engine_module.reuse_retrieval_embeddings

    def no_reuse(*args: Any) -> int:
        return 0

    runs: List[tuple[str, Callable[..., int]]] = [
        ("embed again", no_reuse),
        ("reuse", reuse),
        ("embed again (2)", no_reuse),
        ("reuse (2)", reuse),
    ]
    print(f"{dataset.name}: first {len(questions)} questions, correct path, p50 in ms")
    for name, hook in runs:
        engine_module.reuse_retrieval_embeddings = hook  # type: ignore[assignment]
        engine = CorrectiveQueryEngine.from_defaults(
            index=index, llm=FixedLLM(), embed_model=embed, fallback_sources=("bm25",), max_rewrites=0
        )
        times: Dict[str, List[float]] = {"grade": [], "total": []}
        for question in questions:
            start = time.perf_counter()
            trace = engine.query(question).metadata["crag"]
            if trace["action"] == "correct":
                times["grade"].append(trace["timings_ms"]["grade"])
                times["total"].append((time.perf_counter() - start) * 1000)
        print(
            f"{name:>16}: {len(times['grade'])} queries, grade {statistics.median(times['grade']):.1f}, "
            f"end to end {statistics.median(times['total']):.1f}",
            flush=True,
        )
    engine_module.reuse_retrieval_embeddings = reuse
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
