"""A chat turn is answered by the corrective loop, checked as a query's answer is."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.llms import ChatMessage, MessageRole

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.core.chat import CorrectiveChatEngine, offline_condense
from llama_index_crag.errors import ConfigError

from .conftest import Answering

MOBY = "Who wrote the novel Moby-Dick?"


def _crag(response: Any) -> Any:
    return response.sources[0].raw_output.metadata["crag"]


def test_a_chat_turn_runs_the_loop_and_abstains_where_a_query_would(sample_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index)
    chat = engine.as_chat_engine()
    assert isinstance(chat, CorrectiveChatEngine)
    response = chat.chat(MOBY)
    assert str(response) == engine.settings.abstain_text
    assert _crag(response)["abstained"] and _crag(response)["action"] == "incorrect"
    answered = chat.chat("Who is the CEO of Harbor Analytics?")
    assert not _crag(answered)["abstained"] and "Quoted from the documents" in str(answered)


def test_an_unsupported_chat_answer_is_replaced_as_a_querys_would_be(sample_index: VectorStoreIndex) -> None:
    liar = Answering(answer="The CEO of Harbor Analytics is Captain Kidd, since 1851.")
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=liar, answer_mode="generate")
    query_answer = engine.query("Who is the CEO of Harbor Analytics?")
    for chat_mode in ("condense_question", "context", "condense_plus_context"):
        response = engine.as_chat_engine(chat_mode=chat_mode).chat("Who is the CEO of Harbor Analytics?")
        assert _crag(response)["grounded"] is False
        assert "Captain Kidd" not in str(response)
        assert str(response) == str(query_answer)


def test_every_context_mode_answers_through_the_loop_and_agents_are_told_the_way(
    sample_index: VectorStoreIndex,
) -> None:
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index)
    with pytest.raises(ConfigError, match="QueryEngineTool"):
        engine.as_chat_engine(chat_mode="react")


def test_a_follow_up_is_asked_with_the_question_it_leans_on() -> None:
    history = [
        ChatMessage(role=MessageRole.USER, content="Which two offices opened in 2021?"),
        ChatMessage(role=MessageRole.ASSISTANT, content="Toronto and Singapore."),
    ]
    assert offline_condense(history, "and the second one?") == "Which two offices opened in 2021? and the second one?"
    assert offline_condense(history, "Who is the CEO of Harbor Analytics?") == "Who is the CEO of Harbor Analytics?"
    assert offline_condense([], "and the second one?") == "and the second one?"


def test_a_long_history_is_bounded_and_the_turn_still_answers(sample_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index)
    history = [
        ChatMessage(role=MessageRole.USER if i % 2 == 0 else MessageRole.ASSISTANT, content=f"turn {i} " * 20)
        for i in range(200)
    ]
    chat = engine.as_chat_engine(chat_history=history)
    response = chat.chat(MOBY)
    assert str(response) == engine.settings.abstain_text
    assert len(chat.chat_history) == 202
    assert 0 < len(chat._memory.get(input=MOBY)) < 100  # the condenser reads only the newest turns


def test_streamed_and_async_chat_answer_the_same(sample_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index)
    chat = engine.as_chat_engine()
    streamed = chat.stream_chat(MOBY)
    assert "".join(streamed.response_gen) == engine.settings.abstain_text

    async def ask() -> str:
        return str(await engine.as_chat_engine().achat(MOBY))

    assert asyncio.run(ask()) == engine.settings.abstain_text


@pytest.mark.slow
def test_with_the_bundled_generator_the_moby_dick_chat_abstains(sample_index: VectorStoreIndex) -> None:
    from llama_index_crag.local.llamacpp import BundledLlamaCPP

    engine = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=BundledLlamaCPP())
    chat = engine.as_chat_engine()
    chat.chat("Who is the CEO of Harbor Analytics?")
    response = chat.chat(MOBY)  # condensed by the bundled model with the turn before, then the whole loop
    assert _crag(response)["abstained"], str(response)
    assert "Kidd" not in str(response)
