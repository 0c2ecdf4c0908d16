"""The LLM's rewrite with and without its ``parts`` field: what it costs a model, and which parts are used.

The INCORRECT branch's rewrite asks the model for the questions a query asks (``core/rewrite.py``). A small
model fills that list with noise, and each token it writes costs time on a CPU. For each question of one half of
each set given (the check half by default) that the rules of ``text/compound.py`` leave whole, the generator
rewrites it twice, in turn: without parts (``QueryRewriter(llm, parts=False)``: the prompt and schema as they
were before parts, what ``split_compound=False`` asks) and as the engine does now (parts asked of a question that
could ask several things, ``may_ask_several``). Printed: each call's time
(median and p95) on both sides, how often each side's rewrite is usable (``RewriteError`` otherwise: unchanged,
empty, none of the query's words), how often the model wrote parts, and how often they passed ``checked_parts``
(each one used is printed, to be read).

    OMP_NUM_THREADS=2 python benchmarks/rewrite_parts.py --dataset ../shared/datasets/pgdocs \
        --dataset ../shared/datasets/squad2 --limit 40

The generator is the bundled SmolLM2 in llama.cpp, or ``--ollama-model NAME`` on ``--ollama-url``.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llama_index_crag.core.rewrite import QueryRewriter, Rewrite  # noqa: E402
from llama_index_crag.datasets import load_questions  # noqa: E402
from llama_index_crag.errors import RewriteError  # noqa: E402
from llama_index_crag.evaluation.raw_docs import load_doc_questions, split_set  # noqa: E402
from llama_index_crag.text.compound import may_ask_several, split_question  # noqa: E402


def questions(folder: Path, half: str) -> List[str]:
    """The questions of ``half`` of the set in ``folder`` (a raw-documents set such as pgdocs, or a shared set)."""
    if (folder / "docs").is_dir():
        kept, _ = split_set(load_doc_questions(folder / "questions.jsonl"), [], half)
        return [q.question for q in kept]
    return [q.question for q in load_questions(folder, half)]


def percentile(values: List[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", action="append", required=True, help="a set's folder (repeat for several)")
    parser.add_argument("--half", default="check", help="the half asked (default: check)")
    parser.add_argument("--limit", type=int, default=40, help="questions per set (the first, in the set's order)")
    parser.add_argument("--ollama-model", default=None, help="rewrite with this Ollama model instead")
    parser.add_argument("--ollama-url", default="http://127.0.0.1:11434")
    args = parser.parse_args(argv)

    if args.ollama_model:
        from llama_index.llms.ollama import Ollama

        llm: Any = Ollama(model=args.ollama_model, base_url=args.ollama_url, context_window=4096, json_mode=True)
    else:
        from llama_index_crag.local.llamacpp import BundledLlamaCPP

        llm = BundledLlamaCPP()
    now, before = QueryRewriter(llm), QueryRewriter(llm, parts=False)
    counts: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    times: Dict[str, List[float]] = {"before": [], "now": []}
    for folder in map(Path, args.dataset):
        name = folder.name
        for question in questions(folder, args.half)[: args.limit]:
            if split_question(question).compound:
                counts[name]["split by the rules (not rewritten)"] += 1
                continue
            counts[name]["now: parts asked (may ask several)"] += may_ask_several(question)
            for side, rewriter in (("before", before), ("now", now)):
                start = time.perf_counter()
                try:
                    rewrite: Optional[Rewrite] = rewriter.rewrite_parts(question)
                except RewriteError:
                    rewrite = None
                times[side].append(time.perf_counter() - start)
                counts[name][f"{side}: rewrite usable"] += rewrite is not None
                if side == "now" and rewrite is not None:
                    counts[name]["now: parts written"] += bool(rewrite.written)
                    counts[name]["now: parts used"] += bool(rewrite.parts)
                    if rewrite.parts:
                        print(f"used: {question!r} -> {list(rewrite.parts)}", flush=True)
            counts[name]["rewritten"] += 1
    print(f"\nhalf: {args.half}; generator: {args.ollama_model or 'bundled SmolLM2 (llama.cpp)'}")
    for name, count in counts.items():
        print(f"{name}: " + ", ".join(f"{key} {value}" for key, value in sorted(count.items())))
    for side, values in times.items():
        if values:
            print(
                f"{side}: {len(values)} calls, median {statistics.median(values):.2f} s, "
                f"p95 {percentile(values, 0.95):.2f} s"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
