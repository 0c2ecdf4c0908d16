"""Run a ``llama-crag serve`` command until it is healthy, ask it one question, and stop it.

``python tests/docs_serve.py llama-crag serve --index my-index`` is how the docs' examples run a server: the
command would otherwise serve forever. It exits non-zero when the server exits early, never becomes healthy,
or does not answer the question with a 200. Standard library only, so it runs in any virtualenv.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Dict, Iterator, List, Optional

QUESTION = "Who is the chief executive officer of Harbor Analytics?"


def _port(command: List[str]) -> int:
    for i, word in enumerate(command):
        if word == "--port":
            return int(command[i + 1])
        if word.startswith("--port="):
            return int(word.split("=", 1)[1])
    return 8000


@contextlib.contextmanager
def serving(command: List[str], env: Optional[Dict[str, str]] = None, timeout_s: float = 600) -> Iterator[str]:
    """Start ``command`` in its own process group, wait for ``/healthz`` to answer 200, yield the base URL."""
    url = f"http://127.0.0.1:{_port(command)}"
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{' '.join(command)} exited with {process.returncode} before it was healthy")
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(command)} was not healthy at {url}/healthz within {timeout_s:.0f} s")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def ask(url: str, question: str = QUESTION) -> Dict[str, object]:
    request = urllib.request.Request(
        url + "/query", data=json.dumps({"query": question}).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        assert reply.status == 200, reply.status
        return json.load(reply)


def main(command: List[str]) -> int:
    with serving(command, timeout_s=float(os.environ.get("CRAG_DOCS_SERVE_TIMEOUT", "600"))) as url:
        answer = ask(url)
    print(f"{' '.join(command)}: {answer['action']}, abstained={answer['abstained']}: {str(answer['answer'])[:120]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
