"""Building the served app from command-line options, in one process or in each of several uvicorn workers.

With ``--workers N`` uvicorn starts N processes that each import ``app_factory``; the
options travel to them in the ``CRAG_SERVE_OPTIONS`` environment variable, and the
Prometheus counters of all workers are shared through ``PROMETHEUS_MULTIPROC_DIR``.
Each worker's models (torch's and the bundled llama.cpp's) run on its share of the
cores, ``worker_threads``: N processes that each start a thread per core would run
N threads on every core, and spinning threads that wait on each other slow every
query down.

The API keys (``--api-keys FILE``, ``CRAG_API_KEYS_FILE``, or ``CRAG_API_KEY`` for one key with no
scope) are read, and a file that cannot be used is refused, before any model is loaded; each
worker reads the file again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

OPTIONS_ENV = "CRAG_SERVE_OPTIONS"


@dataclass
class ServeOptions:
    """What ``llama-crag serve`` was asked for."""

    index: str
    store: Optional[str] = None  # a PostgreSQL URL: serve the store instead of the index folder
    table: str = "crag"
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    llm: str = "auto"  # auto | ollama | llamacpp | none
    model: Optional[str] = None
    ollama_url: Optional[str] = None
    gguf: Optional[str] = None
    request_timeout_s: float = 120.0
    disable_crag: bool = False
    cors_origins: List[str] = field(default_factory=list)
    max_body_bytes: int = 64 * 1024
    max_query_chars: Optional[int] = None  # None: the engine's (CRAG_MAX_QUERY_CHARS, else its default)
    query_timeout_s: float = 120.0
    rate_window_s: float = 300.0
    log_level: str = "info"
    threads: Optional[int] = None  # per worker, for torch and llama.cpp; None: the usable cores shared out
    api_keys_file: Optional[str] = None  # a keys file (keys.py); None: CRAG_API_KEYS_FILE, else CRAG_API_KEY


def api_keys(options: ServeOptions) -> Any:
    """The server's keys: ``--api-keys``, else the file ``CRAG_API_KEYS_FILE`` names, else ``CRAG_API_KEY`` as one
    key with no scope, else None (open); a file that cannot be used is a ``KeysFileError`` saying why."""
    from llama_index_crag.server.keys import KEY_ENV, KEYS_FILE_ENV, server_keys

    return server_keys(options.api_keys_file or os.environ.get(KEYS_FILE_ENV) or None, os.environ.get(KEY_ENV) or None)


def worker_threads(options: ServeOptions) -> int:
    """The CPU threads each worker's models run on: ``--threads``, else the cores this process may use
    (``usable_cores``: affinity and a container's CPU quota) divided among the workers, at least one each."""
    from llama_index_crag.errors import ConfigError
    from llama_index_crag.local.cores import usable_cores

    if options.threads is not None:
        if options.threads < 1:
            raise ConfigError(f"--threads must be at least 1, not {options.threads}")
        return options.threads
    return max(1, usable_cores() // max(1, options.workers))


def use_threads(threads: int, options: ServeOptions) -> None:
    """Run torch (the embedding model and the graders) on ``threads`` threads in this process, unless
    ``OMP_NUM_THREADS`` already says how many and ``--threads`` does not. torch's own default counts the
    machine's cores, not a container's quota, and a quota spread over more threads than it pays for is
    throttled."""
    if options.threads is None and os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    torch.set_num_threads(threads)


def build_llm(options: ServeOptions, threads: Optional[int] = None) -> Tuple[Any, Any]:
    """The generator the options name (a llama.cpp model on ``threads`` threads, default every core), and the
    ``Generator`` the health check probes."""
    from llama_index_crag.local.models import DEFAULT_OLLAMA_MODEL, DEFAULT_OLLAMA_URL, default_llm, ollama_has_model
    from llama_index_crag.server.service import Generator

    url = options.ollama_url or DEFAULT_OLLAMA_URL
    if options.llm == "none":
        said = "none (answers quote the graded passages; rewrites use the question's keywords)"
        return None, Generator(said, label="none (quoted answers)")
    if options.llm == "ollama":
        from llama_index.llms.ollama import Ollama

        model = options.model or DEFAULT_OLLAMA_MODEL
        llm = Ollama(model=model, base_url=url, request_timeout=options.request_timeout_s, context_window=8192)

        def probe() -> Tuple[bool, str]:
            if ollama_has_model(url, model, timeout=2.0):
                return True, f"Ollama at {url} lists {model}"
            return False, f"no Ollama model {model} answers at {url}"

        return llm, Generator(f"Ollama model {model} at {url}", probe, label=f"Ollama {model}")
    if options.llm == "llamacpp":
        from llama_index_crag.local.bundled import bundled_gguf_path
        from llama_index_crag.local.llamacpp import BundledLlamaCPP
        from llama_index_crag.local.portable import require_generation

        path = options.gguf or str(bundled_gguf_path())
        require_generation(path)
        local = BundledLlamaCPP(model_path=path, n_threads=threads)
        count = local.model_kwargs["n_threads"]
        described = f"llama.cpp in process with {path}, {count} thread{'' if count == 1 else 's'}"
        return local, Generator(described, label=f"llama.cpp {Path(path).name}")
    if options.llm == "auto":
        model = options.model or DEFAULT_OLLAMA_MODEL
        found, described = default_llm(url, model, gguf=options.gguf, n_threads=threads)
        local_path = getattr(found, "model_path", None)  # LlamaIndex's LlamaCPP keeps the file it loaded
        label = f"llama.cpp {Path(str(local_path)).name}" if local_path else f"Ollama {model}"
        return found, Generator(described, label=label)
    raise ValueError(f"unknown --llm {options.llm!r}: use auto, ollama, llamacpp or none")


def build_app(options: ServeOptions) -> Any:
    """The FastAPI app over the index folder the options name."""
    from llama_index_crag.core.persisted import engine_from_store, load_engine
    from llama_index_crag.server.app import create_app
    from llama_index_crag.server.service import ServerConfig
    from llama_index_crag.stores.folder import load_index

    keys = api_keys(options)
    threads = worker_threads(options)
    use_threads(threads, options)
    llm, generator = build_llm(options, threads)  # None: the engine quotes the passages instead of generating
    settings: Dict[str, Any] = {
        "enabled": False if options.disable_crag else None,
        "max_query_chars": options.max_query_chars,
    }
    if options.store:
        from llama_index_crag.stores.postgres import PostgresStore

        store = PostgresStore(options.store, table=options.table)
        engine = engine_from_store(store, llm, **settings)
        described = store.describe()
    else:
        loaded = load_index(options.index)
        engine = load_engine(loaded, llm, **settings)
        described = loaded.describe()
    config = ServerConfig(
        api_keys=keys,
        max_body_bytes=options.max_body_bytes,
        query_timeout_s=options.query_timeout_s,
        cors_origins=list(options.cors_origins),
        rate_window_s=options.rate_window_s,
    )
    _log_to_stderr(options.log_level)
    return create_app(engine, config, generator, described)


def _log_to_stderr(level: str) -> None:
    """The server's own log lines (each query's id, caller name and action; crashes) on stderr beside uvicorn's,
    at its log level; a program that embeds ``create_app`` configures logging itself."""
    logger = logging.getLogger("llama_index_crag.server")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if level == "trace" else level.upper())


def app_factory() -> Any:
    """Each uvicorn worker's app: the options come from ``CRAG_SERVE_OPTIONS``."""
    raw = os.environ.get(OPTIONS_ENV)
    if not raw:
        raise RuntimeError(f"{OPTIONS_ENV} is not set: start the server with llama-crag serve")
    return build_app(ServeOptions(**json.loads(raw)))


def serve(options: ServeOptions) -> None:
    """Run the server in the foreground until interrupted."""
    import uvicorn

    from llama_index_crag.stores.folder import load_index

    worker_threads(options)  # a bad --threads is an error now rather than in every worker
    api_keys(options)  # and a keys file that cannot be used
    if options.store:  # a clear error now rather than in every worker
        from llama_index_crag.stores.postgres import PostgresStore

        checked = PostgresStore(options.store, table=options.table)
        checked.require()
        checked.close()
    else:
        load_index(options.index)
    if options.workers <= 1:
        uvicorn.run(build_app(options), host=options.host, port=options.port, log_level=options.log_level)
        return
    metrics_dir = tempfile.mkdtemp(prefix="crag-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    os.environ[OPTIONS_ENV] = json.dumps(asdict(options))
    try:
        uvicorn.run(
            "llama_index_crag.server.main:app_factory",
            factory=True,
            host=options.host,
            port=options.port,
            workers=options.workers,
            log_level=options.log_level,
            # Each worker loads the models before it answers the supervisor's health check.
            timeout_worker_healthcheck=600,
        )
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
