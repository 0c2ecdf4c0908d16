"""``llama-crag ingest`` and ``llama-crag serve``: a persisted index (folder or PostgreSQL), and the server over it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from llama_index_crag.arguments import (
    LOG_LEVELS,
    RenamedOption,
    add_store_options,
    http_url,
    port,
    positive_int,
    require_one_store,
    seconds,
)
from llama_index_crag.errors import ConfigError
from llama_index_crag.local.models import DEFAULT_OLLAMA_MODEL, DEFAULT_OLLAMA_URL
from llama_index_crag.stores.metadata import metadata_pair


def add_parsers(commands: Any) -> None:
    """Add ``ingest`` and ``serve`` to ``llama-crag``'s subparsers."""
    ingest = commands.add_parser(
        "ingest",
        help="build or update a persisted index folder from a folder of documents (for llama-crag serve)",
        description="Reads DOCS_DIR (a corpus.jsonl in the shared dataset format, or a folder of .txt, .md, .rst, "
        ".csv, .json, .html, .pdf, .docx and .pptx files: an HTML page's main content without its navigation, a "
        "PDF's text layer, the text of Word documents and slides), chunks and embeds it, and writes the vector "
        "index, the chunks for the BM25 and sentence-window fallback, their embeddings, the evidence scorer's "
        "corpus statistics, and the calibration and grader it is built with. Run it again on a changed folder: "
        "only added or changed documents are embedded, vanished ones are removed. Each document keeps its "
        "metadata for filters: YAML front matter of a Markdown file, a sidecar NAME.meta.json beside any file, and "
        "--metadata for all (which wins, then the sidecar). A file that cannot be read (encrypted, a scan with no "
        "text layer, damaged) is skipped with a line saying why; one ingested before keeps its last version.",
    )
    ingest.add_argument("docs", metavar="DOCS_DIR", help="folder of documents")
    ingest.add_argument("--out", metavar="INDEX_DIR", help="the index folder to write or update")
    ingest.add_argument(
        "--store", metavar="URL", help="write into PostgreSQL with pgvector instead (postgresql://user@host/db)"
    )
    ingest.add_argument("--table", default="crag", help="the store's name in PostgreSQL (with --store)")
    ingest.add_argument(
        "--index-precision",
        choices=("full", "half"),
        default=None,
        help="with --store, a new store's HNSW indexes over full vectors or halfvec casts (half the index memory)",
    )
    ingest.add_argument(
        "--embed-model",
        metavar="NAME_OR_PATH",
        default=None,
        help="embed with this sentence-transformers model (a folder, or a name in this machine's Hugging Face "
        "cache; default the bundled all-MiniLM-L6-v2); serve, ask and calibrate --index read it from the index",
    )
    ingest.add_argument("--calibration", default=None, help="a calibration file to serve with (llama-crag calibrate)")
    ingest.add_argument("--grader", default=None, help="a grader directory to serve with (llama-crag train-grader)")
    ingest.add_argument("--no-warm", dest="warm", action="store_false", help="do not embed the sentence windows now")
    ingest.add_argument(
        "--metadata",
        metavar="KEY=VALUE",
        type=metadata_pair,
        action="append",
        default=[],
        help="metadata of every document, over its own (repeatable; a key given twice holds a list): true/false "
        "a boolean, 12 or 0.5 a number, anything else text",
    )
    ingest.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bars on stderr while reading files and embedding (default: when stderr is a terminal)",
    )
    ingest.set_defaults(run=_ingest)

    serve = commands.add_parser(
        "serve",
        help="serve an index folder: query API, OpenAI-compatible chat API, metrics and the decision-trace console",
        description="Binds to 127.0.0.1 unless --host says otherwise. Set CRAG_API_KEY to require a key on every "
        "route but /healthz, or give --api-keys FILE for several keys, each with its caller's name and the metadata "
        "filters its queries are bounded to.",
    )
    add_store_options(serve, "serve a PostgreSQL store instead (ingest --store)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (the default answers this machine only)")
    serve.add_argument("--port", type=port, default=8000, help="port to bind")
    serve.add_argument("--workers", type=positive_int, default=1, help="worker processes over the same index folder")
    serve.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads of each worker's models (default: one worker uses every core, several share them out)",
    )
    serve.add_argument(
        "--llm",
        choices=("auto", "ollama", "llamacpp", "none"),
        default="auto",
        help="auto: Ollama if it answers, else the bundled GGUF in llama.cpp; none: retrieval and grading only",
    )
    serve.add_argument("--ollama-url", type=http_url, default=DEFAULT_OLLAMA_URL, help="Ollama server to use")
    serve.add_argument("--ollama-model", default=DEFAULT_OLLAMA_MODEL, help="Ollama model to use")
    serve.add_argument(
        "--model", dest="ollama_model", action=RenamedOption, renamed_to="--ollama-model", help=argparse.SUPPRESS
    )
    serve.add_argument("--gguf", default=None, help="a GGUF file for --llm llamacpp instead of the bundled SmolLM2")
    serve.add_argument("--disable-crag", action="store_true", help="plain retrieve-then-generate, for comparison")
    serve.add_argument("--cors-origin", action="append", default=[], help="allow this browser origin (repeatable)")
    serve.add_argument("--max-body-bytes", type=positive_int, default=64 * 1024, help="largest request body accepted")
    serve.add_argument(
        "--max-query-chars",
        type=positive_int,
        default=None,
        help="longest query accepted (default: the engine's max_query_chars, CRAG_MAX_QUERY_CHARS or 8000)",
    )
    serve.add_argument(
        "--query-timeout", type=seconds, default=120.0, help="seconds a query may take before it is cut off"
    )
    serve.add_argument(
        "--rate-window", type=seconds, default=300.0, help="seconds behind crag_fallback_rate and crag_refusal_rate"
    )
    serve.add_argument(
        "--api-keys",
        metavar="FILE",
        default=None,
        help='a JSON keys file: {"KEY": {"name": "acme", "filters": {"tenant": "acme"}}, ...}; each key reads only '
        "what its filters admit (default: the file CRAG_API_KEYS_FILE names, else the one key CRAG_API_KEY)",
    )
    serve.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="uvicorn's log level")
    serve.set_defaults(run=_serve)


def _ingest(args: argparse.Namespace) -> int:
    from llama_index_crag.stores.folder import ingest
    from llama_index_crag.stores.metadata import pairs_metadata

    if bool(args.out) == bool(args.store):
        raise ConfigError("ingest needs either --out INDEX_DIR or --store postgresql://...")
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    metadata = pairs_metadata(args.metadata)
    if args.store and args.embed_model:
        raise ConfigError(
            "--embed-model is for an index folder (--out); a PostgreSQL store embeds with the bundled model"
        )
    if args.store and metadata:
        raise ConfigError(
            "--metadata is for an index folder (--out); with --store, give the metadata in front matter or sidecars"
        )
    if args.store:
        from llama_index_crag.stores.postgres import PostgresStore
        from llama_index_crag.stores.postgres import ingest as ingest_store

        store = PostgresStore(args.store, table=args.table, index_precision=args.index_precision)
        stored = ingest_store(args.docs, store, progress=progress)
        print(stored.summary() + f" in {stored.seconds:.1f} s")
        for skipped in stored.skipped:
            print(f"  skipped {skipped}")
        print(f"Serve it: llama-crag serve --store URL --table {args.table}")
        return 0
    embed_model = None
    if args.embed_model:
        from llama_index_crag.local.models import load_embed_model

        embed_model = load_embed_model(args.embed_model)
    report = ingest(
        args.docs,
        args.out,
        embed_model=embed_model,
        calibration=args.calibration,
        grader=args.grader,
        warm_fallback=args.warm,
        progress=progress,
        metadata=metadata,
    )
    print(report.summary() + f" in {report.seconds:.1f} s")
    if report.formats:
        print(f"  files by format: {report.by_format()}")
    for skipped in report.skipped:
        print(f"  skipped {skipped}")
    for kept in report.kept:
        print(f"  kept {kept} as the last ingest read it: the file cannot be read now (see its skip line)")
    for note in report.notes:
        print(f"  metadata: {note}")
    print(f"Serve it: llama-crag serve --index {args.out}  (or ask it: llama-crag ask --index {args.out} QUESTION)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from llama_index_crag.server import require_extra

    require_extra()  # a missing package is a MissingDependency: main() prints it in one line
    from llama_index_crag.server.main import ServeOptions, serve

    require_one_store(args, "serve")
    serve(
        ServeOptions(
            index=args.index,
            store=args.store,
            table=args.table,
            host=args.host,
            port=args.port,
            workers=args.workers,
            threads=args.threads,
            llm=args.llm,
            model=args.ollama_model,
            ollama_url=args.ollama_url,
            gguf=args.gguf,
            disable_crag=args.disable_crag,
            cors_origins=args.cors_origin,
            max_body_bytes=args.max_body_bytes,
            max_query_chars=args.max_query_chars,
            query_timeout_s=args.query_timeout,
            rate_window_s=args.rate_window,
            log_level=args.log_level,
            api_keys_file=args.api_keys,
        )
    )
    return 0
