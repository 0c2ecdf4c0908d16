"""``llama-crag ask``: questions answered on the command line over an index folder or a PostgreSQL store.

The engine is the one ``llama-crag serve`` builds over the same store (``load_engine`` or ``engine_from_store``,
with the calibration and grader the index was ingested with); only the generator differs by default: ``auto``
generates with a local Ollama model when one answers and otherwise quotes the graded passages, without
loading a model in process for a few questions.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from llama_index_crag.arguments import add_store_options, http_url, require_one_store
from llama_index_crag.errors import ConfigError, CragError
from llama_index_crag.local.models import DEFAULT_OLLAMA_MODEL, DEFAULT_OLLAMA_URL


def add_parsers(commands: Any) -> None:
    """Add ``ask`` to ``llama-crag``'s subparsers."""
    ask = commands.add_parser(
        "ask",
        help="answer questions from an index folder (llama-crag ingest) or a PostgreSQL store, on the command line",
        description="Answers each QUESTION, or each line of standard input when none is given, with the engine "
        "llama-crag serve builds over the same index, and prints the answer, whether it abstained, the action and "
        "the sources (--json: one JSON object a line). Exits 1 when a question could not be answered at all.",
    )
    ask.add_argument("questions", nargs="*", metavar="QUESTION", help="questions (default: one a line on stdin)")
    add_store_options(ask, "a PostgreSQL store instead (ingest --store)")
    ask.add_argument(
        "--filters",
        type=_filters,
        default=None,
        metavar="JSON",
        help='metadata filters that bound what is read: {"tenant": "acme"} (a list value: one of), or '
        "LlamaIndex MetadataFilters JSON",
    )
    ask.add_argument(
        "--llm",
        choices=("auto", "ollama", "llamacpp", "none"),
        default="auto",
        help="auto: Ollama if it answers, else none; none: answers quote the graded passages; llamacpp: the "
        "bundled SmolLM2 (or --gguf) in this process",
    )
    ask.add_argument("--ollama-url", type=http_url, default=DEFAULT_OLLAMA_URL, help="Ollama server to use")
    ask.add_argument("--ollama-model", default=DEFAULT_OLLAMA_MODEL, help="Ollama model to use")
    ask.add_argument("--gguf", default=None, help="a GGUF file for --llm llamacpp instead of the bundled SmolLM2")
    ask.add_argument("--json", action="store_true", help="one JSON object a line: question, answer, abstained, ...")
    ask.set_defaults(run=_ask)


def _filters(text: str) -> Dict[str, Any]:
    """``--filters``: a JSON object that makes a valid scope (checked now, before any model loads)."""
    from llama_index_crag.scope import Scope

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, not {type(value).__name__}")
    try:
        Scope.of(value)
    except CragError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return value


def _ask(args: argparse.Namespace) -> int:
    require_one_store(args, "ask")
    if args.llm != "llamacpp" and args.gguf:
        raise ConfigError("--gguf is for --llm llamacpp")
    engine = _engine(args)
    failed = 0
    for question in _questions(args.questions):
        row = answer(engine, question)
        failed += "error" in row
        if args.json:
            print(json.dumps(row, ensure_ascii=False), flush=True)
        else:
            _print_row(row)
    return 1 if failed else 0


def _engine(args: argparse.Namespace) -> Any:
    """The engine ``serve`` builds over ``--index`` or ``--store``, scoped to ``--filters``, with the generator."""
    llm, described = _llm(args)
    print(f"Generator: {described}.", file=sys.stderr)
    if args.store:
        from llama_index_crag.core.persisted import engine_from_store
        from llama_index_crag.stores.postgres import PostgresStore

        return engine_from_store(PostgresStore(args.store, table=args.table), llm, filters=args.filters)
    from llama_index_crag.core.persisted import load_engine
    from llama_index_crag.stores.folder import load_index

    return load_engine(load_index(args.index), llm, filters=args.filters)


def _llm(args: argparse.Namespace) -> Tuple[Any, str]:
    """The generator ``--llm`` names, and a sentence saying which."""
    from llama_index_crag.local.models import ollama_has_model

    quoting = "none (answers quote the graded passages)"
    if args.llm == "none" or (args.llm == "auto" and not ollama_has_model(args.ollama_url, args.ollama_model)):
        return None, quoting if args.llm == "none" else f"no Ollama model {args.ollama_model} answers; {quoting}"
    if args.llm in ("auto", "ollama"):
        from llama_index.llms.ollama import Ollama

        llm = Ollama(model=args.ollama_model, base_url=args.ollama_url, request_timeout=120.0, context_window=8192)
        return llm, f"Ollama model {args.ollama_model} at {args.ollama_url}"
    from llama_index_crag.local.bundled import bundled_gguf_path
    from llama_index_crag.local.llamacpp import BundledLlamaCPP
    from llama_index_crag.local.portable import require_generation

    path = args.gguf or str(bundled_gguf_path())
    require_generation(path)
    return BundledLlamaCPP(model_path=path), f"llama.cpp in process with {path}"


def _questions(given: Sequence[str]) -> Iterator[str]:
    """The questions on the command line, else each non-blank line of standard input."""
    if given:
        yield from given
        return
    if sys.stdin.isatty():
        print("Questions, one a line (Ctrl-D ends):", file=sys.stderr)
    for line in sys.stdin:
        if line.strip():
            yield line.strip()


def answer(engine: Any, question: str) -> Dict[str, Any]:
    """One question's answer as ``ask --json`` prints it: ``question``, ``answer``, ``abstained``, ``action`` and
    ``sources`` (each document once, best score first seen: ``doc_id``, ``title``, ``score``); a question the
    engine refuses (too long, empty) or fails on has ``error`` instead."""
    try:
        response = engine.query(question)
    except CragError as exc:
        return {"question": question, "error": str(exc)}
    crag = (response.metadata or {}).get("crag", {})
    sources: List[Dict[str, Any]] = []
    seen: Dict[str, Dict[str, Any]] = {}
    for hit in response.source_nodes:
        doc_id = str(hit.node.metadata.get("doc_id") or hit.node.ref_doc_id or hit.node.node_id)
        score = None if hit.score is None else round(float(hit.score), 4)
        if doc_id in seen:
            if score is not None and (seen[doc_id]["score"] is None or score > seen[doc_id]["score"]):
                seen[doc_id]["score"] = score
            continue
        seen[doc_id] = {"doc_id": doc_id, "title": hit.node.metadata.get("title"), "score": score}
        sources.append(seen[doc_id])
    return {
        "question": question,
        "answer": "" if response.response is None else str(response.response),
        "abstained": bool(crag.get("abstained", False)),
        "action": crag.get("action"),
        "sources": sources,
    }


def _print_row(row: Dict[str, Any]) -> None:
    print(f"Q: {row['question']}")
    if "error" in row:
        print(f"  error: {row['error']}\n")
        return
    print(f"  action: {row['action']}  {'ABSTAINED' if row['abstained'] else 'answered'}")
    lines = row["answer"].strip().splitlines() or [""]
    print(f"  answer: {lines[0]}")
    for line in lines[1:]:
        print(f"    {line}")
    print(f"  sources: {', '.join(_described(s) for s in row['sources']) or '-'}\n", flush=True)


def _described(source: Dict[str, Any]) -> str:
    title: Optional[str] = source.get("title")
    return f"{source['doc_id']} ({title})" if title and title != source["doc_id"] else str(source["doc_id"])
