"""``POST /v1/chat/completions``: OpenAI's chat format over the engine, so existing clients and SDKs use it as a model;
``GET /v1/models``, which clients (chat UIs, ``client.models.list()``) ask before they chat, lists it.

The last user message is the question (the route is single-turn), an abstention is an
ordinary assistant message, and the trace travels in the extra ``crag`` field beside
``sources`` (in a stream, on the last chunk). An extra top-level ``filters`` field narrows the
key's scope as ``POST /query``'s does (the SDK's ``extra_body``); ``metadata`` is OpenAI's map of
strings, so filters there are refused rather than ignored. ``usage`` counts the question and the
answer (``QueryService.count_tokens``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional

from fastapi import APIRouter, Depends
from sse_starlette import EventSourceResponse

from llama_index_crag.server.auth import CallerOf, require_api_key
from llama_index_crag.server.errors import ApiError
from llama_index_crag.server.schemas import (
    ERROR_RESPONSES,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatRequest,
    Model,
    ModelList,
    Usage,
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
async def chat(body: ChatRequest, service: Service, caller: CallerOf) -> Any:
    """Answer the last user message as a chat completion within the caller's scope, streamed or not."""
    if isinstance(body.metadata, dict) and "filters" in body.metadata:
        raise ApiError(
            422,
            "invalid_filters",
            "metadata.filters: put filters at the top level of the request (extra_body={'filters': {...}} in "
            "OpenAI's SDK); metadata is a map of strings and is not read",
        )
    scope = service.scope(caller, body.filters)
    text = service.check(chat_query(body), "the last user message")
    started = time.monotonic()
    deadline = service.deadline()
    response = await service.run(text, False, body.stream, deadline, scope)
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    model = service.config.model_name
    if not body.stream:
        result = service.record(caller, text, answer_text(response), response, started)
        return ChatCompletion(
            id=completion_id,
            created=created,
            model=model,
            choices=[ChatChoice(message=AssistantMessage(content=result.answer))],
            usage=usage(service, text, result.answer),
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
        result = service.record(caller, text, "".join(parts), response, started)
        sources = [s.model_dump() for s in result.sources]
        counted = usage(service, text, result.answer).model_dump()
        yield chunk({}, "stop", usage=counted, crag=result.crag, sources=sources)
        yield {"data": "[DONE]"}

    return EventSourceResponse(chunks())


def usage(service: Any, question: str, answer: str) -> Usage:
    """The question's and the answer's token counts (the passages the engine gave the generator are not counted)."""
    prompt, completion = service.count_tokens(question), service.count_tokens(answer)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


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
