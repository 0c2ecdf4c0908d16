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
    key: Optional[str] = request.app.state.service.config.api_key
    if not key:
        return
    given = bearer.credentials if bearer is not None else header or ""
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise ApiError(
            401,
            "unauthorized",
            "this server needs an API key: Authorization: Bearer KEY or X-API-Key",
            "authentication_error",
        )
