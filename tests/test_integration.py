"""The engine on the sample corpus: trace, metrics, events, async concurrency, streaming, chat engines."""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any, List, Set

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from llama_index.core.chat_engine import CondenseQuestionChatEngine
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.tools import QueryEngineTool
from prometheus_client import REGISTRY

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.datasets import load_questions
from llama_index_crag.scorers import EvidenceScorer

from .conftest import ScriptedLLM

TRACE_FIELDS = {
    "action",
    "nodes",
    "aggregate_score",
    "top_score",
    "thresholds",
    "strips_kept",
    "strips_dropped",
    "rewritten_query",
    "fallback_sources",
    "abstained",
    "abstain_reason",
    "timings_ms",
    "scorer",
}


@pytest.fixture(scope="module")
def engine(sample_index: VectorStoreIndex) -> CorrectiveQueryEngine:
    return CorrectiveQueryEngine.from_defaults(index=sample_index, llm=ScriptedLLM(), fallback_sources=("bm25",))


def test_answerable_question_is_answered_with_a_full_trace(engine: CorrectiveQueryEngine) -> None:
    response = engine.query("Who is the chief executive officer of Harbor Analytics?")
    trace = response.metadata["crag"]
    assert TRACE_FIELDS <= set(trace)
    assert trace["action"] in ("correct", "ambiguous") and not trace["abstained"]
    assert "harbor-001" in [n.node.metadata["doc_id"] for n in response.source_nodes]
    assert trace["scorer"] == "evidence:all-MiniLM-L6-v2"
    assert trace["thresholds"] == {**EvidenceScorer.DEFAULT_THRESHOLDS, "aggregation": "max"}
    assert trace["strip_threshold"] == EvidenceScorer.DEFAULT_THRESHOLDS["strip_threshold"]
    assert all(n["label"] in ("correct", "ambiguous", "incorrect") for n in trace["nodes"])
    assert {"retrieve", "grade", "generate", "crag_ms"} <= set(trace["timings_ms"])
    assert trace["timings_ms"]["crag_ms"] >= trace["timings_ms"]["grade"] > 0


def test_explain_puts_why_each_candidate_scored_so_in_the_trace(
    sample_index: VectorStoreIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRAG_EXPLAIN", "true")
    explaining = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=ScriptedLLM(), fallback_sources=("bm25",))
    assert explaining.grader.explain
    trace = explaining.query("Who is the chief executive officer of Harbor Analytics?").metadata["crag"]
    assert trace["nodes"]
    for node in trace["nodes"]:
        explanation = node["explanation"]
        assert explanation["score"] == pytest.approx(node["score"], abs=1e-3)
        assert set(explanation["contributions"]) == set(explanation["features"])
    best = max(trace["nodes"], key=lambda n: n["score"])
    assert best["doc_id"] == "harbor-001" and best["explanation"]["features"]["coverage"] > 0.5
    # Off by default: the trace keeps the key, empty, and grading computes nothing more.
    monkeypatch.delenv("CRAG_EXPLAIN")
    plain = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=ScriptedLLM(), fallback_sources=("bm25",))
    nodes = plain.query("Who is the chief executive officer of Harbor Analytics?").metadata["crag"]["nodes"]
    assert nodes and all(n["explanation"] is None for n in nodes)


def test_off_topic_question_is_graded_incorrect_and_abstains(engine: CorrectiveQueryEngine) -> None:
    llm = engine.retriever.rewriter.llm  # type: ignore[union-attr]
    before = dict(llm.calls)
    response = engine.query("What is the boiling point of mercury?")
    trace = response.metadata["crag"]
    assert trace["action"] == "incorrect" and trace["abstained"]
    assert llm.calls["answer"] == before["answer"]


def test_actions_and_stage_times_reach_prometheus_once_its_handler_is_installed(engine: CorrectiveQueryEngine) -> None:
    from llama_index_crag.server.metrics import install_engine_metrics

    assert install_engine_metrics() is install_engine_metrics()  # once per process: no query counted twice

    def count(action: str) -> float:
        return REGISTRY.get_sample_value("crag_actions_total", {"action": action, "abstained": "true"}) or 0.0

    grade_before = REGISTRY.get_sample_value("crag_stage_seconds_count", {"stage": "grade"}) or 0.0
    before = count("incorrect")
    engine.query("Who won the 1998 FIFA World Cup?")
    assert count("incorrect") == before + 1
    assert REGISTRY.get_sample_value("crag_stage_seconds_count", {"stage": "grade"}) == grade_before + 1


def test_grading_and_action_are_instrumentation_events(engine: CorrectiveQueryEngine) -> None:
    seen: List[str] = []

    class Collect(BaseEventHandler):
        def handle(self, event: Any, **kwargs: Any) -> None:
            if event.class_name().startswith("Crag"):
                seen.append(event.class_name())

    handler = Collect()
    get_dispatcher().add_event_handler(handler)
    try:
        engine.query("What is the boiling point of mercury?")
    finally:
        get_dispatcher().event_handlers.remove(handler)
    assert seen[0] == "CragGradeEvent" and seen[-1] == "CragActionEvent"


async def test_twenty_concurrent_queries_keep_independent_traces(engine: CorrectiveQueryEngine) -> None:
    questions = [q.question for q in load_questions()][:20]
    responses = await asyncio.gather(*(engine.aquery(q) for q in questions))
    for question, response in zip(questions, responses):
        trace = response.metadata["crag"]
        assert trace["query"] == question
        assert str(response).startswith("I don't know") == trace["abstained"]
    sequential = [engine.query(q).metadata["crag"] for q in questions[:5]]
    for trace, response in zip(sequential, responses[:5]):
        assert trace["action"] == response.metadata["crag"]["action"]
        assert [n["node_id"] for n in trace["nodes"]] == [n["node_id"] for n in response.metadata["crag"]["nodes"]]


def test_aquery_does_not_block_the_event_loop_while_grading(sample_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=ScriptedLLM(), fallback_sources=("bm25",))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    async def run() -> Any:
        task = asyncio.create_task(ticker())
        try:
            return await engine.aquery("What is the refund policy for annual Harbor Pro plans?")
        finally:
            task.cancel()

    response = asyncio.run(run())
    grade_ms = response.metadata["crag"]["timings_ms"]["grade"]
    assert ticks >= 3, f"the loop ticked {ticks} times during {grade_ms:.0f} ms of grading"


def test_streaming_sync_and_async(sample_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(
        index=sample_index, llm=ScriptedLLM(), streaming=True, fallback_sources=("bm25",)
    )
    answered = engine.query("Who is the chief executive officer of Harbor Analytics?")
    assert isinstance(answered, StreamingResponse)
    assert len(list(answered.response_gen)) > 1 and answered.metadata["crag"]["action"] != "incorrect"
    abstained = engine.query("What is the boiling point of mercury?")
    assert isinstance(abstained, StreamingResponse) and str(abstained).startswith("I don't know")

    async def run() -> List[str]:
        response = await engine.aquery("Who is the chief executive officer of Harbor Analytics?")
        assert isinstance(response, AsyncStreamingResponse)
        return [token async for token in response.async_response_gen()]

    assert len(asyncio.run(run())) > 1


def test_condense_question_chat_engine_all_four_modes(sample_index: VectorStoreIndex) -> None:
    llm = ScriptedLLM()
    plain = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=llm, fallback_sources=("bm25",))
    streaming = CorrectiveQueryEngine.from_defaults(
        index=sample_index, llm=llm, streaming=True, fallback_sources=("bm25",)
    )
    chat = CondenseQuestionChatEngine.from_defaults(query_engine=plain, llm=llm)
    reply = chat.chat("Who is the chief executive officer of Harbor Analytics?")
    assert "ANSWER" in str(reply) and reply.sources[0].raw_output.metadata["crag"]["abstained"] is False
    chat.reset()
    assert "ANSWER" in str(asyncio.run(chat.achat("Where is the company headquartered?")))
    chat = CondenseQuestionChatEngine.from_defaults(query_engine=streaming, llm=llm)
    streamed = chat.stream_chat("Who is the chief executive officer of Harbor Analytics?")
    assert "ANSWER" in "".join(streamed.response_gen)
    chat.reset()

    async def astream() -> str:
        reply = await chat.astream_chat("Who is the chief executive officer of Harbor Analytics?")
        return "".join([token async for token in reply.async_response_gen()])

    assert "ANSWER" in asyncio.run(astream())


def test_engine_is_a_query_engine_tool(engine: CorrectiveQueryEngine) -> None:
    tool = QueryEngineTool.from_defaults(engine, name="harbor_docs", description="Harbor Analytics documents")
    output = tool.call(input="Who is the chief executive officer of Harbor Analytics?")
    assert "ANSWER" in str(output.content)
    assert output.raw_output.metadata["crag"]["action"] in ("correct", "ambiguous")


def test_grading_reuses_the_embeddings_the_index_already_holds(monkeypatch: Any) -> None:
    from llama_index_crag.datasets import load_documents
    from llama_index_crag.local.models import default_embed_model

    embed = default_embed_model()
    index = VectorStoreIndex(load_documents(), embed_model=embed)
    engine = CorrectiveQueryEngine.from_defaults(
        index=index, llm=ScriptedLLM(), embed_model=embed, fallback_sources=("bm25",)
    )
    passages: List[int] = []
    queries: List[str] = []
    embed_type = type(embed)
    batch, query = embed_type.get_text_embedding_batch, embed_type.get_query_embedding

    def counting_batch(self: Any, texts: List[str], **kwargs: Any) -> Any:
        passages.append(len(texts))
        return batch(self, texts, **kwargs)

    def counting_query(self: Any, text: str) -> Any:
        queries.append(text)
        return query(self, text)

    monkeypatch.setattr(embed_type, "get_text_embedding_batch", counting_batch)
    monkeypatch.setattr(embed_type, "get_query_embedding", counting_query)
    response = engine.query("Who is the chief executive officer of Harbor Analytics?")
    trace = response.metadata["crag"]
    assert trace["action"] == "correct" and len(trace["nodes"]) == 5
    # The retriever embedded the question once; grading embedded neither it nor any candidate again.
    assert passages == [] and len(queries) == 1


def test_a_quoted_correct_answer_runs_in_the_engine_the_loop_and_two_parts(sample_index: VectorStoreIndex) -> None:
    # The loop reads in one module: a question the grader finds CORRECT and the engine answers by quoting runs in the
    # engine's adapter, the loop (with its drivers and trace), the grader and the answer step, and in no other module
    # of the loop's own packages (the scorers and text helpers the parts use are theirs). Nine modules, once.
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index)
    question = "What is the monthly uptime SLA for Harbor Pro?"
    engine.query(question)  # lazy imports and caches out of the way
    entered: Set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith(("llama_index_crag.core.", "llama_index_crag.answers.")):
            entered.add(module)

    sys.setprofile(profile)
    threading.setprofile(profile)  # a step with a time limit runs in a thread of its own
    try:
        response = engine.query(question)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    crag = (response.metadata or {})["crag"]
    assert (crag["action"], crag["answered_by"]) == ("correct", "extract")
    assert entered == {
        "llama_index_crag.core.engine",
        "llama_index_crag.core.loop",
        "llama_index_crag.core.grader",
        "llama_index_crag.answers.extract",
    }
