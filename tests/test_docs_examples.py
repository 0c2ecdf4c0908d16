"""Every Python and shell example of README.md and docs/*.md runs, with the context its marker names.

See ``tests/doc_blocks.py`` for the markers. Python blocks run in one worker subprocess (PYTHONPATH=the
repository), each in a fresh namespace (``continues``: the previous block's), with ``index`` and the sample
corpus's embeddings built once. Shell blocks run through bash in a copy of the repository beside ``../shared``
(``llama-crag`` on PATH, PYTHONPATH=that copy), one folder per Markdown file. A failure names the Markdown
file and line of the block and, for shell blocks, of the command that failed.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional
from urllib.parse import parse_qs, urlsplit

import pytest

from .doc_blocks import DOC_FILES, NEEDS, REPO, Block, blocks, problems, runnable_blocks, shell_script, skip_reason

BLOCKS = runnable_blocks()
PYTHON_TIMEOUT_S = 1800
SHELL_TIMEOUT_S = 6 * 3600
SAMPLE = REPO / "llama_index_crag" / "data"
WEB_QUESTION = "Who wrote the novel Moby-Dick?"  # graded INCORRECT over the sample corpus: the fallback runs

# Run after a block with check=NAME, in its namespace; the parent then checks what the loopback fakes saw.
CHECKS = {
    "web-search": f"""
import json as _json
_crag = engine.query({WEB_QUESTION!r}).metadata["crag"]
_keys = ("action", "abstained", "abstain_reason", "rewritten_query", "fallback_sources", "fallback_error")
print(_json.dumps({{"trace": {{k: _crag.get(k) for k in _keys}}, "web": _crag.get("web")}}))
""",
    "llm-answers": """
response = engine.query("What is the monthly uptime SLA for Harbor Pro?")
print(response, response.metadata["crag"]["answer_mode"])
""",
}

WORKER = r"""
import ast, asyncio, contextlib, io, json, os, sys, traceback

protocol = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # what C code prints goes to the log, not into the protocol
cache, namespaces = {}, {}
ORDER = ["index", "llm", "engine"]


def provide(need, ns):
    if need == "index":
        from llama_index.core import VectorStoreIndex
        from llama_index_crag import CorrectiveQueryEngine
        from llama_index_crag.datasets import load_documents
        from llama_index_crag.local.models import default_embed_model

        if "index" not in cache:
            cache["index"] = VectorStoreIndex.from_documents(load_documents(), embed_model=default_embed_model())
        ns["index"], ns["CorrectiveQueryEngine"] = cache["index"], CorrectiveQueryEngine
    elif need == "llm":
        from llama_index.core.llms import MockLLM

        ns["llm"] = MockLLM(max_tokens=24)
    elif need == "engine":
        if "engine" not in cache:
            cache["engine"] = ns["CorrectiveQueryEngine"].from_defaults(index=ns["index"], llm=ns["llm"])
        ns["engine"] = cache["engine"]


def handlers():
    if "llama_index.core.instrumentation" not in sys.modules:
        return None
    from llama_index.core.instrumentation import get_dispatcher

    return get_dispatcher().event_handlers


def run(request):
    saved = {k: os.environ.get(k) for k in request["env"]}
    os.environ.update(request["env"])
    before = list(handlers() or [])
    try:
        if request["continues"]:
            ns = namespaces[request["path"]]
        else:
            ns = {"__name__": "__main__"}
        for need in sorted(request["needs"], key=lambda n: ORDER.index(n) if n in ORDER else -1):
            provide(need, ns)
        padded = "\n" * (request["line"] - 1) + request["code"]
        code = compile(padded, request["path"], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(code, ns)
        if asyncio.iscoroutine(result):
            asyncio.run(result)
        namespaces[request["path"]] = ns
        if request["check"]:
            exec(compile(request["check"], "<check " + request["check_name"] + ">", "exec"), ns)
    finally:
        if handlers() is not None:  # an example's event handler does not print into the next ones
            handlers()[:] = before
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


for line in sys.stdin:
    request = json.loads(line)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            run(request)
        reply = {"ok": True, "stdout": out.getvalue()}
    except BaseException:
        reply = {"ok": False, "stdout": out.getvalue(), "error": traceback.format_exc()}
    protocol.write(json.dumps(reply) + "\n")
"""


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _need_port(port: int, what: str) -> None:
    if not _port_free(port):
        pytest.fail(f"{what} needs 127.0.0.1:{port}, where something else is listening")


class PythonWorker:
    """One subprocess that runs Python blocks on request, keeping the sample index between them."""

    def __init__(self, cwd: Path, hf_home: Path) -> None:
        self.cwd = cwd
        self.log = cwd / "worker.log"
        script = cwd / "docs_worker.py"
        script.write_text(WORKER)
        # Offline, with a Hugging Face cache of the runner's own (needs=hub-model fills it).
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-u", str(script)],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log.open("ab"),
            text=True,
        )
        self.replies: queue.Queue[Optional[str]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.replies.put(line)
        self.replies.put(None)

    def run(self, block: Block, env: Dict[str, str], check: Optional[str]) -> Dict[str, Any]:
        request = {
            "path": str(block.path),
            "line": block.line,
            "code": block.code,
            "needs": [n for n in block.needs if n in ("index", "llm", "engine")],
            "continues": "continues" in block.flags,
            "env": env,
            "check": CHECKS[check] if check else None,
            "check_name": check or "",
        }
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        try:
            line = self.replies.get(timeout=PYTHON_TIMEOUT_S)
        except queue.Empty:
            self.close()
            pytest.fail(f"{block.where}: no result within {PYTHON_TIMEOUT_S} s; the worker was stopped")
        if line is None:
            tail = self.log.read_text(errors="replace")[-3000:]
            pytest.fail(f"{block.where}: the worker died\n{tail}")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class SearxNGProxy:
    """An HTTP proxy on loopback that answers SearxNG's JSON API for every host, and refuses everything else.

    With HTTP_PROXY and HTTPS_PROXY pointing at it, ``searxng_url="http://searx.internal:8080"`` reaches it as
    written, and no request leaves the machine: result pages are answered 404, CONNECT tunnels 403.
    """

    def __init__(self) -> None:
        self.searches: List[Dict[str, Any]] = []
        self.other: List[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                if url.path.endswith("/search") and query.get("format") == ["json"]:
                    proxy.searches.append({"host": url.netloc, "path": url.path, "query": query})
                    results = [
                        {"url": "https://en.wikipedia.org/wiki/Port_of_Vigo", "title": "Port of Vigo", "content": ""},
                        {"url": "https://docs.python.org/3/library/http.html", "title": "http", "content": ""},
                        {"url": "https://example.com/vigo", "title": "off the allow list", "content": ""},
                    ]
                    body = json.dumps({"query": query["q"][0], "number_of_results": 3, "results": results}).encode()
                    self._reply(200, "application/json", body)
                else:
                    proxy.other.append(self.path)
                    self._reply(404, "text/plain", b"not here")

            def do_CONNECT(self) -> None:
                proxy.other.append(f"CONNECT {self.path}")
                self._reply(403, "text/plain", b"no tunnels")

            def _reply(self, status: int, content_type: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def env(self) -> Dict[str, str]:
        return {"HTTP_PROXY": self.url, "HTTPS_PROXY": self.url, "http_proxy": self.url, "https_proxy": self.url}

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _copy_checkout(target: Path) -> Path:
    """The checkout's files (tracked, and untracked but not ignored) copied to ``target/repo``, beside a link
    ``target/shared`` to the real ``../shared``, so that the docs' relative paths hold and nothing they write
    lands in the checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    repo = target / "repo"
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, repo / name)
    if (REPO.parent / "shared").exists():
        (target / "shared").symlink_to(REPO.parent / "shared")
    return repo


def _write_files(need: str, folder: Path) -> None:
    rows = [json.loads(line) for line in (SAMPLE / "corpus.jsonl").read_text().splitlines() if line.strip()]
    if need == "my-docs":
        (folder / "my-docs").mkdir(exist_ok=True)
        for row in rows:
            (folder / "my-docs" / f"{row['doc_id']}.txt").write_text(f"{row.get('title', '')}\n\n{row['text']}\n")
    elif need in ("my-questions", "my-corpus"):
        (folder / need).mkdir(exist_ok=True)
        shutil.copy(SAMPLE / "corpus.jsonl", folder / need / "corpus.jsonl")
        if need == "my-questions":
            shutil.copy(SAMPLE / "questions.jsonl", folder / need / "questions.jsonl")
    elif need == "my-app":
        (folder / "my_app.py").write_text(
            "from llama_index_crag import CorrectiveQueryEngine\n"
            "from llama_index_crag.datasets import load_documents\n\n"
            "engine = CorrectiveQueryEngine.from_defaults(nodes=load_documents())\n"
            "print(engine.grader.scorer.name)\n"
            "print(engine.query('Who is the chief executive officer of Harbor Analytics?'))\n"
        )


class Contexts:
    """What the markers' needs stand for, started on first use and stopped at the end of the module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.worker: Optional[PythonWorker] = None
        self.ollama: Any = None
        self.searxng: Optional[SearxNGProxy] = None
        self.postgres: Any = None
        self.postgres_sample = False
        self.server: Any = None
        self.server_url: Optional[str] = None
        self.wheels: Optional[Path] = None
        self.folders: Dict[str, Path] = {}
        self.hf_home = root / "hf"
        self.done: set = set()

    # Servers.
    def start_ollama(self) -> Any:
        if self.ollama is None:
            from .ollama_server import OllamaServer

            _need_port(11434, "needs=ollama")
            self.ollama = OllamaServer(model_name="qwen2.5:3b", port=11434, n_ctx=8192).start()
        return self.ollama

    def start_searxng(self) -> SearxNGProxy:
        if self.searxng is None:
            self.searxng = SearxNGProxy()
        return self.searxng

    def start_postgres(self) -> Any:
        if self.postgres is None:
            import psycopg

            from .pg_server import LocalPostgres

            _need_port(5432, "needs=postgres")
            self.postgres = LocalPostgres(port=5432).start()
            with psycopg.connect(self.postgres.url, autocommit=True) as conn:
                conn.execute("CREATE ROLE crag LOGIN SUPERUSER PASSWORD 'secret'")
                conn.execute("CREATE DATABASE rag OWNER crag")
            with psycopg.connect("postgresql://crag@127.0.0.1:5432/rag", autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        return self.postgres

    def ingest_postgres_sample(self) -> None:
        if not self.postgres_sample:
            self._cli(["ingest", str(SAMPLE), "--store", "postgresql://crag@127.0.0.1:5432/rag"])
            self.postgres_sample = True

    def start_server(self) -> str:
        if self.server_url is None:
            from .docs_serve import serving

            _need_port(8000, "needs=server")
            index = self.root / "server-index"
            self._cli(["ingest", str(SAMPLE), "--out", str(index)])
            self.server = serving(
                [sys.executable, "-c", _CLI, "serve", "--index", str(index), "--llm", "none"], env=self._env(REPO)
            )
            self.server_url = self.server.__enter__()
        return self.server_url

    def _env(self, pythonpath: Path) -> Dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(pythonpath)}

    def _cli(self, args: List[str]) -> None:
        done = subprocess.run([sys.executable, "-c", _CLI, *args], env=self._env(REPO), capture_output=True, text=True)
        assert done.returncode == 0, f"llama-crag {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"

    def wheelhouse(self) -> Path:
        """This checkout built as a wheel, for pip to find as llama-index-crag (it is on no package index)."""
        if self.wheels is None:
            self.wheels = self.root / "wheels"
            subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(self.wheels), str(REPO)],
                check=True,
            )
        return self.wheels

    # Where blocks run.
    def python_worker(self) -> PythonWorker:
        if self.worker is None or self.worker.process.poll() is not None:
            folder = self.root / "python"
            folder.mkdir(exist_ok=True)
            self.worker = PythonWorker(folder, self.hf_home)
        return self.worker

    def shell_folder(self, block: Block) -> Path:
        key = block.path.stem
        if key not in self.folders:
            self.folders[key] = _copy_checkout(self.root / f"shell-{key}")
            # One embedding cache for every folder (keyed by content and model, as the commands key it): SciFact
            # is embedded once a run, or once ever with CRAG_DOCS_CACHE=DIR.
            cache = Path(os.environ.get("CRAG_DOCS_CACHE") or self.root / "crag-cache")
            cache.mkdir(parents=True, exist_ok=True)
            (self.folders[key] / ".crag-cache").symlink_to(cache)
        return self.folders[key]

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.server is not None:
            self.server.__exit__(None, None, None)
        if self.ollama is not None:
            self.ollama.stop()
        if self.searxng is not None:
            self.searxng.close()
        if self.postgres is not None:
            self.postgres.stop()


_CLI = "import sys; from llama_index_crag.cli import main; sys.argv[0] = 'llama-crag'; sys.exit(main())"
_SHIM = f"""#!/bin/sh
exec python -c "{_CLI}" "$@"
"""


@pytest.fixture(scope="module")
def contexts() -> Iterator[Contexts]:
    root = Path(tempfile.mkdtemp(prefix="crag-docs-"))
    ctx = Contexts(root)
    try:
        yield ctx
    finally:
        ctx.close()
        shutil.rmtree(root, ignore_errors=True)


def _previous(block: Block) -> Block:
    same = [b for b in BLOCKS if b.path == block.path and b.kind == block.kind and b.line < block.line]
    assert same, f"{block.where}: continues, but no earlier {block.kind} block of its file"
    return same[-1]


def run_block(block: Block, ctx: Contexts) -> str:
    """Run one block with its context (its predecessor first, for ``continues``); return what it printed."""
    if "continues" in block.flags and _previous(block).where not in ctx.done:
        run_block(_previous(block), ctx)
    env = dict(block.env())
    needs = set(block.needs)
    if "ollama" in needs:
        ctx.start_ollama()
    if "searxng" in needs:
        env.update(ctx.start_searxng().env())
        ctx.start_searxng().searches.clear()
    if "postgres" in needs:
        ctx.start_postgres()
        env["PGHOSTADDR"] = "127.0.0.1"
    if "server" in needs:
        ctx.start_server()
    if "hub-model" in needs:
        env.update(_hub_model(block, ctx))
    output = _run_python(block, ctx, env) if block.kind == "python" else _run_shell(block, ctx, env)
    ctx.done.add(block.where)
    return output


def _run_python(block: Block, ctx: Contexts, env: Dict[str, str]) -> str:
    if "postgres" in block.needs:
        ctx.ingest_postgres_sample()
    check = block.options.get("check")
    reply = ctx.python_worker().run(block, env, check)
    if not reply["ok"]:
        pytest.fail(f"{block.where}: the example raised\n{reply['error']}\nIt printed:\n{reply['stdout'][-3000:]}")
    return reply["stdout"]


def _run_shell(block: Block, ctx: Contexts, env: Dict[str, str]) -> str:
    folder = ctx.shell_folder(block)
    for need in block.needs:
        _write_files(need, folder)
    tools = ctx.root / "bin"
    if not tools.exists():
        tools.mkdir()
        (tools / "llama-crag").write_text(_SHIM)
        # A command, not a shell function, so that bash's ERR trap names the Markdown line it failed on.
        (tools / "crag_serve").write_text(f'#!/bin/sh\nexec python "{REPO / "tests" / "docs_serve.py"}" "$@"\n')
        for tool in tools.iterdir():
            tool.chmod(0o755)
    path = [str(tools), str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    full_env = {**os.environ, "PYTHONPATH": str(folder), **env}
    if "fresh-venv" in block.needs:
        venv = folder / ".venv-docs"
        if not venv.exists():  # with the CPU torch the README installs first (a bare torch is a CUDA build)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "torch==2.13.0"], check=True)
        path.insert(1, str(venv / "bin"))
        full_env.pop("PYTHONPATH")
        full_env["VIRTUAL_ENV"] = str(venv)
        full_env["PIP_FIND_LINKS"] = " ".join(filter(None, [os.environ.get("PIP_FIND_LINKS"), str(ctx.wheelhouse())]))
    full_env["PATH"] = os.pathsep.join(path)
    preamble = f"set -eo pipefail; trap 'echo \"{block.path.relative_to(REPO)}:$LINENO failed: $BASH_COMMAND\" >&2' ERR"
    script = folder.parent / f"block-{block.path.stem}-{block.line}.sh"
    script.write_text(preamble + "\n" * (block.line - 1) + shell_script(block))
    try:
        done = subprocess.run(
            ["bash", str(script)], cwd=folder, env=full_env, capture_output=True, text=True, timeout=SHELL_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: still running after {SHELL_TIMEOUT_S} s")
    if done.returncode != 0:
        pytest.fail(
            f"{block.where}: exited {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n"
            f"{done.stderr[-6000:]}"
        )
    return done.stdout


def _hub_model(block: Block, ctx: Contexts) -> Dict[str, str]:
    """Put a stand-in for each model the block names into the worker's Hugging Face cache (it runs offline):
    the bundled MiniLM with a zero classification head, so that loading goes through the hub cache as it
    would for the real model. Also writes crag-calibration.json fitted for that scorer's name."""
    import hashlib

    import torch
    from safetensors.torch import load_file, save_file

    from llama_index_crag.local.bundled import bundled_embedding_path

    source = bundled_embedding_path()
    for model_id in re.findall(r'"([\w.-]+/[\w.-]+)"', block.code):
        repo = ctx.hf_home / "hub" / f"models--{model_id.replace('/', '--')}"
        revision = hashlib.sha1(model_id.encode()).hexdigest()
        snapshot = repo / "snapshots" / revision
        if snapshot.exists():
            continue
        snapshot.mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
        config = json.loads((source / "config.json").read_text())
        config.update(
            architectures=["BertForSequenceClassification"], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}
        )
        (snapshot / "config.json").write_text(json.dumps(config))
        for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(source / name, snapshot / name)
        weights = {f"bert.{k}": v for k, v in load_file(str(source / "model.safetensors")).items()}
        weights.update({"classifier.weight": torch.zeros(1, 384), "classifier.bias": torch.zeros(1)})
        save_file(weights, str(snapshot / "model.safetensors"))
        calibration = {
            "version": 1,
            "scorer": f"cross-encoder:flagembedding:{model_id}",
            "thresholds": {"upper": 0.6, "lower": 0.4},
        }
        (ctx.python_worker().cwd / "crag-calibration.json").write_text(json.dumps(calibration))
    return {}


def _param(block: Block) -> Any:
    marks: List[Any] = []
    if block.slow:  # a training run or a fresh install: far past the suite's five minutes
        marks += [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(SHELL_TIMEOUT_S)]
    if "fresh-venv" in block.needs:  # a new virtualenv and its installs (llama.cpp compiled): make test-long
        marks.append(pytest.mark.install)
    reason = skip_reason(block)
    if reason:
        marks.append(pytest.mark.skip(reason=f"{block.where}: {reason}"))
    return pytest.param(block, id=block.where, marks=marks)


def test_every_runnable_block_has_a_valid_marker() -> None:
    found = [problem for block in BLOCKS for problem in problems(block)]
    assert not found, "\n".join(found)


def test_the_runner_finds_the_blocks_of_every_doc() -> None:
    assert all(blocks(path) for path in DOC_FILES), "a doc without any fenced block: is the parser broken?"
    assert "from llama_index_crag import CorrectiveQueryEngine" in BLOCKS[[b.lang for b in BLOCKS].index("python")].code
    unlabelled = [b.where for path in DOC_FILES for b in blocks(path) if not b.lang]
    assert not unlabelled, f"fences without a language (text for output): {unlabelled}"
    assert all(b.code.strip() for b in BLOCKS)
    assert set(NEEDS) >= {n for b in BLOCKS for n in b.needs}


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_doc_example(block: Block, contexts: Contexts) -> None:
    assert not problems(block), problems(block)
    started = time.monotonic()
    output = run_block(block, contexts)
    check = block.options.get("check")
    if check == "web-search":
        proxy = contexts.start_searxng()
        assert proxy.searches, f"{block.where}: no search reached the SearxNG server; it printed:\n{output}"
        sent = proxy.searches[-1]
        assert sent["host"] == "searx.internal:8080" and sent["path"] == "/search", sent
        reports = json.loads(output.strip().splitlines()[-1])["web"]
        assert reports and reports[-1]["provider"] == "searxng", reports
        assert reports[-1]["sent_query"] == sent["query"]["q"][0], (reports, sent)
        assert not [o for o in proxy.other if "example.com" in o], "a page off the allow list was requested"
    elif check == "llm-answers":
        assert any(path in ("/api/chat", "/api/generate") for path, _ in contexts.start_ollama().requests), (
            f"{block.where}: the LLM never called the Ollama server; it printed:\n{output}"
        )
    print(f"{block.where}: {time.monotonic() - started:.1f} s")


def _doc(tmp_path: Path, text: str) -> Block:
    path = tmp_path / "page.md"
    path.write_text(text)
    (block,) = blocks(path)
    block.path = REPO / "docs" / "page.md"  # where it would live, for the messages
    return block


def test_limits_replace_or_add_flags_and_serve_runs_until_it_answers(tmp_path: Path) -> None:
    block = _doc(
        tmp_path,
        '<!-- example: slow limit="eval --limit 3; bench_engine.py --queries 2" -->\n```bash\n'
        "OMP_NUM_THREADS=1 llama-crag eval --dataset d --limit 300 \\\n    --out o   # note\n"
        "python benchmarks/bench_engine.py\nllama-crag serve --index i\necho done\n```\n",
    )
    assert block.slow and block.line == 3
    assert shell_script(block).splitlines() == [
        "OMP_NUM_THREADS=1 llama-crag eval --dataset d --limit 3 --out o",
        "",
        "python benchmarks/bench_engine.py --queries 2",
        "crag_serve llama-crag serve --index i",
        "echo done",
    ]
    block.options["limit"] = "calibrate --limit 3"
    with pytest.raises(ValueError, match="calibrate"):
        shell_script(block)


def test_a_console_block_runs_its_dollar_lines_only(tmp_path: Path) -> None:
    block = _doc(tmp_path, "<!-- example: standalone -->\n```console\n$ echo one\none\n$ echo two\ntwo\n```\n")
    assert shell_script(block).splitlines() == ["echo one", "", "echo two", ""]


def test_a_block_without_a_marker_or_with_an_unknown_need_is_refused(tmp_path: Path) -> None:
    assert problems(_doc(tmp_path, "```python\nprint(1)\n```\n"))
    assert problems(_doc(tmp_path, "<!-- example: needs=gpu -->\n```python\nprint(1)\n```\n"))
    assert problems(_doc(tmp_path, "<!-- example: skip -->\n```python\nprint(1)\n```\n"))
    assert not problems(_doc(tmp_path, '<!-- example: skip reason="a paid key" -->\n```python\nprint(1)\n```\n'))


def test_a_failing_python_block_is_reported_at_its_markdown_line(tmp_path: Path, contexts: Contexts) -> None:
    block = _doc(tmp_path, "Text.\n\n<!-- example: standalone -->\n```python\nx = 1\ny = x / 0\n```\n")
    with pytest.raises(pytest.fail.Exception) as failed:
        run_block(block, contexts)
    assert "docs/page.md:5: the example raised" in str(failed.value)
    assert 'page.md", line 6' in str(failed.value) and "ZeroDivisionError" in str(failed.value)


def test_a_failing_shell_block_is_reported_at_its_markdown_line(tmp_path: Path, contexts: Contexts) -> None:
    block = _doc(tmp_path, "<!-- example: standalone -->\n```bash\ntrue\nllama-crag no-such-command\necho after\n```\n")
    with pytest.raises(pytest.fail.Exception) as failed:
        run_block(block, contexts)
    assert "docs/page.md:4 failed: llama-crag no-such-command" in str(failed.value)
    assert "after" not in str(failed.value).split("--- stdout")[1].split("--- stderr")[0]
