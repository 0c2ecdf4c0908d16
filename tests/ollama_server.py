"""Loopback HTTP server speaking Ollama's API, generating with a local GGUF model via llama.cpp."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, cast

import llama_cpp
from llama_cpp import Llama
from llama_cpp.llama_grammar import LlamaGrammar

from llama_index_crag.local.bundled import bundled_gguf_path
from llama_index_crag.local.llamacpp import json_grammar

Mode = Literal["normal", "hang", "garbage", "error500"]

OLLAMA_VERSION = "0.12.0"
DEFAULT_NUM_PREDICT = 128
# Ollama's runtime defaults, except ``num_predict``, which is capped to keep tests fast.
_DEFAULT_OPTIONS: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_penalty": 1.1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "num_predict": DEFAULT_NUM_PREDICT,
}
_QUANTIZATIONS = {"0": "F32", "1": "F16", "2": "Q4_0", "3": "Q4_1", "7": "Q8_0"}


def _timestamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _canonical(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


class _RequestError(Exception):
    """A client error, answered with ``{"error": message}`` and the given status."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _MeteredLlama(Llama):
    """A ``Llama`` that records the prompt length and sampled-token count of its last run."""

    prompt_tokens: int = 0
    sampled_tokens: int = 0

    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Generator[int, Sequence[int] | None, None]:
        self.prompt_tokens = len(tokens)
        self.sampled_tokens = 0
        for token in super().generate(tokens, *args, **kwargs):
            self.sampled_tokens += 1
            yield token


@dataclass
class _Job:
    """What to generate: chat ``messages`` (through the chat template) or a raw prompt."""

    sampling: dict[str, Any]
    grammar: LlamaGrammar | None
    messages: list[dict[str, str]] = field(default_factory=list)
    raw_prompt: str | None = None


@dataclass
class _Outcome:
    """Why and how a generation finished, in Ollama's terms (durations in nanoseconds)."""

    done_reason: str = "stop"
    load_duration: int = 0
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0


def _sampling_kwargs(options: dict[str, Any], seed: int) -> dict[str, Any]:
    """Translate Ollama ``options`` into llama-cpp-python sampling arguments."""
    merged = {**_DEFAULT_OPTIONS, "seed": seed}
    merged.update({key: value for key, value in options.items() if value is not None})
    num_predict = int(merged["num_predict"])
    stop = merged.get("stop") or []
    return {
        "temperature": float(merged["temperature"]),
        "top_k": int(merged["top_k"]),
        "top_p": float(merged["top_p"]),
        "min_p": float(merged["min_p"]),
        "typical_p": float(merged["typical_p"]),
        "repeat_penalty": float(merged["repeat_penalty"]),
        "presence_penalty": float(merged["presence_penalty"]),
        "frequency_penalty": float(merged["frequency_penalty"]),
        "seed": int(merged["seed"]),
        "max_tokens": num_predict if num_predict > 0 else None,
        "stop": [stop] if isinstance(stop, str) else [str(s) for s in stop],
    }


def _grammar(fmt: Any) -> LlamaGrammar | None:
    """Build the grammar for an Ollama ``format`` value: ``"json"`` or a JSON schema."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return json_grammar()
    if isinstance(fmt, dict):
        try:
            return json_grammar(fmt)
        except Exception as exc:
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"invalid JSON schema in format: {exc}") from exc
    raise _RequestError(HTTPStatus.BAD_REQUEST, 'invalid format: expected "json" or a valid JSON schema')


class OllamaServer:
    """An Ollama-compatible HTTP server on 127.0.0.1 that generates with a real GGUF model.

    Serves ``GET /``, ``GET /api/version``, ``GET /api/tags``, ``POST /api/show``,
    ``POST /api/chat`` and ``POST /api/generate`` from a daemon thread, on a port chosen by
    the OS. Chat requests go through the GGUF's own chat template; ``format`` (``"json"`` or
    a JSON schema) constrains sampling with a llama.cpp grammar. Sampling is seeded (the
    request's ``options.seed``, else the server's ``seed``), so identical requests give
    identical answers. The model is loaded on first use and shared by all requests under
    a lock, since llama.cpp contexts are not thread-safe.

    Example:
        >>> with OllamaServer(model_name="smollm2") as srv:  # doctest: +SKIP
        ...     Ollama(model="smollm2", base_url=srv.url, context_window=2048)

    Attributes:
        model_name: The only model this server knows; ``name`` and ``name:latest`` both match.
        gguf_path: The GGUF file generated with.
        n_ctx: The llama.cpp context window, also reported as the model's context length.
        seed: The sampling seed used when a request gives none.
        n_threads: CPU threads for llama.cpp. One by default: on a small, busy machine more
            threads make llama.cpp spin on its barriers and run many times slower.
        port: The loopback port to bind; 0 (the default) lets the OS choose a free one. The docs'
            examples use Ollama's own 11434, where a client with no ``base_url`` looks.
        mode: How ``/api/chat`` and ``/api/generate`` behave: ``"normal"``; ``"hang"``
            (accept the request, never answer until the server stops); ``"garbage"``
            (HTTP 200 with a body that is not JSON); ``"error500"`` (HTTP 500). It may be
            changed while the server runs.
        requests: Every request received, in order, as ``(path, parsed JSON body)``;
            ``{}`` for requests without a body.
        replies: The text of every generation answered, in order, as ``(path, text)``.
    """

    def __init__(
        self,
        model_name: str = "smollm2",
        *,
        gguf_path: str | Path | None = None,
        n_ctx: int = 2048,
        seed: int = 0,
        mode: Mode = "normal",
        n_threads: int = 1,
        port: int = 0,
    ) -> None:
        self.model_name = model_name
        self.port = port
        self.gguf_path = Path(gguf_path) if gguf_path is not None else bundled_gguf_path()
        self.n_ctx = n_ctx
        self.seed = seed
        self.mode: Mode = mode
        self.n_threads = n_threads
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.replies: list[tuple[str, str]] = []
        self._llm: _MeteredLlama | None = None
        self._load_lock = threading.Lock()
        self._generate_lock = threading.Lock()
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL to give a client, such as ``http://127.0.0.1:54321``."""
        if self._httpd is None:
            raise RuntimeError("the server is not running")
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> OllamaServer:
        """Bind to ``port`` on loopback (an OS-chosen one when 0) and serve in a daemon thread."""
        if self._httpd is not None:
            raise RuntimeError("the server is already running")
        self._stopping.clear()
        self._httpd = _HTTPServer(("127.0.0.1", self.port), _Handler, self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"ollama-server-{self._httpd.server_address[1]}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, release hanging requests, drop open connections and free the model."""
        if self._httpd is None or self._thread is None:
            return
        self._stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
        with self._connections_lock:
            for conn in self._connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._httpd = None
        self._thread = None
        with self._generate_lock, self._load_lock:
            if self._llm is not None:
                self._llm.close()
                self._llm = None

    def __enter__(self) -> OllamaServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _check_model(self, name: Any) -> None:
        if not isinstance(name, str) or not name:
            raise _RequestError(HTTPStatus.BAD_REQUEST, "model is required")
        if _canonical(name) != _canonical(self.model_name):
            raise _RequestError(HTTPStatus.NOT_FOUND, f"model '{name}' not found")

    def _load(self) -> tuple[_MeteredLlama, int]:
        """Return the model, loading it on first use, and the nanoseconds spent loading."""
        with self._load_lock:
            if self._llm is not None:
                return self._llm, 0
            if self._stopping.is_set():
                raise _RequestError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")
            started = time.perf_counter_ns()
            self._llm = _MeteredLlama(
                model_path=str(self.gguf_path),
                n_ctx=self.n_ctx,
                seed=self.seed,
                n_threads=self.n_threads,
                n_threads_batch=self.n_threads,
                verbose=False,
            )
            return self._llm, time.perf_counter_ns() - started

    def _model_entry(self) -> dict[str, Any]:
        """Describe the model the way ``/api/tags`` and ``/api/show`` do."""
        llm, _ = self._load()
        arch = llm.metadata.get("general.architecture", "")
        stat = self.gguf_path.stat()
        return {
            "name": _canonical(self.model_name),
            "model": _canonical(self.model_name),
            "modified_at": datetime.fromtimestamp(stat.st_mtime, timezone.utc).isoformat(),
            "size": stat.st_size,
            "digest": hashlib.sha256(f"{self.gguf_path}:{stat.st_size}".encode()).hexdigest(),
            "details": {
                "parent_model": "",
                "format": "gguf",
                "family": arch,
                "families": [arch],
                "parameter_size": llm.metadata.get("general.size_label", ""),
                "quantization_level": _QUANTIZATIONS.get(llm.metadata.get("general.file_type", ""), ""),
            },
        }

    def _show(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_model(body.get("model"))
        entry = self._model_entry()
        llm, _ = self._load()
        arch = entry["details"]["family"]
        return {
            "license": llm.metadata.get("general.license", ""),
            "modelfile": f"FROM {self.gguf_path}\n",
            "parameters": f"num_ctx {self.n_ctx}",
            "template": llm.metadata.get("tokenizer.chat_template", ""),
            "details": entry["details"],
            "model_info": {
                "general.architecture": arch,
                "general.parameter_count": llama_cpp.llama_model_n_params(llm.model),
                f"{arch}.context_length": self.n_ctx,
            },
            "capabilities": ["completion"],
            "modified_at": entry["modified_at"],
        }

    def _plan(self, body: dict[str, Any], chat: bool) -> _Job:
        """Validate a chat or generate request and turn it into a generation job."""
        self._check_model(body.get("model"))
        if body.get("think"):
            raise _RequestError(HTTPStatus.BAD_REQUEST, f'"{body["model"]}" does not support thinking')
        options = body.get("options") or {}
        if not isinstance(options, dict):
            raise _RequestError(HTTPStatus.BAD_REQUEST, "options must be an object")
        try:
            sampling = _sampling_kwargs(options, self.seed)
        except (TypeError, ValueError) as exc:
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"invalid options: {exc}") from exc
        job = _Job(sampling=sampling, grammar=_grammar(body.get("format")))
        if chat:
            job.messages = [
                {"role": str(m.get("role", "user")), "content": str(m.get("content") or "")}
                for m in body.get("messages") or []
                if isinstance(m, dict)
            ]
        elif body.get("prompt"):
            if body.get("raw"):
                job.raw_prompt = str(body["prompt"])
            else:
                system = body.get("system")
                job.messages = [{"role": "system", "content": str(system)}] if system else []
                job.messages.append({"role": "user", "content": str(body["prompt"])})
        return job

    def _pieces(self, job: _Job, outcome: _Outcome) -> Generator[str, None, None]:
        """Run a job, yielding the answer one token piece at a time, and fill ``outcome``.

        Holds the generation lock until exhausted or closed. A job with nothing to answer
        only loads the model, as Ollama does (``done_reason`` ``"load"``).
        """
        with self._generate_lock:
            llm, outcome.load_duration = self._load()
            started = time.perf_counter_ns()
            if job.messages:
                stream: Any = llm.create_chat_completion(
                    messages=cast(Any, job.messages),
                    stream=True,
                    grammar=job.grammar,
                    **job.sampling,
                )
            elif job.raw_prompt is not None:
                stream = llm.create_completion(job.raw_prompt, stream=True, grammar=job.grammar, **job.sampling)
            else:
                outcome.done_reason = "load"
                return
            chunks = cast(Generator[dict[str, Any], None, None], stream)
            first_piece_at = 0
            try:
                for chunk in chunks:
                    choice = chunk["choices"][0]
                    piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
                    if choice["finish_reason"]:
                        outcome.done_reason = choice["finish_reason"]
                    if piece:
                        first_piece_at = first_piece_at or time.perf_counter_ns()
                        yield piece
                    if self._stopping.is_set():
                        break
            finally:
                chunks.close()
            finished = time.perf_counter_ns()
            first_piece_at = first_piece_at or finished
            outcome.prompt_eval_count = llm.prompt_tokens
            outcome.prompt_eval_duration = first_piece_at - started
            outcome.eval_count = llm.sampled_tokens
            outcome.eval_duration = finished - first_piece_at


class _HTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that knows the ``OllamaServer`` it serves for."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], owner: OllamaServer) -> None:
        self.owner = owner
        super().__init__(address, handler)


class _Handler(BaseHTTPRequestHandler):
    """Answers one connection's requests the way Ollama does."""

    protocol_version = "HTTP/1.1"
    server_version = "ollama-test-server"

    @property
    def owner(self) -> OllamaServer:
        return cast(_HTTPServer, self.server).owner

    def setup(self) -> None:
        super().setup()
        with self.owner._connections_lock:
            self.owner._connections.add(self.connection)

    def finish(self) -> None:
        with self.owner._connections_lock:
            self.owner._connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: tests read ``OllamaServer.requests`` instead of an access log."""

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        self.owner.requests.append((path, {}))
        if path == "/":
            self._send(HTTPStatus.OK, b"Ollama is running", "text/plain; charset=utf-8")
        elif path == "/api/version":
            self._send_json(HTTPStatus.OK, {"version": OLLAMA_VERSION})
        elif path == "/api/tags":
            self._send_json(HTTPStatus.OK, {"models": [self.owner._model_entry()]})
        else:
            self._send(HTTPStatus.NOT_FOUND, b"404 page not found", "text/plain; charset=utf-8")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as exc:
            self.owner.requests.append((path, {}))
            self._send_json(HTTPStatus.BAD_REQUEST, {"error": f"invalid JSON body: {exc}"})
            return
        self.owner.requests.append((path, body))
        try:
            if not isinstance(body, dict):
                raise _RequestError(HTTPStatus.BAD_REQUEST, "request body must be a JSON object")
            if path == "/api/show":
                self._send_json(HTTPStatus.OK, self.owner._show(body))
            elif path in ("/api/chat", "/api/generate"):
                self._generation(body, chat=path == "/api/chat")
            else:
                self._send(HTTPStatus.NOT_FOUND, b"404 page not found", "text/plain; charset=utf-8")
        except _RequestError as exc:
            self._send_json(exc.status, {"error": exc.message})

    def _generation(self, body: dict[str, Any], chat: bool) -> None:
        mode = self.owner.mode
        if mode == "hang":
            self.close_connection = True
            self.owner._stopping.wait()
            return
        if mode == "garbage":
            self._send(HTTPStatus.OK, b"<html>this is not JSON", "application/json")
            return
        if mode == "error500":
            self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "simulated server error"})
            return
        job = self.owner._plan(body, chat)
        model = str(body["model"])
        outcome = _Outcome()
        started = time.perf_counter_ns()
        pieces = self._recorded(self.owner._pieces(job, outcome), "/api/chat" if chat else "/api/generate")
        try:
            if body.get("stream", True):
                try:
                    first = next(pieces, None)
                except Exception as exc:
                    self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(exc)})
                    return
                self._stream(model, chat, first, pieces, outcome, started)
            else:
                try:
                    text = "".join(pieces)
                except Exception as exc:
                    self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(exc)})
                    return
                self._send_json(HTTPStatus.OK, self._final(model, chat, text, outcome, started))
        finally:
            pieces.close()

    def _recorded(self, pieces: Generator[str, None, None], path: str) -> Generator[str, None, None]:
        """``pieces``, with the whole text added to ``OllamaServer.replies`` once they are exhausted."""
        text: list[str] = []
        try:
            for piece in pieces:
                text.append(piece)
                yield piece
        finally:
            pieces.close()
        self.owner.replies.append((path, "".join(text)))

    def _stream(
        self,
        model: str,
        chat: bool,
        first: str | None,
        pieces: Iterator[str],
        outcome: _Outcome,
        started: int,
    ) -> None:
        """Send newline-delimited JSON, one object per piece, then the ``done`` object."""
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            if first is not None:
                self._write_chunk(self._partial(model, chat, first))
                for piece in pieces:
                    self._write_chunk(self._partial(model, chat, piece))
            final = self._final(model, chat, "", outcome, started)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return
        except Exception as exc:
            final = {"error": str(exc)}
        try:
            self._write_chunk(final)
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    @staticmethod
    def _partial(model: str, chat: bool, piece: str) -> dict[str, Any]:
        content: dict[str, Any] = {"message": {"role": "assistant", "content": piece}} if chat else {"response": piece}
        return {"model": model, "created_at": _timestamp(), **content, "done": False}

    @classmethod
    def _final(cls, model: str, chat: bool, text: str, outcome: _Outcome, started: int) -> dict[str, Any]:
        return {
            **cls._partial(model, chat, text),
            "done": True,
            "done_reason": outcome.done_reason,
            "total_duration": time.perf_counter_ns() - started,
            "load_duration": outcome.load_duration,
            "prompt_eval_count": outcome.prompt_eval_count,
            "prompt_eval_duration": outcome.prompt_eval_duration,
            "eval_count": outcome.eval_count,
            "eval_duration": outcome.eval_duration,
        }

    def _write_chunk(self, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def _send_json(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        self._send(status, json.dumps(payload, ensure_ascii=False).encode(), "application/json; charset=utf-8")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
