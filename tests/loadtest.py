"""A bounded load test against a running server: concurrent clients, a fixed list of queries, then it stops.

Used by ``benchmarks/bench_server.py`` (figures) and the test suite (no errors, no
cross-talk). Each query carries a unique suffix, so that every answer's trace can be
checked against the query that was sent.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import httpx
import numpy as np


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Outcome:
    """One request of the load test."""

    sent: str
    status: int
    seconds: float
    action: Optional[str] = None
    echoed: Optional[str] = None
    error: Optional[str] = None

    @property
    def cross_talk(self) -> bool:
        """The answer's trace is for another query than the one sent."""
        return self.status == 200 and self.echoed != self.sent


@dataclass
class LoadResult:
    """Every outcome of one load test, and its wall time."""

    outcomes: List[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def errors(self) -> List[Outcome]:
        return [o for o in self.outcomes if o.status != 200]

    def summary(self) -> Dict[str, Any]:
        """Throughput, and p50 / p95 latency overall and per action (milliseconds)."""
        ok = [o for o in self.outcomes if o.status == 200]
        rows: Dict[str, Any] = {
            "queries": len(self.outcomes),
            "errors": len(self.errors),
            "cross_talk": sum(o.cross_talk for o in self.outcomes),
            "seconds": round(self.seconds, 2),
            "queries_per_s": round(len(ok) / self.seconds, 2) if self.seconds else 0.0,
            "all": _percentiles([o.seconds for o in ok]),
        }
        for action in sorted({o.action for o in ok if o.action}):
            rows[action] = _percentiles([o.seconds for o in ok if o.action == action])
        return rows


def _percentiles(seconds: Sequence[float]) -> Dict[str, float]:
    if not seconds:
        return {"n": 0, "p50_ms": 0.0, "p95_ms": 0.0}
    values = np.asarray(seconds) * 1000.0
    return {
        "n": len(values),
        "p50_ms": round(float(np.percentile(values, 50)), 1),
        "p95_ms": round(float(np.percentile(values, 95)), 1),
    }


def run_load(
    url: str, questions: Sequence[str], total: int, concurrency: int = 50, api_key: Optional[str] = None
) -> LoadResult:
    """Send ``total`` queries (the questions in turn, each made unique) from ``concurrency`` clients at once."""
    asked = [f"{questions[i % len(questions)]} (#{i})" for i in range(total)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def ask(query: str) -> Outcome:
        started = time.monotonic()
        try:
            with httpx.Client(timeout=300, headers=headers) as client:
                reply = client.post(url.rstrip("/") + "/query", json={"query": query})
            body = reply.json()
        except (httpx.HTTPError, ValueError) as exc:
            return Outcome(query, 0, time.monotonic() - started, error=f"{type(exc).__name__}: {exc}")
        elapsed = time.monotonic() - started
        if reply.status_code != 200:
            return Outcome(query, reply.status_code, elapsed, error=str(body.get("error")))
        return Outcome(query, 200, elapsed, body.get("action"), (body.get("crag") or {}).get("query"))

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outcomes = list(pool.map(ask, asked))
    return LoadResult(outcomes, time.monotonic() - started)


class ServerProcess:
    """``llama-crag serve`` in a child process (its own session, so that its workers stop with it)."""

    def __init__(self, index: str, port: int, workers: int = 1, extra: Sequence[str] = ()) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._command = [
            sys.executable, "-m", "llama_index_crag.cli", "serve", "--index", index, "--port", str(port),
            "--workers", str(workers), "--log-level", "warning", *extra,
        ]  # fmt: skip
        self._process: Optional[subprocess.Popen[bytes]] = None

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self._process = subprocess.Popen(self._command, env=env, start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"llama-crag serve exited with {self._process.returncode}: {self._command}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError("llama-crag serve did not become ready in 300 s")

    def __exit__(self, *exc: Any) -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()

    def memory_mb(self) -> List[float]:
        """Resident memory (MiB) of each process of the server: the supervisor and its workers (Linux)."""
        if self._process is None:
            return []
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) != self._process.pid:  # the process group: the server and its workers
                    continue
                status = (stat.parent / "status").read_text()
            except (OSError, IndexError, ValueError):
                continue  # it exited meanwhile
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    found.append(round(int(line.split()[1]) / 1024.0, 1))
        return sorted(found)

    def metrics(self) -> Iterator[str]:
        yield from httpx.get(self.url + "/metrics", timeout=30).text.splitlines()
