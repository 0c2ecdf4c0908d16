"""Errors answered as JSON in OpenAI's shape, ``{"error": {"type", "code", "message"}}``, and the app's handlers."""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, Dict, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("llama_index_crag.server")


class ApiError(Exception):
    """An error answered as JSON with its HTTP status."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        kind: str = "invalid_request_error",
        headers: Optional[Dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.kind = status, code, message, kind
        self.headers = dict(headers or {})  # what HTTP asks of the status: Allow on a 405, WWW-Authenticate on a 401

    @classmethod
    def mid_stream(cls, exc: Exception) -> ApiError:
        """What a failure after the stream began is reported as (its status line is already sent)."""
        return exc if isinstance(exc, ApiError) else cls(503, "generator_failed", str(exc), "server_error")

    def body(self) -> Dict[str, Any]:
        return {"error": {"type": self.kind, "code": self.code, "message": self.message}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


#: What FastAPI says of a body its JSON decoder raised on with anything but a decode error.
UNPARSABLE_BODY = "There was an error parsing the body"


def add_error_handlers(app: FastAPI, unauthorized: Callable[[Request], Awaitable[Optional[ApiError]]]) -> None:
    """Answer every error as JSON in OpenAI's shape: ours, FastAPI's validation, Starlette's 404 / 405, crashes.

    ``unauthorized`` gives the 401 for a request that lacks the API key on a guarded route (``auth.unauthorized``):
    FastAPI reads and validates a body before the route's key dependency runs, so the body's errors ask it first.
    """

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        refused = await unauthorized(request)  # a request without the key learns nothing of what its body lacks
        if refused is not None:
            return refused.response()
        problems = []
        for error in exc.errors():
            if error.get("type") == "json_invalid":  # its loc is ("body", offset), which reads as a field
                reason = (error.get("ctx") or {}).get("error", "")
                problems.append(
                    f"body: not valid JSON at character {error['loc'][-1]}" + (f" ({reason})" if reason else "")
                )
                continue
            where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
            problems.append(f"{where}: {error.get('msg')}")
        return ApiError(422, "invalid_request", "; ".join(problems) or "the request body is not valid").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == UNPARSABLE_BODY:  # not UTF-8, nested too deep, another charset
            refused = await unauthorized(request)
            if refused is not None:
                return refused.response()
            return ApiError(422, "invalid_request", "body: not readable as JSON (send UTF-8 JSON)").response()
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return ApiError(exc.status_code, code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        caller = getattr(request.state, "caller", None)  # the key's name, never the key
        log.exception("%s %s%s failed", request.method, request.url.path, f" by {caller}" if caller else "")
        return ApiError(500, "internal_error", f"{type(exc).__name__}: {exc}", "server_error").response()
