"""The API key every data route depends on (``Authorization: Bearer KEY`` or ``X-API-Key: KEY``), and the caller
it names: its name and the scope its queries are bounded to (``keys.py``)."""

from __future__ import annotations

from typing import Annotated, Optional, Tuple, Union

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from llama_index_crag.server.errors import ApiError
from llama_index_crag.server.keys import ANYONE, Caller

_bearer = HTTPBearer(auto_error=False, description="An API key of the server as a bearer token.")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="An API key of the server.")


def require_api_key(
    request: Request,
    bearer: Annotated[Optional[HTTPAuthorizationCredentials], Depends(_bearer)],
    header: Annotated[Optional[str], Depends(_header)],
) -> Caller:
    """The caller the request's key names (everyone, when the server has no key), or 401.

    The caller's name is kept on the request (``request.state.caller``) for the logs; the key never is.
    """
    caller, refused = _identify(request, bearer.credentials if bearer is not None else header or "")
    if refused is not None:
        raise refused
    request.state.caller = caller.name
    return caller


#: A route's parameter that receives the caller (FastAPI runs the dependency once per request, however often named).
CallerOf = Annotated[Caller, Depends(require_api_key)]


async def unauthorized(request: Request) -> Optional[ApiError]:
    """The 401 for a request to a guarded route that lacks a key, read from its headers as the dependency reads
    them (the same two security schemes).

    FastAPI reads and validates a request's body before it runs the route's dependencies, so a
    malformed body would be answered 422, with what is wrong with it, before the key is asked
    for; the error handlers ask this first.
    """
    route = request.scope.get("route")
    if not any(getattr(d, "dependency", None) is require_api_key for d in getattr(route, "dependencies", ())):
        return None
    bearer = await _bearer(request)
    return _identify(request, bearer.credentials if bearer is not None else await _header(request) or "")[1]


def _identify(request: Request, given: str) -> Tuple[Caller, Union[ApiError, None]]:
    keys = request.app.state.service.keys
    if keys is None:
        return ANYONE, None
    caller = keys.caller(given)
    if caller is not None:
        return caller, None
    refused = ApiError(
        401,
        "unauthorized",
        "this server needs an API key: Authorization: Bearer KEY or X-API-Key",
        "authentication_error",
        headers={"WWW-Authenticate": "Bearer"},
    )
    return ANYONE, refused
