"""CorrectiveRetriever in stock chat engines, the engine built on it, and what tracing tools see of each step."""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List, Optional

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler
from llama_index.core.chat_engine import CondensePlusContextChatEngine, ContextChatEngine
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler
from llama_index.core.schema import QueryBundle
from llama_index.core.settings import Settings

from llama_index_crag import CorrectiveQueryEngine, CorrectiveRetriever
from llama_index_crag.core.loop import StepRecord
from llama_index_crag.core.retriever import ABSTAINED_KEY, TRACE_KEY

from .conftest import ALPHA, BETA, GAMMA, REWRITE_MARKER, Answering, MarkerScorer, ScriptedLLM, make_engine

CEO = "Who is the CEO of Harbor Analytics?"
MOBY_DICK = "Who wrote the novel Moby-Dick?"


class Recording(ScriptedLLM):
    """A scripted LLM that keeps every prompt it is sent that is not a query rewrite, and answers it "noted"."""

    prompts: List[str] = []

    def _text(self, prompt: str) -> str:
        if REWRITE_MARKER in prompt:
            return super()._text(prompt)
        self.prompts.append(prompt)
        return "noted"


@pytest.fixture(scope="module")
def corrective(sample_index: VectorStoreIndex) -> CorrectiveRetriever:
    return CorrectiveRetriever.from_defaults(index=sample_index, llm=ScriptedLLM())


def chat_engines(retriever: CorrectiveRetriever, llm: Recording) -> Dict[str, Any]:
    return {
        "condense_plus_context": CondensePlusContextChatEngine.from_defaults(retriever=retriever, llm=llm),
        "context": ContextChatEngine.from_defaults(retriever=retriever, llm=llm),
    }


@pytest.mark.parametrize("mode", ["condense_plus_context", "context"])
def test_a_chat_engine_answers_from_the_graded_evidence(corrective: CorrectiveRetriever, mode: str) -> None:
    llm = Recording()
    chat_engines(corrective, llm)[mode].chat(CEO)
    [prompt] = llm.prompts
    assert "Miriam Okafor, who serves as chief executive officer" in prompt
    assert "crag" not in prompt.casefold(), "the trace in the nodes' metadata is hidden from the LLM"


@pytest.mark.parametrize("mode", ["condense_plus_context", "context"])
def test_a_chat_engine_is_told_the_documents_do_not_answer_and_sees_no_rejected_passage(
    corrective: CorrectiveRetriever, mode: str
) -> None:
    llm = Recording()
    chat_engines(corrective, llm)[mode].chat(MOBY_DICK)
    [prompt] = llm.prompts
    assert "The documents available do not answer this question: after 1 rewrite(s)" in prompt
    rejected = corrective.retriever.retrieve(MOBY_DICK) + corrective.fallback.retrieve(MOBY_DICK)  # type: ignore[union-attr]
    assert rejected
    for candidate in rejected:
        for line in candidate.node.get_content().splitlines():
            assert len(line) < 30 or line not in prompt


def test_an_abstention_is_one_marked_node_whose_trace_says_why(corrective: CorrectiveRetriever) -> None:
    [node] = corrective.retrieve(MOBY_DICK)
    trace = node.node.metadata[TRACE_KEY]
    assert node.node.metadata[ABSTAINED_KEY] is True and trace["abstained"] and trace["action"] == "incorrect"
    assert trace["abstain_reason"] in node.node.get_content()
    assert node.node.get_content().endswith("Say that you do not know.")


def test_kept_evidence_is_scored_with_its_grade_and_carries_the_trace(corrective: CorrectiveRetriever) -> None:
    nodes = corrective.retrieve(CEO)
    trace = nodes[0].node.metadata[TRACE_KEY]
    assert trace["action"] == "correct" and not trace["abstained"]
    grades = {n["node_id"]: n["score"] for n in trace["nodes"]}
    assert [round(n.score or 0.0, 4) for n in nodes] == [grades[n.node.node_id] for n in nodes]
    assert all(n.node.metadata.get(ABSTAINED_KEY) is None for n in nodes)
    stored = corrective.retriever.retrieve(CEO)[0].node
    assert TRACE_KEY not in stored.metadata, "the index's own nodes are left as they were"


def test_engine_retrieve_is_the_corrective_retrievers_output(sample_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index)
    assert isinstance(engine.retriever, CorrectiveRetriever)
    for question in (CEO, MOBY_DICK):
        ours = engine.retrieve(QueryBundle(question))
        awaited = asyncio.run(engine.aretrieve(QueryBundle(question)))
        theirs = engine.retriever.retrieve(question)
        for nodes in (awaited, theirs):
            assert [(n.node.get_content(), n.score) for n in nodes] == [(n.node.get_content(), n.score) for n in ours]


class StepSpans(SimpleSpanHandler):
    """Keeps what each corrective step span reported on exit."""

    steps: List[StepRecord] = []

    def prepare_to_exit_span(
        self, id_: str, bound_args: Any, instance: Optional[Any] = None, result: Optional[Any] = None, **kwargs: Any
    ) -> Any:
        if id_.startswith("CorrectiveStep."):
            self.steps.append(result)
        return super().prepare_to_exit_span(id_, bound_args, instance, result, **kwargs)


@pytest.fixture
def spans() -> Any:
    handler = StepSpans()
    root = get_dispatcher()
    root.add_span_handler(handler)
    yield handler
    root.span_handlers.remove(handler)


BRANCHES = {
    "correct": ({"alpha project budget for 2024": 0.9}, [ALPHA, BETA], ["grade", "quote"]),
    "ambiguous": ({"alpha project budget was discussed": 0.5, "porto": 0.4}, [GAMMA], ["grade", "refine", "quote"]),
    "incorrect": (
        {"alpha project budget for 2024": 0.9},
        [BETA],
        ["grade", "rewrite", "fallback", "regrade", "quote"],
    ),
}


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("branch", sorted(BRANCHES))
def test_each_step_is_one_span_with_its_outcome(spans: StepSpans, branch: str, is_async: bool) -> None:
    markers, primary, steps = BRANCHES[branch]
    engine = make_engine(
        MarkerScorer(markers), ScriptedLLM(), primary=primary, answer_mode="extract", strip_min_tokens=4
    )
    response = (
        asyncio.run(engine.aquery("What is the alpha project budget?"))
        if is_async
        else engine.query("What is the alpha project budget?")
    )
    assert [s.step for s in spans.steps] == steps
    grade = spans.steps[0]
    assert grade.outcome == branch and grade.sizes["candidates"] == len(primary)
    assert spans.steps[-1].outcome == "quoted" and spans.steps[-1].sizes["quotes"] >= 1
    assert response.metadata["crag"]["action"] == branch
    by_id = {s.id_: s for s in spans.completed_spans}
    for span in spans.completed_spans:
        if span.id_.startswith("CorrectiveStep."):
            assert by_id[span.parent_id].id_.startswith("CorrectiveQueryEngine._") and span.tags["crag.step"]


def test_a_generated_answer_is_checked_in_its_own_span(spans: StepSpans) -> None:
    llm = Answering(answer="The alpha project budget for 2024 is 3.2 million euros.")
    engine = make_engine(MarkerScorer({"alpha project budget for 2024": 0.9}), llm, primary=[ALPHA])
    engine.query("What is the alpha project budget?")
    assert [(s.step, s.outcome) for s in spans.steps] == [("grade", "correct"), ("check", "grounded")]


def test_a_callback_manager_set_after_the_engine_is_built_gets_the_events() -> None:
    engine = make_engine(MarkerScorer({"alpha project budget for 2024": 0.9}), ScriptedLLM(), primary=[ALPHA])
    debug = LlamaDebugHandler()
    engine.callback_manager = CallbackManager([debug])
    engine.query("What is the alpha project budget?")
    assert [len(debug.get_event_pairs(kind)) for kind in (CBEventType.QUERY, CBEventType.RETRIEVE)] == [1, 1]


def test_the_stock_callback_events_come_in_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    debug = LlamaDebugHandler()
    monkeypatch.setattr(Settings, "_callback_manager", CallbackManager([debug]))
    engine = make_engine(MarkerScorer({"alpha project budget for 2024": 0.9}), ScriptedLLM(), primary=[ALPHA])
    response = engine.query("What is the alpha project budget?")
    [query] = debug.get_event_pairs(CBEventType.QUERY)
    assert query[0].payload["query_str"] == "What is the alpha project budget?"
    assert query[1].payload["response"] is response
    assert debug.get_event_pairs(CBEventType.RETRIEVE) and debug.get_event_pairs(CBEventType.SYNTHESIZE)
    per_id: Dict[str, int] = {}
    for event in debug.get_events():
        per_id[event.id_] = per_id.get(event.id_, 0) + 1
    assert set(per_id.values()) == {2}, "every start event has its end"


class Named(BaseEventHandler):
    """Keeps every instrumentation event's class name."""

    names: List[str] = []

    def handle(self, event: Any, **kwargs: Any) -> None:
        self.names.append(event.class_name())


@pytest.mark.parametrize("is_async", [False, True])
def test_a_failed_rewrite_leaves_no_start_event_without_its_end(is_async: bool) -> None:
    events = Named()
    get_dispatcher().add_event_handler(events)
    try:
        engine = make_engine(MarkerScorer({"alpha project budget for 2024": 0.9}), ScriptedLLM(rewrite="no json here"))
        question = "How much money does project A get?"
        response = asyncio.run(engine.aquery(question)) if is_async else engine.query(question)
    finally:
        get_dispatcher().event_handlers.remove(events)
    assert response.metadata["crag"]["rewrite_source"] == "keyword"
    assert events.names.count("LLMStructuredPredictStartEvent") == 1
    for name in {n for n in events.names if n.endswith("StartEvent")}:
        assert events.names.count(name) == events.names.count(name.replace("Start", "End")), name
