"""``llama-crag eval``: the evaluation harness on the command line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from llama_index_crag.answers.policy import ANSWER_MODES, ON_UNGROUNDED
from llama_index_crag.arguments import http_url, positive_int
from llama_index_crag.datasets import SPLITS
from llama_index_crag.evaluation import SYSTEM_NAMES
from llama_index_crag.local.models import DEFAULT_OLLAMA_MODEL, DEFAULT_OLLAMA_URL
from llama_index_crag.scorers.registry import SPECS, check_spec


def add_eval_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` command to ``llama-crag``'s subparsers."""
    parser = commands.add_parser(
        "eval",
        help="evaluate CRAG against plain RAG, rerank-only and an LLM-judge CRAG on a dataset",
        description="Runs each system over the same questions and index, in corpus and out of corpus, and writes "
        "report.md, results.json (every figure and per-question row) and PNG plots. Rows are saved as they finish: "
        "run the same command again to resume.",
    )
    parser.add_argument("--dataset", required=True, help="folder with corpus.jsonl and questions.jsonl")
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEM_NAMES),
        help=f"comma-separated, from {', '.join(SYSTEM_NAMES)}",
    )
    parser.add_argument("--limit", type=positive_int, default=None, help="ask only the first N questions")
    parser.add_argument(
        "--split",
        choices=SPLITS,
        default="all",
        help="design or check: one half of the set, its documents and their questions, cut by document (choose on "
        "design, report check); all: the whole set",
    )
    parser.add_argument(
        "--out", default=None, help="output folder (default: eval-out/<dataset name>, with -<split> for a half)"
    )
    parser.add_argument(
        "--no-generate",
        action="store_true",
        help="skip answer generation (fixed text): every figure but answer accuracy, fast over whole datasets",
    )
    parser.add_argument(
        "--scorer",
        default="evidence",
        type=check_spec,
        help=f"CRAG's relevance scorer, one of {', '.join(SPECS)} (default: evidence)",
    )
    parser.add_argument("--calibration", default=None, help="calibration JSON with CRAG's thresholds")
    parser.add_argument(
        "--answer-mode",
        choices=ANSWER_MODES,
        default=None,
        help="CRAG's answer: the quoted evidence, or the generator's answer (default: the engine's choice for the "
        "generator: extract with the bundled model, generate with Ollama)",
    )
    parser.add_argument(
        "--on-ungrounded",
        choices=ON_UNGROUNDED,
        default=None,
        help="what a generated answer that fails its check becomes (default: the engine's, extract)",
    )
    parser.add_argument(
        "--no-check", action="store_true", help="leave CRAG's generated answers unchecked (the behaviour before)"
    )
    parser.add_argument(
        "--time-limits",
        action="store_true",
        help="keep CRAG's time limits on the correction path (default: lifted, unless CRAG_CORRECTION_TIMEOUT_S or "
        "CRAG_REWRITE_TIMEOUT_S sets one, so that a busy machine, where a rewrite runs past its limit and the "
        "question's keywords are searched instead, does not change the figures)",
    )
    parser.add_argument("--top-k", type=positive_int, default=5, help="chunks retrieved (plain, CRAG, LLM-judge)")
    parser.add_argument("--rerank-top-k", type=positive_int, default=10, help="chunks retrieved before reranking")
    parser.add_argument("--rerank-top-n", type=positive_int, default=3, help="chunks kept after reranking")
    parser.add_argument("--cache-dir", default=".crag-cache", help="where corpus embeddings are cached")
    parser.add_argument("--fresh", action="store_true", help="ignore the rows of an earlier run in --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--ollama-url", type=http_url, default=DEFAULT_OLLAMA_URL, help="Ollama server to try first")
    parser.add_argument("--ollama-model", default=DEFAULT_OLLAMA_MODEL, help="Ollama model to use when it answers")
    parser.set_defaults(run=_eval)
    return parser


def _eval(args: argparse.Namespace) -> int:
    from llama_index_crag.evaluation.harness import EvalConfig, run_evaluation
    from llama_index_crag.local.models import default_llm

    dataset = Path(args.dataset)
    config = EvalConfig(
        dataset=dataset,
        out=Path(args.out or Path("eval-out") / (dataset.name + ("" if args.split == "all" else f"-{args.split}"))),
        split=args.split,
        systems=[s.strip() for s in args.systems.split(",") if s.strip()],
        limit=args.limit,
        generate=not args.no_generate,
        scorer=args.scorer,
        calibration=Path(args.calibration) if args.calibration else None,
        answer_mode=args.answer_mode,
        on_ungrounded=args.on_ungrounded,
        check_answers=not args.no_check,
        time_limits=args.time_limits,
        top_k=args.top_k,
        rerank_top_k=args.rerank_top_k,
        rerank_top_n=args.rerank_top_n,
        cache_dir=Path(args.cache_dir),
        fresh=args.fresh,
        progress=not args.no_progress,
    )
    llm, described = default_llm(args.ollama_url, args.ollama_model)
    print(f"Generator: {described}.")
    results = run_evaluation(config, llm)
    print(f"Report: {config.out / 'report.md'}")
    for target in results["targets"]:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[target["met"]]
        print(f"  {verdict:>6}  {target['name']}: {target['measured']} (seed {target['seed']})")
    return 0
