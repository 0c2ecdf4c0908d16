"""``llama-crag demo`` and ``llama-crag doctor``: the engine on the sample corpus, and what it will use here."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any, List, Sequence

from tqdm import tqdm

from llama_index_crag.arguments import http_url, positive_int
from llama_index_crag.datasets import SAMPLE_DIR, Question, load_documents, load_questions
from llama_index_crag.errors import GeneratorUnavailable
from llama_index_crag.local.models import DEFAULT_OLLAMA_MODEL, DEFAULT_OLLAMA_URL


def add_parsers(commands: Any) -> None:
    """Add ``demo`` and ``doctor`` to ``llama-crag``'s subparsers."""
    demo = commands.add_parser("demo", help="answer the sample questions over the bundled sample corpus")
    demo.add_argument("--dataset", default=str(SAMPLE_DIR), help="folder with corpus.jsonl and questions.jsonl")
    demo.add_argument("--limit", type=positive_int, default=None, help="ask only the first N questions")
    demo.add_argument("--ollama-url", type=http_url, default=DEFAULT_OLLAMA_URL, help="Ollama server to try first")
    demo.add_argument("--ollama-model", default=DEFAULT_OLLAMA_MODEL, help="Ollama model to use when it answers")
    demo.add_argument(
        "--generate",
        action="store_true",
        help="generate the answers (Ollama if it answers, else the bundled SmolLM2 in llama.cpp) instead of quoting",
    )
    demo.add_argument("--gguf", default=None, help="a GGUF model file for llama.cpp instead of the bundled SmolLM2")
    demo.add_argument("--calibration", default=None, help="calibration JSON with the thresholds")
    demo.add_argument(
        "--disable-crag", action="store_true", help="plain retrieve-then-generate, for comparison (implies --generate)"
    )
    demo.add_argument("--json", action="store_true", help="print every trace as JSON")
    demo.add_argument(
        "--explain", action="store_true", help="show why the best candidate scored what it did (as CRAG_EXPLAIN=true)"
    )
    demo.add_argument("--progress", action="store_true", help="show a progress bar over the questions")
    demo.set_defaults(run=_demo)

    doctor = commands.add_parser(
        "doctor",
        help="check what the engine will use on this machine (torch, embeddings, Ollama, llama.cpp, spaCy)",
        description="Loads and runs each part for real, times it, and prints the fix for what fails. "
        "Exits 1 when a part the demo needs fails.",
    )
    doctor.add_argument("--ollama-url", type=http_url, default=DEFAULT_OLLAMA_URL, help="Ollama server to try")
    doctor.add_argument("--ollama-model", default=DEFAULT_OLLAMA_MODEL, help="Ollama model to look for")
    doctor.add_argument("--gguf", default=None, help="check this GGUF instead of the bundled SmolLM2")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.set_defaults(run=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from llama_index_crag.cli.doctor import report, run_checks

    checks = run_checks(args.ollama_url, args.ollama_model, args.gguf)
    print(report(checks, as_json=args.json))
    return 0 if all(c.ok for c in checks) else 1


def _demo(args: argparse.Namespace) -> int:
    from llama_index.core import VectorStoreIndex

    from llama_index_crag.core.engine import CorrectiveQueryEngine
    from llama_index_crag.local.models import default_embed_model, default_llm, ollama_has_model

    folder = Path(args.dataset)
    documents = load_documents(folder)
    questions: List[Question] = load_questions(folder)[: args.limit]
    say = functools.partial(print, file=sys.stderr if args.json else sys.stdout)
    say(f"Corpus: {len(documents)} documents from {folder}; {len(questions)} questions.")
    generate = args.generate or args.disable_crag
    llm = None
    if generate or ollama_has_model(args.ollama_url, args.ollama_model):
        try:
            llm, described = default_llm(args.ollama_url, args.ollama_model, gguf=args.gguf)
            say(f"Generator: {described}.")
        except (GeneratorUnavailable, ImportError, FileNotFoundError) as exc:
            say(f"Generator: none. {exc}")
    else:
        say("Generator: none needed: answers quote the documents (--generate: the bundled SmolLM2 answers instead).")
    say("Embeddings: bundled all-MiniLM-L6-v2 (offline). Fallback: BM25 + sentence windows.")
    index = VectorStoreIndex.from_documents(documents, embed_model=default_embed_model(), show_progress=True)
    engine = CorrectiveQueryEngine.from_defaults(
        index=index,
        llm=llm,
        enabled=False if args.disable_crag else None,
        explain=True if args.explain else None,
        calibration_path=args.calibration,
        answer_mode="generate" if generate and llm is not None else None,
    )
    s = engine.settings
    say(f"CRAG {'on' if s.enabled else 'off'}: scorer {engine.grader.scorer.name}, upper={s.upper}, lower={s.lower}")
    if engine.answer_mode == "extract":
        say("Answers: quoted from the graded passages, with their sources; nothing is generated.\n")
    else:
        say(f"Answers: generated, each checked against its passages (an unsupported one: {s.on_ungrounded}).\n")
    rows = []
    for q in tqdm(questions, desc="questions", disable=not args.progress):
        response = engine.query(q.question)
        crag = (response.metadata or {})["crag"]
        sources = [n.node.metadata.get("doc_id", n.node.node_id) for n in response.source_nodes]
        answer = str(response).strip()
        rows.append({"qid": q.qid, "question": q.question, "answer": answer, "sources": sources, **crag})
        if not args.json:
            _print_row(q, answer, crag, sources)
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
    explained = [n for n in crag["nodes"] if n.get("explanation") and "contributions" in n["explanation"]]
    if explained:
        best = max(explained, key=lambda n: n["score"])
        why = best["explanation"]
        parts = sorted(why["contributions"].items(), key=lambda kv: -abs(kv[1]))[:3]
        print(
            f"  best candidate {best['doc_id'] or best['node_id']} ({best['score']}): "
            + ", ".join(f"{name} {value:+.2f}" for name, value in parts)
            + f"; lacks: {', '.join(why['missing_terms'][:5]) or 'nothing'}"
            + (f"; turned round: {why['turned_round']}" if why.get("turned_round") else "")
        )
    if crag.get("rewritten_query"):
        print(
            f"  rewritten query ({crag['rewrite_source']}): {crag['rewritten_query']}  "
            f"fallback: {', '.join(crag['fallback_sources']) or '-'}"
        )
    check = crag.get("answer_check") or {}
    if check and crag["answered_by"] != "generate":
        print(f"  the generated answer's check: {_described_check(check)}")
    if crag["abstained"]:
        print(f"  why: {crag['abstain_reason']}")
    if crag["answered_by"] == "extract":
        print("  answer (quoted):")
        _print_quotes(crag["quotes"])
    elif crag["answered_by"] == "generate":
        label = "generated" if not check else f"generated, {_described_check(check)}"
        print(f"  answer ({label}): {' '.join(answer.split())[:300]}")
        if check and check.get("grounded") is not True:
            _print_evidence(crag)
    else:
        print(f"  answer: {' '.join(answer.split())[:300]}")
    print(f"  sources: {', '.join(sources) or '-'}   crag_ms: {crag['timings_ms']['crag_ms']:.0f}\n")


def _print_quotes(quotes: Sequence[dict]) -> None:
    from llama_index_crag.answers.extract import Quote

    for quote in quotes:
        print(f'    "{" ".join(quote["text"].split())[:300]}" ({Quote(**quote).cited})')


def _print_evidence(crag: dict) -> None:
    """What the sources say beside a generated answer that is not supported: the quotes, or, where the answer
    model withheld the best strip, that strip said to be weak evidence."""
    quote_check = crag.get("quote_check") or {}
    if crag.get("quotes"):
        print("  the sources say:")
        _print_quotes(crag["quotes"])
    elif quote_check.get("passed") is False and quote_check.get("withheld"):
        unnamed = quote_check.get("unnamed") or []
        why = (
            f"they do not name {', '.join(unnamed)}, which the question asks about"
            if unnamed
            else f"the answer model gives this strip {quote_check['grade']:.3f}, under the quote threshold "
            f"{quote_check['threshold']:.3f}"
        )
        print(f"  the sources say, weakly ({why}):")
        _print_quotes(quote_check["withheld"])


def _described_check(check: dict) -> str:
    """One line on an answer's check: supported, or what was not, or why it could not be checked."""
    if check.get("grounded"):
        return "supported by its sources"
    if check.get("grounded") is None:
        return f"NOT CHECKED ({check.get('reason')})"
    unsupported = ", ".join(check.get("unsupported", [])[:6])
    return f"NOT SUPPORTED by its sources ({unsupported or check.get('reason')})"


def _print_summary(rows: List[dict]) -> None:
    actions = {a: sum(1 for r in rows if r["action"] == a) for a in ("correct", "ambiguous", "incorrect", "disabled")}
    abstained = sum(1 for r in rows if r["abstained"])
    shares = ", ".join(f"{a} {n}" for a, n in actions.items() if n)
    quoted = sum(1 for r in rows if r["answered_by"] == "extract")
    generated = [r for r in rows if r["answered_by"] == "generate"]
    flagged = sum(1 for r in generated if r.get("grounded") is not True and r.get("answer_check"))
    print(
        f"Summary: {len(rows)} questions; actions: {shares}; abstained on {abstained}; "
        f"answered by quoting {quoted}, by generating {len(generated)} ({flagged} flagged as not supported)."
    )
