"""The grader, refiner and fallback retriever, each on its own and in stock LlamaIndex pipelines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.chat_engine import CondensePlusContextChatEngine
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from llama_index_crag import (
    CorrectiveQueryEngine,
    CorrectiveRetriever,
    FallbackRetriever,
    RelevanceGrader,
    StripRefiner,
    Verdict,
)
from llama_index_crag.core.settings import CragSettings
from llama_index_crag.errors import ConfigError
from llama_index_crag.scorers import BiEncoderScorer, EvidenceScorer, UpstreamScoreScorer
from llama_index_crag.text.split import split_sentences
from llama_index_crag.text.strips import decompose
from llama_index_crag.web.settings import WebSearchSettings

from .conftest import ALPHA, BETA, CORPUS, GAMMA, MarkerScorer, ScriptedLLM, make_engine


def nws(*nodes: TextNode) -> List[NodeWithScore]:
    return [NodeWithScore(node=n, score=None) for n in nodes]


@pytest.mark.parametrize(
    ("aggregation", "scores", "verdict"),
    [
        ("max", [0.9, 0.1, 0.1], "correct"),
        ("mean", [0.9, 0.1, 0.1], "ambiguous"),
        ("count", [0.9, 0.1, 0.1], "incorrect"),
        ("count", [0.9, 0.8, 0.1], "correct"),
    ],
)
def test_aggregation_decides_the_batch_verdict(aggregation: str, scores: List[float], verdict: str) -> None:
    nodes = [TextNode(text=f"passage {i} score{s}") for i, s in enumerate(scores)]
    scorer = MarkerScorer({f"score{s}": s for s in scores})
    grader = RelevanceGrader(scorer, upper=0.7, lower=0.3, aggregation=aggregation)  # type: ignore[arg-type]
    grading = grader.grade(QueryBundle("q"), nws(*nodes))
    assert grading.verdict.value == verdict
    assert grading.labels[0] is Verdict.CORRECT and grading.labels[-1] is Verdict.INCORRECT
    assert grading.top_score == max(scores)


def test_grader_rejects_thresholds_out_of_order() -> None:
    with pytest.raises(ValueError, match="lower <= upper"):
        RelevanceGrader(MarkerScorer({}), upper=0.2, lower=0.5)


def test_empty_passages_score_zero_without_a_model_call() -> None:
    scorer = MarkerScorer({}, default=0.9)
    grading = RelevanceGrader(scorer, upper=0.7, lower=0.3).grade(
        QueryBundle("q"), nws(TextNode(text=""), TextNode(text="   "))
    )
    assert grading.scores == [0.0, 0.0] and scorer.calls == 0


def test_grader_and_refiner_take_the_scorers_own_thresholds_when_none_are_given() -> None:
    shipped = EvidenceScorer.DEFAULT_THRESHOLDS
    grader = RelevanceGrader(EvidenceScorer())
    assert (grader.upper, grader.lower) == (shipped["upper"], shipped["lower"])
    assert RelevanceGrader(EvidenceScorer(), upper=0.9).upper == 0.9
    assert StripRefiner(EvidenceScorer()).threshold == shipped["strip_threshold"]
    scorer = BiEncoderScorer()
    assert StripRefiner(scorer).threshold == scorer.BUNDLED_THRESHOLDS["lower"], "no strip threshold: lower"


def test_a_scorer_that_ships_no_thresholds_needs_them_given() -> None:
    with pytest.raises(ConfigError, match=r"RelevanceGrader needs upper=: the scorer marker-scorer ships no"):
        RelevanceGrader(MarkerScorer({}))
    with pytest.raises(ConfigError, match=r"RelevanceGrader needs lower=.*llama-crag calibrate"):
        RelevanceGrader(MarkerScorer({}), upper=0.7)
    with pytest.raises(ConfigError, match=r"StripRefiner needs strip_threshold="):
        StripRefiner(MarkerScorer({}))


def test_a_grader_from_the_index_grades_a_passage_as_the_engine_over_that_index_does(sample_index: Any) -> None:
    question = QueryBundle("Who is the CEO of Harbor Analytics?")
    nodes = list(sample_index.docstore.docs.values())[:1]
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=ScriptedLLM(), fallback_sources=("bm25",))
    in_engine = engine.grader.grade(question, nws(*nodes)).scores
    assert RelevanceGrader.from_index(sample_index).grade(question, nws(*nodes)).scores == in_engine
    assert RelevanceGrader(EvidenceScorer()).grade(question, nws(*nodes)).scores != in_engine, "IDF matters"
    refiner = StripRefiner.from_nodes(list(sample_index.docstore.docs.values()), scorer=EvidenceScorer())
    assert refiner.scorer.corpus_stats()["idf"] == engine.grader.scorer.corpus_stats()["idf"]  # type: ignore[attr-defined]


def test_a_corrective_retriever_built_by_hand_refuses_parts_that_disagree_with_its_settings(
    scripted_llm: ScriptedLLM,
) -> None:
    engine = make_engine(MarkerScorer({}), scripted_llm)
    parts: Dict[str, Any] = {
        "retriever": engine.retriever.retriever,
        "grader": engine.grader,
        "refiner": engine.refiner,
        "fallback": engine.fallback,
        "rewriter": None,
        "settings": engine.settings,
    }
    built = CorrectiveQueryEngine(CorrectiveRetriever(**parts), response_synthesizer=engine.synthesizer)
    assert built.grader is engine.grader
    with pytest.raises(ConfigError, match=r"disagree \(upper=0.7 but 0.5; lower=0.3 but 0.2 in the part\)"):
        CorrectiveRetriever(**{**parts, "grader": RelevanceGrader(engine.grader.scorer, upper=0.5, lower=0.2)})
    with pytest.raises(ConfigError, match=r"strip_threshold=0.3 but 0.6"):
        CorrectiveRetriever(**{**parts, "refiner": StripRefiner(engine.grader.scorer, threshold=0.6)})


def test_settings_given_to_a_built_engine_reach_every_part_that_reads_them(
    scripted_llm: ScriptedLLM, embed_model: Any
) -> None:
    engine = CorrectiveQueryEngine.from_defaults(
        nodes=CORPUS,
        llm=scripted_llm,
        scorer=MarkerScorer({}, default=0.5),
        embed_model=embed_model,
        upper=0.7,
        lower=0.3,
        answer_mode="extract",
    )
    before = engine.variant(streaming=False)
    engine.scoped({"doc_id": "beta"})  # a scoped copy built before the change is not handed out after it
    assert engine.query("What does beta do?").metadata["crag"]["action"] == "ambiguous"  # 0.3 <= 0.5 < 0.7

    engine.settings = engine.settings.model_copy(update={"upper": 0.4, "lower": 0.2, "max_quotes": 1})
    trace = engine.query("What does beta do?").metadata["crag"]
    assert trace["action"] == "correct" and trace["thresholds"]["upper"] == 0.4, trace["thresholds"]
    assert (engine.grader.upper, engine.grader.lower, engine.refiner.threshold) == (0.4, 0.2, 0.2)
    assert engine.quoter.max_quotes == 1 and len(trace["quotes"]) <= 1
    scoped = engine.scoped({"doc_id": "beta"})
    assert scoped.grader.upper == 0.4 and scoped.settings.upper == 0.4
    # An engine made from it before keeps its own settings and parts.
    assert before.grader.upper == 0.7 and before.query("What does beta do?").metadata["crag"]["action"] == "ambiguous"


def test_grader_in_a_stock_query_engine_drops_irrelevant_nodes_and_emits_an_event(embed_model: Any) -> None:
    events: List[Any] = []

    class Collect(BaseEventHandler):
        def handle(self, event: Any, **kwargs: Any) -> None:
            if event.class_name() == "CragGradeEvent":
                events.append(event)

    handler = Collect()
    get_dispatcher().add_event_handler(handler)
    try:
        index = VectorStoreIndex(CORPUS, embed_model=embed_model)
        grader = RelevanceGrader(BiEncoderScorer(), upper=0.55, lower=0.3)
        engine = RetrieverQueryEngine.from_args(
            index.as_retriever(similarity_top_k=3), llm=ScriptedLLM(), node_postprocessors=[grader]
        )
        response = engine.query("What is the budget of the alpha project?")
    finally:
        get_dispatcher().event_handlers.remove(handler)
    ids = [n.node.node_id for n in response.source_nodes]
    assert "alpha" in ids and "beta" not in ids
    assert events and events[-1].verdict in ("correct", "ambiguous")
    assert all(0.0 <= s <= 1.0 for s in events[-1].scores)


def test_grader_returns_nothing_when_the_batch_is_incorrect(embed_model: Any) -> None:
    grader = RelevanceGrader(BiEncoderScorer(), upper=0.55, lower=0.3)
    assert grader.postprocess_nodes(nws(ALPHA, BETA), query_str="Who won the 1998 football world cup?") == []


def test_bi_encoder_ranks_the_answering_passage_first() -> None:
    scorer = BiEncoderScorer()
    scores = scorer.score_texts("What is the alpha project budget?", [BETA.text, ALPHA.text])
    assert scores[1] > scores[0] + 0.2
    assert scorer.default_thresholds == BiEncoderScorer.BUNDLED_THRESHOLDS


def test_upstream_scorer_explains_logits_and_missing_scores() -> None:
    scorer = UpstreamScoreScorer()
    with pytest.raises(ValueError, match="normalization='sigmoid'"):
        scorer.score_nodes(QueryBundle("q"), [NodeWithScore(node=ALPHA, score=4.2)])
    with pytest.raises(ValueError, match="needs a reranker"):
        scorer.score_nodes(QueryBundle("q"), [NodeWithScore(node=ALPHA, score=None)])
    assert UpstreamScoreScorer(normalization="sigmoid").score_nodes(
        QueryBundle("q"), [NodeWithScore(node=ALPHA, score=0.0)]
    ) == [0.5]


def test_decompose_keeps_tables_and_code_whole_and_merges_short_sentences() -> None:
    text = (
        "Churn fell. It fell in every quarter of the year for the Pro plan.\n\n"
        "| quarter | churn |\n| --- | --- |\n| Q1 | 4.1% |\n| Q2 | 3.9% |\n\n"
        "```python\nclient = Client()\n\nclient.export()\n```\n"
        "The export command writes one CSV file for each workspace you own."
    )
    strips = decompose(text, min_tokens=5)
    assert [s.whole_block for s in strips] == [False, True, True, False]
    assert strips[0].text == "Churn fell. It fell in every quarter of the year for the Pro plan."
    assert strips[1].text.count("|") == 12
    assert "client.export()" in strips[2].text and strips[2].text.startswith("```")


@pytest.mark.parametrize(
    "text",
    [
        "Dr. Smith founded the settlement of St. Augustine for the U.S. Army in the year of the great storm.",
        "The Huguenots furnished two new regiments of his army: the Infantry Regiments No. 13 and No. 15 of Prussia.",
        "Regular use of NSAIDs (e.g. aspirin) and of other drugs, as Smith et al. showed, lowered the risk (Fig. 2).",
    ],
)
def test_a_sentence_with_abbreviations_is_one_strip(text: str) -> None:
    # LlamaIndex's own splitter knows no abbreviation and cut each of these after its first full stop.
    assert [s.strip() for s in split_sentences(f"{text} The next sentence begins here.")] == [
        text,
        "The next sentence begins here.",
    ]
    assert [s.text for s in decompose(f"{text} The next sentence begins here and runs on.", min_tokens=5)] == [
        text,
        "The next sentence begins here and runs on.",
    ]


@pytest.mark.parametrize(
    "text",
    [
        "The default class supports the key-exists operators ?, ?| and ?&, and the match operators @? and @@.",
        "Because the operator ? is indexable, the planner can use the index for it.",
        "The prompt shows * in single-line mode, or ! if the session is in a failed transaction block.",
        '"Why?" he asked the cellar master, who did not answer.',
    ],
)
def test_a_question_or_exclamation_mark_that_a_lower_case_word_follows_ends_no_sentence(text: str) -> None:
    # Punkt ends a sentence at every "?" and "!": a manual's operators and prompts were cut out of theirs.
    assert [s.strip() for s in split_sentences(f"{text} Is that all? Yes.")] == [text, "Is that all?", "Yes."]


def test_sentences_are_the_text_in_consecutive_slices() -> None:
    text = "The answer was no. Then he left.  Regiments No. 13 fought. Mt. Everest is high."
    sentences = split_sentences(text)
    assert "".join(sentences) == text
    assert [s.strip() for s in sentences] == [
        "The answer was no.",
        "Then he left.",
        "Regiments No. 13 fought.",
        "Mt. Everest is high.",
    ]
    assert split_sentences("") == [] and split_sentences("no full stop") == ["no full stop"]


def test_a_chunk_shorter_than_the_minimum_stays_whole() -> None:
    assert [s.text for s in decompose("Short one. Another.", min_tokens=8)] == ["Short one. Another."]


def test_refiner_with_the_real_scorer_keeps_the_answering_sentence() -> None:
    refiner = StripRefiner(BiEncoderScorer(), threshold=0.45, strip_min_tokens=5)
    refined = refiner.postprocess_nodes(nws(GAMMA), query_str="Where is the gamma office and when did it open?")
    [node] = refined
    assert "Porto" in node.node.get_content() and "cafeteria" not in node.node.get_content()
    assert node.node.source_node is not None and node.node.source_node.node_id == "gamma"


def test_fallback_chain_tags_sources_and_first_mode_stops_early(embed_model: Any) -> None:
    chained = FallbackRetriever.from_nodes(
        CORPUS,
        sources=("bm25", "sentence_window"),
        similarity_top_k=4,
        embed_model=embed_model,
        window_size=1,
        widen_to="window",
    )
    hits = chained.retrieve("Porto office opening year")
    sources = {h.node.metadata["crag_source"] for h in hits}
    assert sources == {"bm25", "sentence_window"}
    assert all("crag_source" in h.node.excluded_llm_metadata_keys for h in hits)
    window = next(h for h in hits if h.node.metadata["crag_source"] == "sentence_window")
    assert "Porto" in window.node.get_content()
    # Widened to chunks (the default), the sentence search hands back the corpus's own nodes, each once, best first.
    chunks = FallbackRetriever.from_nodes(
        CORPUS, sources=("sentence_window",), similarity_top_k=4, embed_model=embed_model
    )
    found = [h.node.node_id for h in chunks.retrieve("Porto office opening year")]
    assert found[0] == "gamma" and len(found) == len(set(found)) and set(found) <= {n.node_id for n in CORPUS}
    first = FallbackRetriever.from_nodes(CORPUS, sources=("bm25", "sentence_window"), mode="first")
    assert {h.node.metadata["crag_source"] for h in first.retrieve("Porto office")} == {"bm25"}


def test_fallback_retriever_feeds_a_stock_chat_engine() -> None:
    retriever = FallbackRetriever.from_nodes(CORPUS, sources=("bm25",), similarity_top_k=2)
    chat = CondensePlusContextChatEngine.from_defaults(
        retriever=retriever,
        llm=ScriptedLLM(),
        node_postprocessors=[RelevanceGrader(MarkerScorer({"budget for 2024": 0.9}), upper=0.7, lower=0.3)],
    )
    reply = chat.chat("alpha project budget")
    assert [n.node.node_id for n in reply.source_nodes] == ["alpha"]


def test_fallback_refuses_an_empty_corpus() -> None:
    with pytest.raises(ValueError, match="at least one node with text"):
        FallbackRetriever.from_nodes([TextNode(text=" ")])


def test_settings_precedence_constructor_env_calibration(tmp_path: Path) -> None:
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"version": 1, "scorer": "s", "thresholds": {"upper": 0.8, "lower": 0.2}}))
    env = {"CRAG_LOWER": "0.25", "CRAG_MAX_REWRITES": "2", "CRAG_CALIBRATION": str(calibration)}
    s = CragSettings.resolve({"max_rewrites": 3}, scorer_name="s", environ=env)
    assert (s.upper, s.lower, s.max_rewrites) == (0.8, 0.25, 3)
    assert s.strip_threshold is None  # the refiner then uses lower
    thresholds = {"upper": 0.8, "lower": 0.2, "strip_threshold": 0.4}
    calibration.write_text(json.dumps({"version": 1, "scorer": "s", "thresholds": thresholds}))
    assert CragSettings.resolve(scorer_name="s", environ=env).strip_threshold == 0.4
    env["CRAG_STRIP_THRESHOLD"] = "0.45"
    assert CragSettings.resolve(scorer_name="s", environ=env).strip_threshold == 0.45


def test_calibration_for_another_scorer_is_refused(tmp_path: Path) -> None:
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"version": 1, "scorer": "other", "thresholds": {"upper": 0.8, "lower": 0.2}}))
    with pytest.raises(ValueError, match="fitted for scorer 'other'"):
        CragSettings.resolve(calibration_path=calibration, scorer_name="mine", environ={})


def test_scorer_defaults_sit_below_the_calibration_file(tmp_path: Path) -> None:
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"version": 1, "scorer": "s", "thresholds": {"upper": 0.8, "lower": 0.2}}))
    defaults = {"upper": 0.6, "lower": 0.1, "strip_threshold": 0.05}
    s = CragSettings.resolve(calibration_path=calibration, scorer_name="s", scorer_defaults=defaults, environ={})
    assert (s.upper, s.lower, s.strip_threshold) == (0.8, 0.2, 0.05)


def test_settings_built_directly_read_the_process_environment_below_the_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CRAG_CALIBRATION", raising=False)
    monkeypatch.setenv("CRAG_MAX_REWRITES", "4")
    monkeypatch.setenv("CRAG_HYBRID", "on")
    assert (CragSettings(upper=0.5, lower=0.2).max_rewrites, CragSettings(upper=0.5, lower=0.2).hybrid) == (4, True)
    assert CragSettings(upper=0.5, lower=0.2, max_rewrites=0, hybrid=False).model_dump(
        include={"max_rewrites", "hybrid"}
    ) == {"max_rewrites": 0, "hybrid": False}


def test_settings_errors_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="pass upper= and lower="):
        CragSettings.resolve(scorer_name="x", environ={})
    with pytest.raises(ConfigError, match="CRAG_ENABLED='maybe' is not a boolean"):
        CragSettings.resolve({"upper": 0.5, "lower": 0.2}, environ={"CRAG_ENABLED": "maybe"})
    with pytest.raises(ConfigError, match="invalid CRAG settings: CRAG_MAX_REWRITES='-1' is invalid"):
        CragSettings.resolve({"upper": 0.5, "lower": 0.2}, environ={"CRAG_MAX_REWRITES": "-1"})
    with pytest.raises(ConfigError, match="CRAG_AGGREGATION='median' is invalid: input should be 'max'"):
        CragSettings.resolve({"upper": 0.5, "lower": 0.2}, environ={"CRAG_AGGREGATION": "median"})
    with pytest.raises(ConfigError, match="lower <= upper"):
        CragSettings.resolve({"upper": 0.2}, environ={"CRAG_LOWER": "0.5"})


def test_a_bad_constructor_value_is_named_by_its_keyword_not_the_variable_it_overrides() -> None:
    with pytest.raises(ConfigError, match=r"max_rewrites=-1 is invalid") as refused:
        CragSettings.resolve({"upper": 0.5, "lower": 0.2, "max_rewrites": -1}, environ={"CRAG_MAX_REWRITES": "2"})
    assert "CRAG_MAX_REWRITES" not in str(refused.value)


@pytest.mark.parametrize(
    ("raw", "value"),
    [("on", True), ("OFF", False), ("true", True), ("False", False), ("1", True), ("0", False), (" yes", True)],
)
def test_environment_booleans_take_the_documented_spellings(raw: str, value: bool) -> None:
    assert CragSettings.resolve({"upper": 0.5, "lower": 0.2}, environ={"CRAG_HYBRID": raw}).hybrid is value
    assert WebSearchSettings.resolve(None, environ={"CRAG_WEB": raw}).enabled is value


@pytest.mark.parametrize("raw", ["maybe", "t", "n", "2", ""])
def test_any_other_boolean_spelling_is_an_error_naming_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match=f"CRAG_EXPLAIN={raw!r} is not a boolean"):
        CragSettings.resolve({"upper": 0.5, "lower": 0.2}, environ={"CRAG_EXPLAIN": raw})
    with pytest.raises(ConfigError, match=f"CRAG_WEB={raw!r} is not a boolean"):
        WebSearchSettings.resolve(None, environ={"CRAG_WEB": raw})


def test_web_lists_and_the_tavily_key_come_from_the_environment_as_documented() -> None:
    env = {
        "CRAG_WEB": "on",
        "CRAG_WEB_ALLOW_DOMAINS": " a.org, *.b.org ,",
        "CRAG_WEB_REDACT_PATTERNS": "ACME-\\d+\nx{1,3}\n",
        "TAVILY_API_KEY": "tavily's own",
    }
    web = WebSearchSettings.resolve(None, environ=env)
    assert web.enabled and web.allow_domains == ["a.org", "*.b.org"] and web.deny_domains == []
    assert web.redact_patterns == [r"ACME-\d+", "x{1,3}"]
    assert web.tavily_api_key == "tavily's own"
    assert WebSearchSettings.resolve(None, environ={**env, "CRAG_WEB_TAVILY_API_KEY": "ours"}).tavily_api_key == "ours"
    with pytest.raises(ConfigError, match="CRAG_WEB_MAX_RESULTS='500' is invalid"):
        WebSearchSettings.resolve(None, environ={"CRAG_WEB_MAX_RESULTS": "500"})
    with pytest.raises(ConfigError, match=r"CRAG_WEB_REDACT_PATTERNS='.*' holds '\(', which is not a regular"):
        WebSearchSettings.resolve(None, environ={"CRAG_WEB_REDACT_PATTERNS": "ACME-\\d+\n("})
    with pytest.raises(ConfigError, match="unknown web settings"):
        WebSearchSettings.resolve({"max_result": 3}, environ={})


def test_code_cannot_undo_the_web_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    forbidding = {"CRAG_WEB_FORBIDDEN": "on"}
    assert WebSearchSettings.resolve({"forbidden": False}, environ=forbidding).forbidden
    assert WebSearchSettings.resolve({"forbidden": True}, environ={"CRAG_WEB_FORBIDDEN": "false"}).forbidden
    assert not WebSearchSettings.resolve({"forbidden": False}, environ={}).forbidden
    monkeypatch.setenv("CRAG_WEB_FORBIDDEN", "true")
    assert WebSearchSettings(enabled=True, forbidden=False).forbidden


def test_a_misspelt_kill_switch_is_refused_rather_than_read_as_off() -> None:
    with pytest.raises(ConfigError, match="CRAG_WEB_FORBIDDEN='ture' is not a boolean"):
        WebSearchSettings.resolve({"forbidden": False}, environ={"CRAG_WEB_FORBIDDEN": "ture"})


def test_web_settings_given_as_a_dict_or_object_turn_the_web_on_unless_they_say_otherwise() -> None:
    given = {"provider": "searxng", "searxng_url": "http://127.0.0.1:9", "allow_domains": ["example.org"]}
    assert WebSearchSettings.resolve(given, environ={}).enabled
    assert WebSearchSettings.resolve(WebSearchSettings(provider="duckduckgo"), environ={}).enabled
    assert not WebSearchSettings.resolve({**given, "enabled": False}, environ={}).enabled
    assert not WebSearchSettings.resolve(None, environ={}).enabled
    assert not WebSearchSettings.resolve(False, environ={"CRAG_WEB": "on"}).enabled
    # The administrator's switch still wins over code that asks for the web.
    forbidden = WebSearchSettings.resolve(given, environ={"CRAG_WEB_FORBIDDEN": "true"})
    assert forbidden.enabled and forbidden.forbidden
