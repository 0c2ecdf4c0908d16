"""The loopback Ollama server works with the real llama-index Ollama client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import httpx
import pytest
from pydantic import BaseModel

pytest.importorskip("llama_cpp")

from llama_index.core.llms import ChatMessage, MessageRole  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.llms.ollama import Ollama  # noqa: E402
from ollama import Client, ResponseError  # noqa: E402

from .ollama_server import OllamaServer  # noqa: E402

MODEL = "smollm2"


class City(BaseModel):
    """A city and the country it lies in."""

    name: str
    country: str
    is_capital: bool


class Grade(BaseModel):
    """A relevance verdict, shaped like a CRAG retrieval grade."""

    relevant: Literal["yes", "no"]


@pytest.fixture(scope="module")
def server() -> Iterator[OllamaServer]:
    with OllamaServer(model_name=MODEL) as srv:
        yield srv


@pytest.fixture
def make_llm() -> Iterator[Callable[..., Ollama]]:
    """Build llama-index Ollama LLMs pointed at a server; close their HTTP clients afterwards."""
    made: list[Ollama] = []

    def make(srv: OllamaServer, model: str = MODEL, timeout: float = 60, **kwargs: Any) -> Ollama:
        llm = Ollama(model=model, base_url=srv.url, request_timeout=timeout, context_window=2048, **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.client.close()


def last_body(srv: OllamaServer, path: str) -> dict[str, object]:
    return next(body for p, body in reversed(srv.requests) if p == path)


def test_root_and_version_endpoints(server: OllamaServer) -> None:
    assert httpx.get(server.url).text == "Ollama is running"
    assert "version" in httpx.get(f"{server.url}/api/version").json()


def test_tags_and_show_parse_with_the_ollama_client(server: OllamaServer) -> None:
    with Client(host=server.url, timeout=60) as client:
        assert [m.model for m in client.list().models] == [f"{MODEL}:latest"]
        shown = client.show(MODEL)
        with pytest.raises(ResponseError) as info:
            client.show("no-such-model")
    assert shown.modelinfo is not None
    assert shown.modelinfo["llama.context_length"] == 2048
    assert info.value.status_code == 404


@pytest.mark.slow
def test_generate_endpoint(server: OllamaServer) -> None:
    with Client(host=server.url, timeout=60) as client:
        whole = client.generate(MODEL, "Say hello.", options={"num_predict": 8})
        parts = list(client.generate(MODEL, "The sky is", raw=True, stream=True, options={"num_predict": 8}))
    assert whole.done and whole.response
    assert len(parts) >= 3
    assert parts[-1].done and parts[-1].done_reason == "length" and parts[-1].eval_count == 8


@pytest.mark.slow
def test_complete(server: OllamaServer, make_llm: Callable[..., Ollama]) -> None:
    llm = make_llm(server, additional_kwargs={"num_predict": 32})
    response = llm.complete("What is the capital of France?")
    assert response.text.strip()
    body = last_body(server, "/api/chat")
    assert body["model"] == MODEL
    assert body["stream"] is False
    assert body["options"] == {"temperature": None, "num_ctx": 2048, "num_predict": 32}


@pytest.mark.slow
def test_chat_reports_usage(server: OllamaServer, make_llm: Callable[..., Ollama]) -> None:
    llm = make_llm(server, additional_kwargs={"num_predict": 32})
    response = llm.chat(
        [
            ChatMessage(role=MessageRole.SYSTEM, content="You are a helpful assistant."),
            ChatMessage(role=MessageRole.USER, content="Name a fruit."),
        ]
    )
    assert response.message.role == MessageRole.ASSISTANT
    assert response.message.content
    assert response.raw is not None
    assert response.raw["done"] is True
    assert response.raw["done_reason"] in ("stop", "length")
    assert response.raw["usage"]["prompt_tokens"] > 10
    assert 0 < response.raw["usage"]["completion_tokens"] <= 33


@pytest.mark.slow
def test_stream_chat_yields_token_deltas(server: OllamaServer, make_llm: Callable[..., Ollama]) -> None:
    llm = make_llm(server, additional_kwargs={"num_predict": 24})
    chunks = list(llm.stream_chat([ChatMessage(role=MessageRole.USER, content="Tell me a story.")]))
    deltas = [c.delta for c in chunks if c.delta]
    assert len(deltas) >= 3
    assert chunks[-1].message.content == "".join(deltas)
    assert chunks[-1].raw is not None
    assert chunks[-1].raw["done"] is True
    assert chunks[-1].raw["done_reason"] == "length"
    assert chunks[-1].raw["eval_count"] == 24
    assert last_body(server, "/api/chat")["stream"] is True


@pytest.mark.slow
@pytest.mark.asyncio
async def test_async_complete_and_stream_chat(server: OllamaServer, make_llm: Callable[..., Ollama]) -> None:
    llm = make_llm(server, additional_kwargs={"num_predict": 16})
    completions = await asyncio.gather(*(llm.acomplete(f"Say {word}.") for word in ("hello", "yes", "no")))
    stream = await llm.astream_chat([ChatMessage(role=MessageRole.USER, content="Say hi.")])
    deltas = [chunk.delta async for chunk in stream if chunk.delta]
    await llm.async_client.close()
    assert all(c.text.strip() for c in completions)
    assert len(deltas) >= 2


@pytest.mark.slow
def test_seeded_generation_is_reproducible(server: OllamaServer, make_llm: Callable[..., Ollama]) -> None:
    llm = make_llm(server, additional_kwargs={"num_predict": 12})
    first = llm.complete("Write a word.").text
    assert llm.complete("Write a word.").text == first


@pytest.mark.slow
def test_stop_option_is_honoured(server: OllamaServer, make_llm: Callable[..., Ollama]) -> None:
    llm = make_llm(server, temperature=0.0, additional_kwargs={"num_predict": 64, "stop": ["2"]})
    text = llm.complete("Count from 1 to 10, separated by commas.").text
    assert text.startswith("1")
    assert "2" not in text


@pytest.mark.slow
def test_structured_predict_returns_valid_instance(server: OllamaServer, make_llm: Callable[..., Ollama]) -> None:
    llm = make_llm(server)
    city = llm.structured_predict(City, PromptTemplate("Describe the city of {city} as JSON."), city="Paris")
    # What the project guarantees is a valid instance; what a 135M model writes in it varies with the CPU build.
    assert isinstance(city, City)
    assert last_body(server, "/api/chat")["format"] == City.model_json_schema()

    grade = llm.structured_predict(
        Grade,
        PromptTemplate("Is this document relevant to '{q}'? Document: {doc}"),
        q="capital of France",
        doc="Paris is the capital of France.",
    )
    assert grade.relevant in ("yes", "no")


@pytest.mark.slow
def test_json_mode_returns_json(server: OllamaServer, make_llm: Callable[..., Ollama]) -> None:
    llm = make_llm(server, json_mode=True)
    text = llm.complete("Return a JSON object with keys name and color for a cat.").text
    assert isinstance(json.loads(text), dict)
    assert last_body(server, "/api/chat")["format"] == "json"


def test_unknown_model_is_a_404(server: OllamaServer, make_llm: Callable[..., Ollama]) -> None:
    with pytest.raises(ResponseError) as info:
        make_llm(server, model="no-such-model").complete("hi")
    assert info.value.status_code == 404
    assert info.value.error == "model 'no-such-model' not found"


def test_hang_mode_times_out_and_shuts_down(make_llm: Callable[..., Ollama]) -> None:
    srv = OllamaServer(model_name=MODEL, mode="hang").start()
    try:
        started = time.monotonic()
        with pytest.raises(httpx.TimeoutException):
            make_llm(srv, timeout=2).complete("hi")
        assert time.monotonic() - started < 5
        assert [path for path, _ in srv.requests] == ["/api/chat"]
    finally:
        started = time.monotonic()
        srv.stop()
        assert time.monotonic() - started < 2


def test_garbage_mode_is_not_json(make_llm: Callable[..., Ollama]) -> None:
    with OllamaServer(model_name=MODEL, mode="garbage") as srv:
        with pytest.raises(json.JSONDecodeError):
            make_llm(srv).complete("hi")
        with pytest.raises(json.JSONDecodeError):
            list(make_llm(srv).stream_complete("hi"))


def test_error500_mode_raises_response_error(make_llm: Callable[..., Ollama]) -> None:
    with OllamaServer(model_name=MODEL, mode="error500") as srv:
        with pytest.raises(ResponseError) as info:
            make_llm(srv).complete("hi")
        assert info.value.status_code == 500
