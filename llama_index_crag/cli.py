"""The ``llama-crag`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from tqdm import tqdm

from llama_index_crag.datasets import SAMPLE_DIR, Question, load_documents, load_questions
from llama_index_crag.evaluation import add_eval_parser
from llama_index_crag.models import DEFAULT_OLLAMA_MODEL, DEFAULT_OLLAMA_URL


def _demo(args: argparse.Namespace) -> int:
    from llama_index.core import VectorStoreIndex

    from llama_index_crag.engine import CorrectiveQueryEngine
    from llama_index_crag.models import default_embed_model, default_llm

    folder = Path(args.dataset)
    documents = load_documents(folder)
    questions: List[Question] = load_questions(folder)[: args.limit]
    print(f"Corpus: {len(documents)} documents from {folder}; {len(questions)} questions.")
    llm, described = default_llm(args.ollama_url, args.ollama_model)
    print(f"Generator: {described}.")
    print("Embeddings: bundled all-MiniLM-L6-v2 (offline). Fallback: BM25 + sentence windows.")
    index = VectorStoreIndex.from_documents(documents, embed_model=default_embed_model(), show_progress=True)
    engine = CorrectiveQueryEngine.from_defaults(
        index=index, llm=llm, enabled=False if args.disable_crag else None, calibration_path=args.calibration
    )
    s = engine.settings
    print(
        f"CRAG {'on' if s.enabled else 'off'}: scorer {engine.grader.scorer.name}, upper={s.upper}, lower={s.lower}\n"
    )
    rows = []
    for q in tqdm(questions, desc="questions", disable=not args.progress):
        response = engine.query(q.question)
        crag = (response.metadata or {})["crag"]
        sources = [n.node.metadata.get("doc_id", n.node.node_id) for n in response.source_nodes]
        rows.append({"qid": q.qid, "question": q.question, "answer": str(response).strip(), "sources": sources, **crag})
        if not args.json:
            _print_row(q, str(response).strip(), crag, sources)
    if args.json:
        json.dump(rows, sys.stdout, indent=2, default=str)
        print()
    else:
        _print_summary(rows)
    return 0


def _print_row(q: Question, answer: str, crag: dict, sources: Sequence[str]) -> None:
    expected = "answerable" if q.answerable else "not answerable from the corpus"
    print(f"Q {q.qid}: {q.question}  [{expected}]")
    verdict = "ABSTAINED" if crag["abstained"] else "answered"
    top = crag["top_score"]
    print(f"  action: {crag['action']}  top score: {top if top is not None else '-'}  {verdict}")
    if crag.get("rewritten_query"):
        print(f"  rewritten query: {crag['rewritten_query']}  fallback: {', '.join(crag['fallback_sources']) or '-'}")
    if crag["abstained"]:
        print(f"  why: {crag['abstain_reason']}")
    print(f"  answer: {' '.join(answer.split())[:300]}")
    print(f"  sources: {', '.join(sources) or '-'}   crag_ms: {crag['timings_ms']['crag_ms']:.0f}\n")


def _print_summary(rows: List[dict]) -> None:
    actions = {a: sum(1 for r in rows if r["action"] == a) for a in ("correct", "ambiguous", "incorrect", "disabled")}
    abstained = sum(1 for r in rows if r["abstained"])
    shares = ", ".join(f"{a} {n}" for a, n in actions.items() if n)
    print(f"Summary: {len(rows)} questions; actions: {shares}; abstained on {abstained}.")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``llama-crag``."""
    parser = argparse.ArgumentParser(prog="llama-crag", description="Corrective RAG for LlamaIndex.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="answer the sample questions over the bundled sample corpus")
    demo.add_argument("--dataset", default=str(SAMPLE_DIR), help="folder with corpus.jsonl and questions.jsonl")
    demo.add_argument("--limit", type=int, default=None, help="ask only the first N questions")
    demo.add_argument("--ollama-url", default=DEFAULT_OLLAMA_URL, help="Ollama server to try first")
    demo.add_argument("--ollama-model", default=DEFAULT_OLLAMA_MODEL, help="Ollama model to use when it answers")
    demo.add_argument("--calibration", default=None, help="calibration JSON with the thresholds")
    demo.add_argument("--disable-crag", action="store_true", help="plain retrieve-then-generate, for comparison")
    demo.add_argument("--json", action="store_true", help="print every trace as JSON")
    demo.add_argument("--progress", action="store_true", help="show a progress bar over the questions")
    demo.set_defaults(run=_demo)
    add_eval_parser(commands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``llama-crag``."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"llama-crag: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
