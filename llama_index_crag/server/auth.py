"""The API key every data route depends on: ``Authorization: Bearer KEY`` or ``X-API-Key: KEY``."""

from __future__ import annotations

import hmac
from typing import Annotated, Optional

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from llama_index_crag.server.errors import ApiError

_bearer = HTTPBearer(auto_error=False, description="The server's API key (CRAG_API_KEY) as a bearer token.")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="The server's API key (CRAG_API_KEY).")


def require_api_key(
    request: Request,
    bearer: Annotated[Optional[HTTPAuthorizationCredentials], Depends(_bearer)],
    header: Annotated[Optional[str], Depends(_header)],
) -> None:
    """Pass when the server has no key, or the request carries it; else 401 (compared in constant time)."""
    refused = _refusal(request, bearer.credentials if bearer is not None else header or "")
    if refused is not None:
        raise refused


async def unauthorized(request: Request) -> Optional[ApiError]:
    """The 401 for a request to a guarded route that lacks the key, read from its headers as the dependency reads
    them (the same two security schemes).

    FastAPI reads and validates a request's body before it runs the route's dependencies, so a
    malformed body would be answered 422, with what is wrong with it, before the key is asked
    for; the error handlers ask this first.
    """
    route = request.scope.get("route")
    if not any(getattr(d, "dependency", None) is require_api_key for d in getattr(route, "dependencies", ())):
        return None
    bearer = await _bearer(request)
    return _refusal(request, bearer.credentials if bearer is not None else await _header(request) or "")


def _refusal(request: Request, given: str) -> Optional[ApiError]:
    key: Optional[str] = request.app.state.service.config.api_key
    if not key or hmac.compare_digest(given.encode(), key.encode()):
        return None
    return ApiError(
        401,
        "unauthorized",
        "this server needs an API key: Authorization: Bearer KEY or X-API-Key",
        "authentication_error",
        headers={"WWW-Authenticate": "Bearer"},
    )
