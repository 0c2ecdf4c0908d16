"""A real uvicorn server on a free loopback port, in a background thread, for tests that need HTTP on a socket."""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any, Optional

import uvicorn

from tests.loadtest import free_port


class LiveServer:
    """``with LiveServer(app) as server: httpx.get(server.url + "/healthz")``."""

    def __init__(self, app: Any, port: Optional[int] = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True, name="live-server")

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the test server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def __exit__(
        self, kind: Optional[type[BaseException]], value: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
