"""ASGI middleware of the server: the request body limit, and the per-route request metrics."""

from __future__ import annotations

import time
from typing import Any, Dict

from llama_index_crag.server.errors import ApiError
from llama_index_crag.server.metrics import ServerMetrics

Scope = Dict[str, Any]


class BodyLimit:
    """Refuse a request body over ``limit`` bytes with 413, declared or streamed."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)  # no body is read: the app's receive stays untouched
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = ApiError(413, "body_too_large", f"the request body is over the limit of {self.limit:,} bytes")
        try:
            if declared is not None and int(declared) > self.limit:
                await too_big.response()(scope, receive, send)
                return
        except ValueError:
            await ApiError(400, "bad_content_length", "the Content-Length header is not a number").response()(
                scope, receive, send
            )
            return
        # Read the whole body first (it is small by design), counting as it comes: a chunked body without a
        # Content-Length meets the same limit, and the app never sees a body it would have to refuse half-read.
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await too_big.response()(scope, receive, send)
                return
        replayed = False

        async def replay() -> Dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class RequestMetrics:
    """Count each HTTP request by route and status, timed until its response starts (a stream: until handed over)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, responded = time.monotonic(), False

        async def counted(message: Dict[str, Any]) -> None:
            nonlocal responded
            if message["type"] == "http.response.start":
                responded = True
                self.metrics.request(scope["path"], message["status"], time.monotonic() - started)
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            # A crash is answered (500) by Starlette's outermost middleware, outside this one: count it here.
            if not responded:
                self.metrics.request(scope["path"], 500, time.monotonic() - started)
            raise
