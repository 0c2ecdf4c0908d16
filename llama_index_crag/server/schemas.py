"""The bodies of the server's requests and JSON responses, as pydantic models (they make ``/openapi.json``)."""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

# --- requests ---------------------------------------------------------------------------------------------------


class QueryRequest(BaseModel):
    """``POST /query``."""

    model_config = ConfigDict(extra="forbid")
    query: StrictStr = Field(description="The question.")
    explain: StrictBool = Field(default=False, description="Add the scorer's explanation of each grade.")
    stream: StrictBool = Field(default=False, description="Answer as server-sent events.")
    filters: Optional[Dict[str, Any]] = Field(
        default=None,
        description="Metadata filters that narrow the key's scope (never widen it): the {key: value} shorthand "
        "(a list value: one of) or LlamaIndex MetadataFilters JSON.",
    )


class ChatMessage(BaseModel):
    role: StrictStr
    content: Any = None


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions`` (the fields this server reads; others are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")
    model: Optional[StrictStr] = None
    messages: List[ChatMessage] = Field(min_length=1)
    stream: StrictBool = False
    filters: Optional[Dict[str, Any]] = Field(
        default=None, description="As POST /query's filters: narrows the key's scope (an extra field to OpenAI)."
    )
    metadata: Optional[Any] = Field(default=None, description="OpenAI's metadata: accepted, not read.")


# --- answers ----------------------------------------------------------------------------------------------------


class Source(BaseModel):
    """One passage the answer was given, as the console and API clients show it."""

    id: str
    doc_id: Optional[str] = None
    excerpt: str = Field(description="The start of the passage's text.")
    score: Optional[float] = None
    label: Optional[str] = Field(default=None, description="Its grade: correct, ambiguous or incorrect.")
    origin: str = Field(description="primary (the main retriever), bm25, sentence_window or web.")
    refined: bool = Field(description="An ambiguous passage reduced to its kept knowledge strips.")
    url: Optional[str] = None


class QueryResult(BaseModel):
    """The answer to ``POST /query`` (and ``GET /queries/{id}``): the answer, its sources and the whole trace."""

    id: str
    created: int
    query: str
    answer: str
    abstained: bool
    action: str
    answered_by: Optional[str] = None
    grounded: Optional[bool] = None
    sources: List[Source]
    elapsed_ms: float
    crag: Dict[str, Any] = Field(description="The decision trace (docs/trace.md).")


class RecentQuery(BaseModel):
    id: str
    created: int
    query: str
    action: str
    abstained: bool
    elapsed_ms: float
    top_score: Optional[float] = None


class RecentQueries(BaseModel):
    """``GET /recent``: the caller's last answers on this worker, newest first."""

    queries: List[RecentQuery]


class GeneratorHealth(BaseModel):
    name: str = Field(description="What generates, in a sentence.")
    label: str = Field(description="The same in a few words, for the console's header.")
    ready: bool
    detail: str


class Health(BaseModel):
    """``GET /healthz``: 200 when the generator answers, else 503 with the same body."""

    status: Literal["ok", "unavailable"]
    index: Dict[str, Any]
    generator: GeneratorHealth
    scorer: str
    thresholds: Dict[str, float]
    threads: int = Field(description="CPU threads this worker's torch models (embedding, grading) run on")


class ErrorDetail(BaseModel):
    type: str
    code: str
    message: str


class ErrorBody(BaseModel):
    """Every error, in OpenAI's shape."""

    error: ErrorDetail


# --- OpenAI's chat format ---------------------------------------------------------------------------------------


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop"] = "stop"


class Usage(BaseModel):
    """Token counts of the question (prompt) and the answer (completion): with the generator's tokenizer when it is
    llama.cpp in this process, else in words; the passages the engine put in the generator's prompt not counted."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChatCompletion(BaseModel):
    """``POST /v1/chat/completions``: OpenAI's completion, with the trace in ``crag`` and the ``sources`` beside."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Usage = Field(default_factory=Usage)
    crag: Dict[str, Any]
    sources: List[Source]


class Model(BaseModel):
    """One model as OpenAI's ``/v1/models`` lists it: this server's engine, under the name chat completions give."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llama-index-crag"


class ModelList(BaseModel):
    """``GET /v1/models``: the one model this server answers as."""

    object: Literal["list"] = "list"
    data: List[Model]


#: The errors a data route may answer, for ``/openapi.json``.
ERROR_RESPONSES: Dict[Union[int, str], Dict[str, Any]] = {
    status: {"model": ErrorBody, "description": what}
    for status, what in (
        (400, "An empty query, or one over the length limit."),
        (401, "The server has an API key and the request does not carry it."),
        (413, "The request body is over the limit."),
        (422, "A body that is not JSON, fields of the wrong type or name, or malformed filters."),
        (503, "The generator or the store cannot be reached."),
        (504, "The query ran past its time budget."),
    )
}
