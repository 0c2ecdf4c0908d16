"""``POST /query``: the answer, its sources and the whole decision trace, as JSON or as server-sent events.

The query runs within the caller's scope (its key's filters), narrowed by the request's ``filters``.
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Dict, List, Union

from fastapi import APIRouter, Depends
from sse_starlette import EventSourceResponse

from llama_index_crag.server.auth import CallerOf, require_api_key
from llama_index_crag.server.errors import ApiError
from llama_index_crag.server.schemas import ERROR_RESPONSES, QueryRequest, QueryResult
from llama_index_crag.server.service import Service, answer_text

router = APIRouter(dependencies=[Depends(require_api_key)])

STREAMED: Dict[Union[int, str], Dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {}},
        "description": "With stream: token events ({text}), then one result event, or an error event.",
    }
}


@router.post("/query", response_model=QueryResult, responses={**ERROR_RESPONSES, **STREAMED})
async def query(body: QueryRequest, service: Service, caller: CallerOf) -> Any:
    """Answer one question within the caller's scope; with ``stream``, tokens first and the result last."""
    scope = service.scope(caller, body.filters)
    text = service.check(body.query)
    started = time.monotonic()
    deadline = service.deadline()
    response = await service.run(text, body.explain, body.stream, deadline, scope)
    if not body.stream:
        return service.record(caller, text, answer_text(response), response, started)
    tokens, first = await service.first_token(response, deadline)

    async def events() -> AsyncIterator[Dict[str, Any]]:
        parts: List[str] = []
        try:
            async for token in service.tokens(tokens, first, deadline):
                parts.append(token)
                yield {"event": "token", "data": json.dumps({"text": token})}
        except Exception as exc:
            yield {"event": "error", "data": json.dumps(ApiError.mid_stream(exc).body()["error"])}
            return
        result = service.record(caller, text, "".join(parts), response, started)
        yield {"event": "result", "data": result.model_dump_json()}

    return EventSourceResponse(events())
