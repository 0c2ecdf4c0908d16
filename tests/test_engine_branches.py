"""The three branches of the corrective loop and every way the correction path abstains."""

from __future__ import annotations

import time
from typing import Any, List

import pytest
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import PromptTemplate
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from llama_index_crag import CorrectiveQueryEngine, FallbackRetriever
from llama_index_crag.deadline import step_deadline
from llama_index_crag.errors import ConfigError
from llama_index_crag.scorers import UpstreamScoreScorer

from .conftest import ALPHA, BETA, GAMMA, MarkerScorer, ScriptedLLM, make_engine

QUESTION = "What is the alpha project budget?"
ABSTAIN = "I don't know"


def crag(response: Any) -> dict:
    return response.metadata["crag"]


def test_correct_branch_generates_once_with_no_other_model_call(scripted_llm: ScriptedLLM) -> None:
    scorer = MarkerScorer({"alpha project budget for 2024": 0.9})
    engine = make_engine(scorer, scripted_llm, primary=[ALPHA, BETA])
    response = engine.query(QUESTION)
    trace = crag(response)
    assert trace["action"] == "correct"
    assert scripted_llm.calls == {"answer": 1, "rewrite": 0}
    assert scorer.calls == 1
    assert [n.node.node_id for n in response.source_nodes] == ["alpha"]
    assert "3.2 million" in str(response)


class CountingReranker(BaseNodePostprocessor):
    """An upstream reranker that puts probabilities on nodes and counts its calls."""

    calls: int = 0

    def _postprocess_nodes(self, nodes: List[NodeWithScore], query_bundle: Any = None) -> List[NodeWithScore]:
        self.calls += 1
        return [NodeWithScore(node=n.node, score=0.95 if "alpha" in n.node.get_content() else 0.02) for n in nodes]


def test_reused_reranker_scores_make_grading_free(scripted_llm: ScriptedLLM) -> None:
    reranker = CountingReranker()
    scorer = UpstreamScoreScorer.from_reranker(reranker)
    engine = make_engine(scorer, scripted_llm, primary=[BETA, ALPHA], node_postprocessors=[reranker])
    trace = crag(engine.query(QUESTION))
    assert trace["action"] == "correct"
    assert reranker.calls == 1, "the grader must not call the reranker again"
    assert scripted_llm.calls == {"answer": 1, "rewrite": 0}
    assert [n["score"] for n in trace["nodes"]] == [0.02, 0.95]


def test_fallback_results_pass_the_upstream_reranker_before_regrading(scripted_llm: ScriptedLLM) -> None:
    reranker = CountingReranker()
    engine = make_engine(
        UpstreamScoreScorer.from_reranker(reranker), scripted_llm, primary=[BETA], node_postprocessors=[reranker]
    )
    response = engine.query("How much money does project A get?")
    trace = crag(response)
    assert trace["action"] == "incorrect" and not trace["abstained"], trace["abstain_reason"]
    assert reranker.calls == 2
    assert response.source_nodes[0].node.node_id == "alpha" and response.source_nodes[0].score == 0.95


def test_ambiguous_branch_keeps_only_relevant_strips_in_document_order(scripted_llm: ScriptedLLM) -> None:
    scorer = MarkerScorer({"alpha project budget was discussed": 0.5, "porto": 0.4})
    engine = make_engine(scorer, scripted_llm, primary=[GAMMA], strip_min_tokens=4)
    response = engine.query(QUESTION)
    trace = crag(response)
    assert trace["action"] == "ambiguous"
    assert trace["strips_kept"] == 2 and trace["strips_dropped"] == 1
    [node] = response.source_nodes
    text = node.node.get_content()
    assert text.index("Porto") < text.index("alpha project budget was discussed")
    assert "cafeteria" not in text
    assert scripted_llm.calls["rewrite"] == 0


def test_ambiguous_branch_falls_back_to_original_ranking_when_no_strip_survives(scripted_llm: ScriptedLLM) -> None:
    class BatchHigh(MarkerScorer):
        def score_texts(self, query: str, texts: Any) -> List[float]:
            self.calls += 1
            return [0.5 if len(texts) == 1 else 0.1 for _ in texts]

    engine = make_engine(BatchHigh({}), scripted_llm, primary=[GAMMA], strip_min_tokens=4)
    response = engine.query(QUESTION)
    trace = crag(response)
    assert trace["action"] == "ambiguous" and trace["strips_kept"] == 0
    assert response.source_nodes[0].node.get_content() == GAMMA.get_content()
    assert not trace["abstained"]


def test_ambiguous_with_no_strip_left_can_be_treated_as_incorrect(scripted_llm: ScriptedLLM) -> None:
    class StripsLow(MarkerScorer):
        def score_texts(self, query: str, texts: Any) -> List[float]:
            if len(texts) == 1 and "gamma office" in texts[0]:
                return [0.5]  # the passage grades AMBIGUOUS, none of its strips clears the strip threshold
            return super().score_texts(query, texts)

    engine = make_engine(
        StripsLow({"alpha project budget for 2024": 0.9}),
        scripted_llm,
        primary=[GAMMA],
        strip_min_tokens=4,
        on_no_strips="incorrect",
    )
    response = engine.query(QUESTION)
    trace = crag(response)
    assert trace["action"] == "ambiguous" and trace["no_strips"] and trace["strips_kept"] == 0
    assert scripted_llm.calls["rewrite"] == 1 and trace["fallback_sources"] == ["bm25"]
    assert response.source_nodes[0].node.node_id == "alpha" and not trace["abstained"]


def test_incorrect_branch_rewrites_once_and_answers_from_the_fallback(scripted_llm: ScriptedLLM) -> None:
    scorer = MarkerScorer({"alpha project budget for 2024": 0.9})
    engine = make_engine(scorer, scripted_llm, primary=[BETA])
    response = engine.query("How much money does project A get?")
    trace = crag(response)
    assert trace["action"] == "incorrect"
    assert trace["rewritten_query"] == "alpha project budget" and trace["rewrites"] == 1
    assert trace["fallback_sources"] == ["bm25"]
    assert not trace["abstained"]
    assert response.source_nodes[0].node.node_id == "alpha"
    assert response.source_nodes[0].node.metadata["crag_source"] == "bm25"
    assert scripted_llm.calls == {"answer": 1, "rewrite": 1}


def test_the_rewrite_and_quoting_prompts_are_prompt_modules_of_the_engine(scripted_llm: ScriptedLLM) -> None:
    scorer = MarkerScorer({"budget of the alpha project": 0.9})
    engine = make_engine(scorer, scripted_llm, primary=[BETA])
    prompts = engine.get_prompts()
    assert {"rewrite:rewrite_prompt", "quoting:text_qa_template", "quoting:refine_template"} <= set(prompts)
    assert "response_synthesizer:text_qa_template" in prompts
    scripted_llm.rewrite = lambda prompt: (
        '{"query": "budget of the alpha project"}' if "Reword for search" in prompt else '{"query": "nothing"}'
    )
    engine.update_prompts(
        {"rewrite:rewrite_prompt": PromptTemplate("You rewrite search queries. Reword for search: {query}")}
    )
    trace = crag(engine.query("How much money does project A get?"))
    assert trace["rewrite_source"] == "llm" and trace["rewritten_query"] == "budget of the alpha project"
    engine.update_prompts({"quoting:text_qa_template": PromptTemplate("MINE {context_str} / {query_str}")})
    quoting = engine._quoting_synthesizer().get_prompts()["text_qa_template"]
    assert quoting.get_template().startswith("MINE"), "the web-source synthesizer uses the updated template"


def test_a_query_str_rewrite_template_reaches_the_llm_with_the_query_filled_in(scripted_llm: ScriptedLLM) -> None:
    sent: List[str] = []

    def rewrite(prompt: str) -> str:
        sent.append(prompt)
        return '{"query": "alpha project budget"}'

    scripted_llm.rewrite = rewrite
    engine = make_engine(MarkerScorer({"alpha project budget for 2024": 0.9}), scripted_llm, primary=[BETA])
    engine.update_prompts(
        {"rewrite:rewrite_prompt": PromptTemplate("You rewrite search queries. Reword for search: {query_str}")}
    )
    trace = crag(engine.query("How much money does project A get?"))
    assert trace["rewrite_source"] == "llm" and trace["rewritten_query"] == "alpha project budget"
    [prompt] = sent
    assert "Reword for search: How much money does project A get?" in prompt
    assert "{query_str}" not in prompt


@pytest.mark.parametrize(
    ("template", "named"),
    [("Reword for search: {question}", "{question}"), ("Reword {query_str} in {language}", "{language}")],
)
def test_a_rewrite_template_the_rewrite_cannot_fill_is_refused_when_set(
    scripted_llm: ScriptedLLM, template: str, named: str
) -> None:
    engine = make_engine(MarkerScorer({}), scripted_llm)
    before = engine.get_prompts()["rewrite:rewrite_prompt"]
    with pytest.raises(ConfigError, match=r"needs \{query_str\} or \{query\}") as raised:
        engine.update_prompts({"rewrite:rewrite_prompt": PromptTemplate(template)})
    assert named in str(raised.value)
    assert engine.get_prompts()["rewrite:rewrite_prompt"].get_template() == before.get_template()


def _assert_abstained(response: Any, reason: str, llm: ScriptedLLM) -> None:
    trace = crag(response)
    assert trace["abstained"], trace
    assert reason in trace["abstain_reason"]
    assert str(response).startswith(ABSTAIN)
    assert response.source_nodes == []
    assert llm.calls["answer"] == 0, "an abstention must not generate"


def test_retry_still_below_threshold_abstains() -> None:
    llm = ScriptedLLM(rewrite='{"query": "project cafeteria lunch"}')
    engine = make_engine(MarkerScorer({"alpha project budget for 2024": 0.9}), llm)
    response = engine.query("How much money does project A get?")
    _assert_abstained(response, "still below lower=0.300", llm)
    assert crag(response)["retry_score"] < 0.3


class BrokenRetriever(BaseRetriever):
    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        raise RuntimeError("index offline")


class SlowRetriever(BaseRetriever):
    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        time.sleep(3)
        return []


def test_fallback_that_raises_abstains() -> None:
    llm = ScriptedLLM()
    engine = make_engine(
        MarkerScorer({}), llm, fallback=FallbackRetriever({"broken": BrokenRetriever()}, similarity_top_k=2)
    )
    response = engine.query("How much money does project A get?")
    _assert_abstained(response, "the fallback retrieval failed: RuntimeError: index offline", llm)


class ClientTimesOut(BaseRetriever):
    """A store whose client raises its own TimeoutError at once: an outage, not the correction budget."""

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        raise TimeoutError("vector store read timed out after 2 s")

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        raise TimeoutError("vector store read timed out after 2 s")


@pytest.mark.parametrize("is_async", [False, True])
async def test_a_timeout_error_of_the_fallback_itself_is_its_failure_not_the_budget(is_async: bool) -> None:
    # Since Python 3.11 asyncio.TimeoutError is TimeoutError: the async driver took the store's own error for
    # wait_for's, and said the 30 s budget had run out, with the store's message lost.
    llm = ScriptedLLM()
    engine = make_engine(MarkerScorer({}), llm, fallback=FallbackRetriever({"remote": ClientTimesOut()}))
    question = "How much money does project A get?"
    response = await engine.aquery(question) if is_async else engine.query(question)
    said = "the fallback retrieval failed: TimeoutError: vector store read timed out after 2 s"
    _assert_abstained(response, said, llm)


@pytest.mark.parametrize("is_async", [False, True])
async def test_a_timeout_error_of_the_primary_retriever_reaches_the_caller_as_it_was(is_async: bool) -> None:
    engine = CorrectiveQueryEngine.from_defaults(
        retriever=ClientTimesOut(), llm=ScriptedLLM(), scorer=MarkerScorer({}), upper=0.7, lower=0.3
    )
    with pytest.raises(TimeoutError, match="vector store read timed out after 2 s"):
        await engine.aquery("How much money does project A get?") if is_async else engine.query("Project A?")


def test_fallback_past_the_time_budget_abstains_without_waiting_for_it() -> None:
    llm = ScriptedLLM()
    engine = make_engine(
        MarkerScorer({}),
        llm,
        fallback=FallbackRetriever({"slow": SlowRetriever()}, similarity_top_k=2),
        correction_timeout_s=0.5,
    )
    started = time.monotonic()
    response = engine.query("How much money does project A get?")
    assert time.monotonic() - started < 2.5
    _assert_abstained(response, "ran past the 0.5 s correction budget", llm)


async def test_async_fallback_past_the_time_budget_abstains() -> None:
    class AsyncSlow(BaseRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
            raise AssertionError("the async path must await _aretrieve")

        async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
            import asyncio

            await asyncio.sleep(3)
            return []

    llm = ScriptedLLM()
    engine = make_engine(
        MarkerScorer({}), llm, fallback=FallbackRetriever({"slow": AsyncSlow()}), correction_timeout_s=0.5
    )
    started = time.monotonic()
    response = await engine.aquery("How much money does project A get?")
    assert time.monotonic() - started < 2.5
    _assert_abstained(response, "ran past the 0.5 s correction budget", llm)


class DeadlineRecorder(BaseRetriever):
    """Records the deadline its step runs under, as a part that can stop early reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[Any] = []

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        self.seen.append(step_deadline())
        return []

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        self.seen.append(step_deadline())
        return []


@pytest.mark.parametrize("is_async", [False, True])
async def test_a_step_of_the_correction_path_runs_under_its_deadline(is_async: bool) -> None:
    recorder = DeadlineRecorder()
    engine = make_engine(
        MarkerScorer({}), ScriptedLLM(), fallback=FallbackRetriever({"recorder": recorder}), correction_timeout_s=5.0
    )
    if is_async:
        await engine.aquery("How much money does project A get?")
    else:
        engine.query("How much money does project A get?")
    finished = time.monotonic()
    assert recorder.seen and all(d is not None and finished < d <= finished + 5.0 for d in recorder.seen)
    assert step_deadline() is None  # set for the step only


def test_max_rewrites_caps_the_loop() -> None:
    seen: List[str] = []

    def rewrite(prompt: str) -> str:
        seen.append(prompt)
        return f'{{"query": "project cafeteria lunch {len(seen)}"}}'

    llm = ScriptedLLM(rewrite=rewrite)
    engine = make_engine(MarkerScorer({"alpha project budget for 2024": 0.9}), llm, max_rewrites=3)
    response = engine.query("How much money does project A get?")
    assert crag(response)["rewrites"] == 3 and len(seen) == 3
    _assert_abstained(response, "after 3 rewrite(s)", llm)

    llm_default = ScriptedLLM(rewrite=rewrite)
    seen.clear()
    engine = make_engine(MarkerScorer({"alpha project budget for 2024": 0.9}), llm_default)
    assert crag(engine.query("How much money does project A get?"))["rewrites"] == 1 and len(seen) == 1


def test_zero_rewrites_still_tries_the_fallback_with_the_original_query() -> None:
    llm = ScriptedLLM()
    engine = make_engine(MarkerScorer({"alpha project budget for 2024": 0.9}), llm, max_rewrites=0)
    response = engine.query("alpha project budget")
    trace = crag(response)
    assert trace["action"] == "incorrect" and trace["rewrites"] == 0 and not trace["abstained"]
    assert llm.calls["rewrite"] == 0


def test_hybrid_adds_graded_fallback_results_on_ambiguous(scripted_llm: ScriptedLLM) -> None:
    scorer = MarkerScorer({"alpha project budget was discussed": 0.5, "alpha project budget for 2024": 0.6})
    engine = make_engine(scorer, scripted_llm, primary=[GAMMA], hybrid=True, strip_min_tokens=4)
    response = engine.query("alpha project budget")
    ids = [n.node.metadata.get("crag_source", "retriever") for n in response.source_nodes]
    assert crag(response)["action"] == "ambiguous"
    assert "bm25" in ids and "retriever" in ids


def test_disabled_engine_is_plain_retrieve_then_generate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRAG_ENABLED", "false")
    llm = ScriptedLLM()
    scorer = MarkerScorer({})
    engine = make_engine(scorer, llm, primary=[BETA])
    response = engine.query("How much money does project A get?")
    trace = crag(response)
    assert trace["enabled"] is False and trace["action"] == "disabled"
    assert scorer.calls == 0 and llm.calls == {"answer": 1, "rewrite": 0}
    assert set(trace) >= {"nodes", "top_score", "timings_ms", "abstained", "thresholds"}
    assert trace["timings_ms"]["crag_ms"] == 0


def test_constructor_argument_beats_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRAG_ENABLED", "false")
    engine = make_engine(MarkerScorer({}), ScriptedLLM(), enabled=True)
    assert engine.settings.enabled is True


_MAPS = TextNode(
    id_="maps",
    text=(
        "Rind name maps let a cellar use an outside ledger. In this case, a rind name map can be applied to map the "
        "ledger name to a cheesemaker. The maps are kept in the ledger map file, which by default is named "
        "rind_ident.conf."
    ),
)
_MAPS_NO_FILE = TextNode(
    id_="maps-no-file",
    text=(
        "Rind name maps let a cellar use an outside ledger. In this case, a rind name map can be applied to map the "
        "ledger name to a cheesemaker. The maps are read again when the cellar reloads."
    ),
)


def _maps_engine(scripted_llm: ScriptedLLM, page: TextNode) -> CorrectiveQueryEngine:
    # The refiner keeps the strips that say "rind name map" and drops the one that names the file.
    scorer = MarkerScorer({"rind name map": 0.5})
    return make_engine(
        scorer, scripted_llm, primary=[page], strip_min_tokens=4, answer_mode="extract", quote_threshold=0.0
    )


def test_when_every_kept_strip_is_set_aside_the_graded_passages_are_read_whole(scripted_llm: ScriptedLLM) -> None:
    response = _maps_engine(scripted_llm, _MAPS).query("Which file maps ledger names to cheesemakers?")
    trace = crag(response)
    assert trace["action"] == "ambiguous" and trace["strips_kept"] == 2, trace["strips"]
    assert not trace["abstained"], trace["abstain_reason"]
    assert "rind_ident.conf" in str(response) and trace["quote_check"]["whole_passages"] is True
    assert [n.node.node_id for n in response.source_nodes] == ["maps"]
    assert scripted_llm.calls == {"answer": 0, "rewrite": 0}


def test_a_whole_passage_that_names_no_file_either_leaves_the_abstention_as_it_was(scripted_llm: ScriptedLLM) -> None:
    response = _maps_engine(scripted_llm, _MAPS_NO_FILE).query("Which file maps ledger names to cheesemakers?")
    trace = crag(response)
    assert trace["abstained"] and "it names no file" in trace["abstain_reason"], trace["abstain_reason"]
    assert "whole_passages" not in trace["quote_check"] and trace["quotes"] == []
    # The set-aside strips are the refiner's two, as the first reading found them.
    assert len(trace["quote_check"]["set_aside"]) == 2, trace["quote_check"]


def test_a_question_about_a_default_is_not_read_past_the_refiner(scripted_llm: ScriptedLLM) -> None:
    # Every entry of a reference page states a default: read whole, the page offers another one's.
    page = TextNode(
        id_="press",
        text=(
            "The press waits while a wheel settles, checking it between turns. "
            "Waiting is the default for the start and stop modes of the cellar."
        ),
    )
    scorer = MarkerScorer({"the press waits": 0.5})
    engine = make_engine(
        scorer, scripted_llm, primary=[page], strip_min_tokens=4, answer_mode="extract", quote_threshold=0.0
    )
    trace = crag(engine.query("How long does the press wait for a wheel by default?"))
    assert trace["action"] == "ambiguous" and trace["strips_kept"] == 1, trace["strips"]
    assert trace["abstained"] and "it states no default" in trace["abstain_reason"], trace["abstain_reason"]
    assert "whole_passages" not in trace["quote_check"]
