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
    """Add the ``eval`` command, and its sibling over raw documents ``eval-docs``, to ``llama-crag``'s subparsers."""
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
        default=None,
        help=f"comma-separated, from {', '.join(SYSTEM_NAMES)} (default: all; with --no-generate and no generator "
        "installed, all but llm-judge, which judges with the generator)",
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
        help="skip answer generation (fixed text): every figure but answer accuracy, fast over whole datasets; "
        "runs without the bundled generator installed (CRAG then rewrites with the question's keywords)",
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
    add_eval_docs_parser(commands)
    return parser


def add_eval_docs_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``eval-docs``: the default engine over a folder of raw documents, ingested as ``llama-crag ingest``
    ingests them (``evaluation/raw_docs.py``)."""
    parser = commands.add_parser(
        "eval-docs",
        help="ingest a folder of raw documents as llama-crag ingest does and score the default engine's answers",
        description="Ingests DOCS (into --index, or a folder under --out, reused when it exists), asks every "
        "question of the default engine with answers quoted (no generator), and scores each answer right, wrong or "
        "abstained: right holds one of its answers (a compound question: every one), case-insensitive; an "
        "unanswerable question is right only when abstained on. Prints per-kind figures and truthfulness (right - "
        "wrong) with 95%% intervals for CRAG and for plain retrieval with its top passage quoted, the share of "
        "answerable questions whose answer is in plain retrieval's top k, the ingest's time, the passages it "
        "embedded and the peak memory; writes results.json and report.md.",
    )
    parser.add_argument("--dataset", default=None, help="a set laid out as pgdocs: DIR/docs/ and DIR/questions.jsonl")
    parser.add_argument("--docs", default=None, help="the folder of documents (instead of --dataset)")
    parser.add_argument(
        "--questions", default=None, help="questions.jsonl with qid, question, answerable, answers, source, kind"
    )
    parser.add_argument(
        "--split",
        choices=SPLITS,
        default="all",
        help="design or check: one half, cut by source page (pages a question names together fall together; a "
        "question with no source by its qid), only its documents ingested; all: the whole set",
    )
    parser.add_argument(
        "--index",
        default=None,
        help="the index folder to ingest into and ask (default: under --out, named for the split and the chunker)",
    )
    parser.add_argument("--limit", type=positive_int, default=None, help="ask only the first N questions")
    parser.add_argument("--top-k", type=positive_int, default=5, help="passages plain retrieval returns")
    parser.add_argument(
        "--out", default=None, help="output folder (default: eval-out/<set name>-docs, with -<split> for a half)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(run=_eval_docs)
    return parser


def _eval_docs(args: argparse.Namespace) -> int:
    from llama_index_crag.errors import ConfigError
    from llama_index_crag.evaluation.raw_docs import DocEvalConfig, describe_results, run_doc_evaluation

    if (args.dataset is None) == (args.docs is None):
        raise ConfigError("name the set with --dataset DIR (DIR/docs, DIR/questions.jsonl), or with --docs DIR")
    dataset = Path(args.dataset) if args.dataset else None
    docs = dataset / "docs" if dataset else Path(args.docs)
    questions = Path(args.questions) if args.questions else (dataset or docs.parent) / "questions.jsonl"
    name = (dataset or docs.parent).resolve().name
    config = DocEvalConfig(
        docs=docs,
        questions=questions,
        out=Path(args.out or Path("eval-out") / (f"{name}-docs" + ("" if args.split == "all" else f"-{args.split}"))),
        split=args.split,
        index=Path(args.index) if args.index else None,
        limit=args.limit,
        top_k=args.top_k,
        progress=not args.no_progress,
        dataset=dataset,
    )
    results = run_doc_evaluation(config)
    print(describe_results(results))
    print(f"Report: {config.out / 'report.md'}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from llama_index_crag.errors import ConfigError, GeneratorUnavailable, MissingDependency
    from llama_index_crag.evaluation.harness import NEEDS_A_GENERATOR, NO_GENERATOR, EvalConfig, run_evaluation
    from llama_index_crag.local.models import default_llm

    dataset = Path(args.dataset)
    if not (dataset / "corpus.jsonl").exists() and (dataset / "docs").is_dir():
        raise ConfigError(f"{dataset} holds raw documents (docs/), not passages: run llama-crag eval-docs on it")
    systems = list(SYSTEM_NAMES) if args.systems is None else [s.strip() for s in args.systems.split(",") if s.strip()]
    try:
        llm, described = default_llm(args.ollama_url, args.ollama_model)
    except (MissingDependency, GeneratorUnavailable) as exc:
        # Nothing is generated with --no-generate: the offline keyword rewrite serves CRAG in the generator's place.
        if not args.no_generate:
            raise
        llm, described = None, f"{NO_GENERATOR} ({exc})"
        if args.systems is None:
            systems = [s for s in systems if s not in NEEDS_A_GENERATOR]
            described += f"; {', '.join(NEEDS_A_GENERATOR)} left out, as it judges with the generator"
    config = EvalConfig(
        dataset=dataset,
        out=Path(args.out or Path("eval-out") / (dataset.name + ("" if args.split == "all" else f"-{args.split}"))),
        split=args.split,
        systems=systems,
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
    print(f"Generator: {described}.")
    results = run_evaluation(config, llm)
    print(f"Report: {config.out / 'report.md'}")
    for target in results["targets"]:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[target["met"]]
        print(f"  {verdict:>6}  {target['name']}: {target['measured']} (seed {target['seed']})")
    return 0
