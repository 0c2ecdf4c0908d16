"""``POST /v1/chat/completions``: OpenAI's chat format over the engine, so existing clients and SDKs use it as a model;
``GET /v1/models``, which clients (chat UIs, ``client.models.list()``) ask before they chat, lists it.

The last user message is the question (the route is single-turn), an abstention is an
ordinary assistant message, and the trace travels in the extra ``crag`` field beside
``sources`` (in a stream, on the last chunk).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional

from fastapi import APIRouter, Depends
from sse_starlette import EventSourceResponse

from llama_index_crag.server.auth import require_api_key
from llama_index_crag.server.errors import ApiError
from llama_index_crag.server.schemas import (
    ERROR_RESPONSES,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatRequest,
    Model,
    ModelList,
)
from llama_index_crag.server.service import Service, answer_text

router = APIRouter(dependencies=[Depends(require_api_key)])
#: When the server started: a model's ``created`` (OpenAI gives a Unix time).
STARTED = int(time.time())


def chat_query(request: ChatRequest) -> str:
    """The text of the last user message (its text parts, when the content is a list of parts)."""
    for message in reversed(request.messages):
        if message.role == "user":
            content = message.content
            if isinstance(content, list):  # content parts: keep the text ones
                parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                texts = [t for t in parts if isinstance(t, str)]
                if len(texts) < len(parts):
                    raise ApiError(400, "invalid_message", "a text part of the last user message has no string 'text'")
                content = "\n".join(texts)
            if not isinstance(content, str):
                raise ApiError(400, "invalid_message", "the last user message has no text content")
            return content
    raise ApiError(400, "no_user_message", "messages holds no message with role 'user': nothing to answer")


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={
        **ERROR_RESPONSES,
        200: {"content": {"text/event-stream": {}}, "description": "With stream: the chunks."},
    },
)
async def chat(body: ChatRequest, service: Service) -> Any:
    """Answer the last user message as a chat completion, streamed or not."""
    text = service.check(chat_query(body), "the last user message")
    started = time.monotonic()
    deadline = service.deadline()
    response = await service.run(text, False, body.stream, deadline)
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    model = service.config.model_name
    if not body.stream:
        result = service.record(text, answer_text(response), response, started)
        return ChatCompletion(
            id=completion_id,
            created=created,
            model=model,
            choices=[ChatChoice(message=AssistantMessage(content=result.answer))],
            crag=result.crag,
            sources=result.sources,
        )
    tokens, first = await service.first_token(response, deadline)

    def chunk(delta: Dict[str, Any], finish: Optional[str] = None, **extra: Any) -> Dict[str, str]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        envelope = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
        return {"data": json.dumps({**envelope, "choices": [choice], **extra})}

    async def chunks() -> AsyncIterator[Dict[str, str]]:
        parts: List[str] = []
        yield chunk({"role": "assistant"})
        try:
            async for token in service.tokens(tokens, first, deadline):
                parts.append(token)
                yield chunk({"content": token})
        except Exception as exc:
            yield {"data": json.dumps(ApiError.mid_stream(exc).body())}
            return
        result = service.record(text, "".join(parts), response, started)
        sources = [s.model_dump() for s in result.sources]
        yield chunk({}, "stop", crag=result.crag, sources=sources)
        yield {"data": "[DONE]"}

    return EventSourceResponse(chunks())


@router.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
async def models(service: Service) -> ModelList:
    """The model this server answers as: the name its chat completions carry."""
    return ModelList(data=[Model(id=service.config.model_name, created=STARTED)])


@router.get("/v1/models/{model_id:path}", response_model=Model, responses={401: ERROR_RESPONSES[401], 404: {}})
async def model(model_id: str, service: Service) -> Model:
    """The model named ``model_id``, when it is this server's."""
    if model_id != service.config.model_name:
        named = f"this server answers as {service.config.model_name!r}, not {model_id!r}"
        raise ApiError(404, "model_not_found", named)
    return Model(id=model_id, created=STARTED)
