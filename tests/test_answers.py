"""The answer step: quoted evidence, the check of a generated answer, and the keyword rewrite."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_index.core import VectorStoreIndex
from llama_index.core.llms import MockLLM
from llama_index.core.schema import NodeWithScore, TextNode

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.answers.extract import (
    ANSWER_FEATURES,
    PACKAGED_DIR,
    QUOTED_HEADER,
    TURNED_ROUND_WHY,
    WEIGHTS_FILE,
    AnswerModel,
    Candidate,
    EvidenceQuoter,
    QuoteDecision,
    answer_features,
    asked_names,
    entry_above,
    evidence_place,
    other_entry,
    packaged_answer_model,
    shown,
    states_codes,
)
from llama_index_crag.answers.grounding import GroundednessChecker
from llama_index_crag.answers.keywords import keyword_query
from llama_index_crag.answers.policy import default_answer_mode
from llama_index_crag.calibration.answer_training import swapped
from llama_index_crag.cli import main
from llama_index_crag.core.fallback import FallbackRetriever
from llama_index_crag.core.loop import evidence_grade
from llama_index_crag.datasets import Question, load_documents, load_questions
from llama_index_crag.errors import ConfigError
from llama_index_crag.presets.structured_abstracts import (
    describes_methods,
    gives_background,
    states_a_gap,
    states_an_aim,
)
from llama_index_crag.scorers.evidence import FEATURES, EvidenceScorer
from llama_index_crag.text.patterns import IDENTIFIER
from llama_index_crag.text.split import split_sentences
from llama_index_crag.text.strips import Strip

from .check_halves import check_half, scifact_sentences
from .conftest import ALPHA, BETA, Answering, MarkerScorer, ScriptedLLM, make_engine

QUESTION = "What is the alpha project budget?"
ALPHA_SCORER = {"alpha project budget for 2024": 0.9}
OUTAGE = (
    "The June 2023 EU-2 outage lasted 4 hours and 14 minutes. It began at 09:10 UTC when a storage node failed. "
    "Harbor Pro customers in the EU-2 region could not load dashboards."
)


def crag(response: Any) -> dict:
    return response.metadata["crag"]


# --- the keyword rewrite ----------------------------------------------------------------------------------------


def test_keyword_query_keeps_names_figures_and_codes_and_drops_question_words() -> None:
    words = keyword_query("How long did the June 2023 EU-2 outage last?").split()
    assert {"June", "2023", "EU-2", "outage"} <= set(words)
    assert not {"How", "did", "the"} & set(words)


def test_keyword_query_keeps_the_order_of_the_question_and_each_word_once() -> None:
    query = keyword_query("Which version of the Python SDK does the customer onboarding guide install?")
    assert query.index("Python") < query.index("SDK") < query.index("onboarding")
    assert len(query.split()) == len({w.casefold() for w in query.split()})


def _raise(prompt: str) -> str:
    raise ConnectionError("server went away")


@pytest.mark.parametrize(
    ("rewrite", "reason"),
    [
        (_raise, "failed: ConnectionError: server went away"),
        ('{"query": "   "}', "the rewrite was empty"),
        ('{"query": "how much money does project A get?"}', "returned the query unchanged"),
        ("sure! the query is alpha budget", "not valid JSON"),
        ('{"query": ', "not valid JSON"),
        ('{"query": "2018-01-01T00:00:00.00.00.00-10.10.10.10"}', "kept none of the query's words"),
    ],
    ids=["raises", "empty", "unchanged", "prose-not-json", "truncated-json", "noise"],
)
def test_a_failed_llm_rewrite_searches_with_the_question_keywords_instead_of_abstaining(
    rewrite: Any, reason: str
) -> None:
    llm = ScriptedLLM(rewrite=rewrite)
    engine = make_engine(MarkerScorer(ALPHA_SCORER), llm)
    response = engine.query("How much money does project A get?")
    trace = crag(response)
    assert reason in trace["rewrite_error"]
    assert trace["rewrite_source"] == "keyword" and trace["rewritten_query"] == keyword_query(
        "How much money does project A get?"
    )
    assert not trace["abstained"], trace["abstain_reason"]
    assert response.source_nodes[0].node.node_id == "alpha"


def slow_rewrite(prompt: str) -> str:
    time.sleep(1.5)  # a large model on a busy CPU
    return '{"query": "alpha project budget"}'


def test_a_rewrite_past_its_own_limit_searches_with_the_keywords_in_the_time_left() -> None:
    engine = make_engine(
        MarkerScorer(ALPHA_SCORER), ScriptedLLM(rewrite=slow_rewrite), correction_timeout_s=5.0, rewrite_timeout_s=0.2
    )
    response = engine.query("How much money does project A get?")
    trace = crag(response)
    assert "ran past its 0.2 s limit" in trace["rewrite_error"] and trace["rewrite_source"] == "keyword"
    assert not trace["abstained"], trace["abstain_reason"]
    assert response.source_nodes[0].node.node_id == "alpha"


def test_a_rewrite_that_spends_the_whole_correction_budget_abstains() -> None:
    engine = make_engine(
        MarkerScorer(ALPHA_SCORER), ScriptedLLM(rewrite=slow_rewrite), correction_timeout_s=0.3, rewrite_timeout_s=5.0
    )
    trace = crag(engine.query("How much money does project A get?"))
    assert trace["abstained"] and "ran past the 0.3 s correction budget" in trace["abstain_reason"]


def test_a_good_llm_rewrite_is_used_and_said_so() -> None:
    engine = make_engine(MarkerScorer(ALPHA_SCORER), ScriptedLLM())
    trace = crag(engine.query("How much money does project A get?"))
    assert trace["rewrite_source"] == "llm" and trace["rewritten_query"] == "alpha project budget"
    assert trace["rewrite_error"] is None


def test_without_an_llm_the_rewrite_is_the_keywords() -> None:
    engine = make_engine(MarkerScorer(ALPHA_SCORER), ScriptedLLM(), answer_mode="extract", quote_threshold=0.0)
    retriever = engine.retriever
    retriever._rewriter = None  # as from_defaults builds it without an LLM
    engine = CorrectiveQueryEngine(retriever, engine.synthesizer)
    trace = crag(engine.query("How much money does project A get?"))
    assert trace["rewrite_source"] == "keyword" and trace["rewrite_error"] is None and not trace["abstained"]


# --- quoted-evidence answers ------------------------------------------------------------------------------------


def test_extract_mode_quotes_the_best_strips_with_their_source_and_generates_nothing(
    sample_index: VectorStoreIndex,
) -> None:
    llm = ScriptedLLM()
    engine = CorrectiveQueryEngine.from_defaults(
        index=sample_index, llm=llm, answer_mode="extract", fallback_sources=("bm25",)
    )
    response = engine.query("Who is the chief executive officer of Harbor Analytics?")
    trace = crag(response)
    assert trace["answer_mode"] == "extract" and trace["answered_by"] == "extract"
    assert str(response).startswith(QUOTED_HEADER) and "Miriam Okafor" in str(response)
    assert any(q["source"].endswith("harbor-001") and "Miriam Okafor" in q["text"] for q in trace["quotes"])
    texts = [n.node.get_content() for n in response.source_nodes]
    assert all(any(q["text"] in " ".join(t.split()) for t in texts) for q in trace["quotes"]), "quotes are verbatim"
    assert llm.calls["answer"] == 0 and trace["grounded"] is None
    # The answer model gave the quoted strip a probability at or above the threshold at its evidence's grade.
    check = trace["quote_check"]
    assert check["passed"] and check["grade"] >= check["threshold"] == _threshold_at(trace)
    assert check["withheld"] == [] and all(q["score"] >= check["threshold"] for q in trace["quotes"])


def test_strips_on_the_subject_that_do_not_answer_are_withheld_and_the_engine_abstains(
    sample_index: VectorStoreIndex,
) -> None:
    # The full-year results passage is retrieved, on the subject of a question about net income it does not state.
    question = "What net income did the company report for fiscal year 2023?"
    engine = CorrectiveQueryEngine.from_defaults(
        index=sample_index, answer_mode="extract", fallback_sources=("bm25",), quote_threshold=0.99
    )
    trace = crag(engine.query(question))
    check = trace["quote_check"]
    assert trace["abstained"] and trace["answered_by"] == "abstain" and trace["quotes"] == []
    assert not check["passed"] and check["grade"] < check["threshold"] == 0.99 and len(check["withheld"]) == 1
    assert "under the quote threshold 0.990" in trace["abstain_reason"]
    # The threshold is what withheld it: at 0, the same strip is the answer.
    off = CorrectiveQueryEngine.from_defaults(
        index=sample_index, answer_mode="extract", fallback_sources=("bm25",), quote_threshold=0.0, max_quotes=1
    )
    trace = crag(off.query(question))
    assert trace["answered_by"] == "extract" and trace["quote_check"]["passed"]
    assert [q["text"] for q in trace["quotes"]] == [q["text"] for q in check["withheld"]]


def _threshold_at(trace: Dict[str, Any]) -> float:
    """The packaged decision's threshold for the evidence a trace graded."""
    grade = evidence_grade(trace["action"], trace["top_score"], trace["retry_score"])
    place = evidence_place(grade, trace["upper"], trace["lower"])
    assert trace["quote_check"]["evidence_place"] == pytest.approx(place, abs=1e-4)
    return round(packaged_answer_model().decision.threshold(place), 4)


def test_the_quote_threshold_follows_the_grade_of_the_evidence_by_default(sample_index: VectorStoreIndex) -> None:
    trace = crag(
        CorrectiveQueryEngine.from_defaults(index=sample_index, answer_mode="extract").query(
            "What net income did the company report for fiscal year 2023?"
        )
    )
    assert trace["quote_check"]["threshold"] == _threshold_at(trace)


def test_a_quote_decision_asks_less_of_a_strip_the_better_its_evidence_graded() -> None:
    decision = packaged_answer_model().decision
    thresholds = [decision.threshold(p) for p in (-1.0, 0.0, 0.5, 1.0, 2.0)]
    assert thresholds == sorted(thresholds, reverse=True) and thresholds[0] > thresholds[-1]
    # However well the evidence graded, the best strip must reach the floor.
    assert thresholds[-1] >= decision.floor and QuoteDecision(10.0, 0.0, floor=0.2).threshold(2.0) == 0.2
    # Unknown evidence is read at the lower threshold; a constant decision ignores the grade.
    assert decision.threshold(None) == decision.threshold(0.0)
    constant = QuoteDecision.constant(0.3)
    assert constant.threshold(-1.0) == pytest.approx(0.3) == pytest.approx(constant.threshold(2.0))
    with pytest.raises(ConfigError, match="probability"):
        QuoteDecision.constant(1.5)
    # The grade's place between the thresholds, clipped; another scorer's thresholds place its own grades.
    assert evidence_place(0.45, upper=0.8, lower=0.45) == 0.0 and evidence_place(0.8, upper=0.8, lower=0.45) == 1.0
    assert evidence_place(0.0, upper=0.8, lower=0.45) == -1.0 and evidence_place(None, 0.8, 0.45) is None
    assert evidence_place(0.9, upper=0.99, lower=0.6) == pytest.approx(0.3 / 0.39)


def test_an_older_answer_model_folder_quotes_at_its_threshold_whatever_the_grade(tmp_path: Path) -> None:
    model = packaged_answer_model()
    older = AnswerModel(model.parameters, {k: v for k, v in model.info.items() if k != "decision"})
    older.info["thresholds"] = {"correct": 0.4, "ambiguous": 0.4}
    older.save(tmp_path)
    loaded = AnswerModel.load(tmp_path).decision
    assert loaded.threshold(1.5) == pytest.approx(0.4) == pytest.approx(loaded.threshold(0.0))


#: Filler words that hold no figure, code or name, for text around what a test inserts.
FILLER = st.lists(
    st.sampled_from("the report said that our green river office walked quietly across an old bridge with".split()),
    max_size=8,
).map(" ".join)
#: Codes and figures as questions name them: "Q3", "EU-2", "A-769662", "SHP2", "2023".
CODES = st.builds(
    lambda letters, hyphen, digits: f"{letters}{'-' if hyphen and letters else ''}{digits}",
    st.text(alphabet="ABCDEGHKLPQSTUX", max_size=3),
    st.booleans(),
    st.integers(min_value=1, max_value=999_999).map(str),
)


@settings(max_examples=200, deadline=None)
@given(code=CODES, before=FILLER, after=FILLER, hyphenless=st.booleans())
def test_a_code_the_question_names_is_stated_by_a_strip_that_holds_it_hyphens_or_none(
    code: str, before: str, after: str, hyphenless: bool
) -> None:
    stated = code.replace("-", "") if hyphenless else code
    assert states_codes(f"What does {before} {code} {after} say?", f"{after} {stated.lower()} {before}.")


@settings(max_examples=200, deadline=None)
@given(code=CODES, before=FILLER, after=FILLER)
def test_a_strip_with_another_figure_in_the_code_does_not_state_it(code: str, before: str, after: str) -> None:
    other = code[:-1] + str((int(code[-1]) + 1) % 10)  # EU-2 -> EU-3, 2023 -> 2024
    assert not states_codes(f"What does {before} {code} {after} say?", f"{before} {other} {after}.")


@pytest.mark.parametrize(
    ("question", "text", "states"),
    [
        ("Does a 40mg/day dose of folic acid help?", "Participants received 40 mg of folic acid daily.", True),
        ("76-85% of serious cases receive no treatment.", "76.3% to 85.4% of serious cases had none.", True),
        ("76-85% of serious cases receive no treatment.", "76.3% of serious cases had none.", False),
        ("Sirt1 acts in Sf1-expressing neurons.", "Mice overexpressing SIRT1 in SF1 neurons resist obesity.", True),
        ("How fast is a P1 ticket answered?", "Harbor is hosted in AP-1, Sydney, within 4 hours.", False),
    ],
    ids=["unit-apart", "range-by-its-ends", "range-one-end", "describing-suffix", "code-inside-another"],
)
def test_the_codes_feature_reads_units_ranges_and_suffixes_as_written_in_papers(
    question: str, text: str, states: bool
) -> None:
    assert states_codes(question, text) is states


@pytest.mark.parametrize(
    ("question", "names"),
    [
        ("When did the Singapore office open?", ["singapore"]),
        # An owner is the question's frame, not what it asks about; the first word is capitalised anyway.
        ("What share of Scotland's voters did not vote?", []),
        ("Where did Galor and Zeira publish?", ["galor", "zeira"]),
        ("when did the singapore office open", []),
    ],
)
def test_the_names_a_question_asks_about_are_its_capitalised_words(question: str, names: List[str]) -> None:
    assert asked_names(question) == names


def _features(question: str, candidates: Sequence[Candidate]) -> Any:
    return answer_features(question, candidates, EvidenceScorer(corpus=[c.graded_text for c in candidates]))


def test_the_answer_features_read_the_kind_of_answer_the_names_and_the_strip_itself() -> None:
    column = {name: i for i, name in enumerate(ANSWER_FEATURES)}
    toronto = Candidate("The Toronto office opened in January 2020.", "The Toronto office opened in January 2020.")
    singapore = Candidate(
        "It opened in March 2021 and serves Asia.",
        "The Singapore office It opened in March 2021 and serves Asia.",
        said_before="Offices The Singapore office is the newest.",
    )
    rows = _features("When did the Singapore office open?", [toronto, singapore])
    assert rows.shape == (2, len(ANSWER_FEATURES))
    assert list(rows[:, column["names_stated"]]) == [0.0, 1.0]
    assert list(rows[:, column["holds_kind"]]) == [1.0, 1.0] and list(rows[:, column["asks_kind"]]) == [1.0, 1.0]
    assert list(rows[:, column["refers_back"]]) == [0.0, 1.0]
    assert rows[0, column["is_claim"]] == 0.0 and rows[0, column["is_question"]] == 0.0
    claim = _features("Singapore offices opened in 2021.", [singapore])
    assert claim[0, column["is_claim"]] == 1.0 and claim[0, column["asks_kind"]] == 0.0


def test_the_packaged_answer_model_loads_with_its_checksum_notice_and_decision() -> None:
    model = packaged_answer_model()
    # Evidence the grader was less sure of needs a strip that shows more (fitted on the design halves).
    assert 0.0 <= model.decision.threshold(1.0) < model.decision.threshold(0.0) < 1.0
    assert "CC BY-SA 4.0" in (PACKAGED_DIR / "NOTICE").read_text(encoding="utf-8")


def _auroc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """The chance that a labelled row scores above an unlabelled one (ties count half)."""
    values, chosen = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    above = values[chosen][:, None] - values[~chosen][None, :]
    return float((above > 0).mean() + 0.5 * (above == 0).mean())


def test_the_answer_model_tells_the_answering_sentence_from_its_neighbours_better_than_its_length() -> None:
    # Every sentence of an answerable question's own passage, on SQuAD 2.0's check half: the sentence that holds
    # the answer against its neighbours. Measured 2026-12: AUROC 0.85 for the model, 0.66 for length alone.
    questions, documents = check_half("squad2")
    scorer = EvidenceScorer(corpus=list(documents.values()))
    probabilities: List[float] = []
    lengths: List[float] = []
    answers: List[bool] = []
    for question in questions:
        if not question.answerable or not question.relevant_doc_ids:
            continue
        sentences = split_sentences(documents[question.relevant_doc_ids[0]])
        rows = answer_features(question.question, [Candidate(s, s) for s in sentences], scorer)
        probabilities += list(packaged_answer_model().probabilities(rows))
        lengths += [len(s.split()) for s in sentences]
        answers += [any(a in s for a in question.answers) for s in sentences]
    assert sum(answers) >= 50 and len(answers) - sum(answers) >= 100
    model, baseline = _auroc(probabilities, answers), _auroc(lengths, answers)
    assert model >= baseline + 0.1 and model >= 0.75, (model, baseline)


def test_an_answer_model_whose_weights_do_not_match_their_checksum_is_refused(tmp_path: Path) -> None:
    packaged_answer_model().save(tmp_path)
    assert AnswerModel.load(tmp_path).decision == packaged_answer_model().decision
    with np.load(tmp_path / WEIGHTS_FILE) as data:
        tampered = {k: data[k] for k in data.files}
    tampered["b2"] = tampered["b2"] + 5.0
    np.savez(tmp_path / WEIGHTS_FILE, **tampered)
    with pytest.raises(ConfigError, match="does not match its checksum"):
        AnswerModel.load(tmp_path)
    with pytest.raises(ConfigError, match="no readable answer model"):
        AnswerModel.load(tmp_path / "missing")


@pytest.mark.parametrize(
    ("question", "passage", "answer"),
    [
        (
            "How tall is the Orrin Lighthouse on Skerra Island?",
            "The Orrin Lighthouse on Skerra Island was first lit in 1871. It rises 41 metres above the rocks and "
            "its light can be seen for 22 nautical miles.",
            "It rises 41 metres",
        ),
        (
            "how many days did the warsaw uprising last",
            "On 1 August 1944 the Warsaw Uprising began. The armed struggle, planned for 48 hours, went on for 63 "
            "days.",
            "63 days",
        ),
        (
            "What is the capital of Australia?",
            "Australia is a federation of six states. Its capital is Canberra, chosen in 1908 as a compromise "
            "between Sydney and Melbourne.",
            "Canberra",
        ),
    ],
    ids=["pronoun-led", "lower-case", "capital"],
)
def test_the_answer_model_gives_the_sentence_that_answers_the_highest_probability(
    question: str, passage: str, answer: str
) -> None:
    nodes = [NodeWithScore(node=TextNode(text=passage, metadata={"title": "Notes"}), score=0.9)]
    scorer = EvidenceScorer(corpus=[passage])
    # Held back at a threshold nothing reaches, the strip withheld is the most probable one.
    strict = EvidenceQuoter(scorer, strip_min_tokens=3, answer_threshold=1.0).quote(question, nodes)
    assert len(strict.withheld) == 1 and answer in strict.withheld[0].text, strict
    # Which is quoted first is the ranker's call (tests/test_answer_ranker.py): for the lower-case question it puts
    # "On 1 August 1944 the Warsaw Uprising began." first, the sentence with more of the question's words.


def test_under_the_threshold_nothing_is_quoted_and_the_best_strip_is_withheld() -> None:
    passage = "The Orrin Lighthouse on Skerra Island was first lit in 1871. Its keepers left in 1960."
    nodes = [NodeWithScore(node=TextNode(text=passage), score=0.9)]
    scorer = EvidenceScorer(corpus=[passage])
    strict = EvidenceQuoter(scorer, strip_min_tokens=3, answer_threshold=1.0).quote("Who painted it?", nodes, 0.5)
    assert strict.quotes == [] and len(strict.withheld) == 1 and strict.grade is not None and strict.grade < 1.0
    assert strict.check() == {
        "grade": strict.grade,
        "threshold": 1.0,
        "evidence_place": 0.5,
        "passed": False,
        "unnamed": [],
        "withheld": [asdict(strict.withheld[0])],
        "set_aside": [],
        "elsewhere": [],
    }
    loose = EvidenceQuoter(scorer, strip_min_tokens=3, answer_threshold=0.0, max_quotes=1).quote(
        "Who painted it?", nodes
    )
    assert [q.text for q in loose.quotes] == [q.text for q in strict.withheld]


@pytest.mark.parametrize(
    ("action", "retry_score", "grade"),
    [("correct", None, 0.9), ("ambiguous", None, 0.9), ("incorrect", 0.99, 0.99), ("incorrect", None, 0.9)],
)  # fmt: skip
def test_evidence_the_fallback_found_is_placed_by_its_own_grade(
    action: str, retry_score: Optional[float], grade: float
) -> None:
    assert evidence_grade(action, 0.9, retry_score) == grade


def test_an_unknown_quote_preset_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown quote preset"):
        EvidenceQuoter(EvidenceScorer(), preset="abstracts")


#: What each structured-abstract rule tells from a finding: a strip that must not be quoted as the evidence for a
#: claim, since it says what a study set out to learn, how it was done, what was known before it or what is not
#: yet known.
NOT_FINDINGS = {
    "aim": states_an_aim,
    "methods": describes_methods,
    "background": gives_background,
    "gap": states_a_gap,
}


@pytest.mark.parametrize("rule", list(NOT_FINDINGS))
def test_a_rule_that_tells_what_is_not_a_finding_almost_never_fires_on_a_scifact_rationale(rule: str) -> None:
    # SciFact's check half: every sentence of the abstracts its claims cite, the annotators' rationale sentences
    # against the rest. Measured 2026-12, rationales flagged against other sentences: aim 0/298 and 73/2388,
    # methods 0/298 and 328/2388, background 2/298 and 99/2388, gap 0/298 and 81/2388.
    sentences = scifact_sentences()
    questions, _ = check_half("scifact")
    flagged = {True: 0, False: 0}
    seen = {True: 0, False: 0}
    for claim in questions:
        for doc, rationale in claim.evidence.items():
            for i, sentence in enumerate(sentences[doc]):
                seen[i in rationale] += 1
                flagged[i in rationale] += NOT_FINDINGS[rule](claim.question, sentence)
    assert seen[True] >= 200 and seen[False] >= 1000, seen
    rationales, others = flagged[True] / seen[True], flagged[False] / seen[False]
    assert others >= 0.02 and rationales * 4 <= others, (flagged, seen)


@pytest.mark.parametrize(
    ("rule", "question", "text", "fires"),
    [
        # Abstracts exported to JSON twice over hold their line breaks as the two characters "\n".
        ("aim", "Macrolides raise the risk of IHPS.", "\\n OBJECTIVE To assess the association of macrolides.", True),
        ("aim", "What did the study aim to show?", "This study aimed to show that macrolides raise the risk.", False),
        ("methods", "Macrolides raise the risk of IHPS.", "DESIGN Population-based cohort of 1 million infants.", True),
        ("methods", "How many infants took part?", "DESIGN Population-based cohort of 1 million infants.", False),
        ("methods", "Aspirin lowers the risk of cancer.", "MAIN OUTCOMES Cancer. RESULTS Aspirin lowered it.", False),
        ("methods", "Macrolides raise the risk of IHPS.", "RESULTS Macrolide use raised the risk (RR 3.4).", False),
        ("methods", "Amitriptyline treats headache.", "Forty-one sufferers were randomly assigned to it.", True),
        ("background", "H. pylori causes gastric cancer.", "\\n BACKGROUND & AIMS H. pylori is a cause.", True),
        ("background", "Anthrax spores stay deadly.", "Background radiation was higher in the Hart building.", False),
        ("background", "Why was the Hart building studied?", "CONTEXT Attacks contaminated the Hart building.", False),
        ("gap", "AMPK reduces lung fibrosis.", "However, the role of AMPK in fibrosis is not well understood.", True),
        ("gap", "Niches are round.", "Niches are round. Their size is set by consumers. Why is unknown.", False),
        ("gap", "Who did not know of the Rhine?", "The Rhine was not known to Herodotus.", False),
    ],
    ids=[
        "aim-label-after-an-escaped-line-break", "aim-asked-about", "methods-label", "methods-asked-about",
        "methods-running-on-into-results", "results-label", "methods-unlabelled",
        "background-label-after-an-escaped-line-break", "background-as-a-plain-word", "background-asked-about",
        "gap", "gap-after-a-finding", "gap-asked-about",
    ],
)  # fmt: skip
def test_what_is_not_a_finding_is_told_by_its_label_and_by_what_was_asked(
    rule: str, question: str, text: str, fires: bool
) -> None:
    assert NOT_FINDINGS[rule](question, text) is fires


def quoted_over(claim: str, distractor: str, finding: str) -> List[str]:
    """The one quote for ``claim``, with the structured-abstract rules on, from a passage of ``distractor`` then
    ``finding``, and (asserted) the distractor's quote with them off."""
    texts = [f"{distractor} {finding}", "Pancreatic enzymes were measured in 40 volunteers after a fast."]
    scorer = EvidenceScorer(corpus=texts)
    nodes = [NodeWithScore(node=TextNode(text=t)) for t in texts]
    quoter = EvidenceQuoter(scorer, max_quotes=1, strip_min_tokens=3, answer_threshold=0.0)
    assert [q.text for q in quoter.quote(claim, nodes).quotes] == [distractor]
    ruled = EvidenceQuoter(
        scorer, max_quotes=1, strip_min_tokens=3, answer_threshold=0.0, preset="structured_abstracts"
    )
    return [q.text for q in ruled.quote(claim, nodes).quotes]


def test_the_quoter_never_quotes_a_hypothesis_for_the_finding() -> None:
    # The hypothesis shares every word of the claim and grades best; quoted, it would read as the evidence.
    claim = "Elevated cell-free mitochondrial DNA levels are associated with mortality in intensive care."
    hypothesis = "We hypothesized that elevated cell-free mitochondrial DNA levels are associated with mortality."
    finding = "In intensive care, patients with elevated mitochondrial DNA levels died more often within 28 days."
    assert quoted_over(claim, hypothesis, finding) == [finding]


def test_the_quoter_never_quotes_a_claim_from_how_its_study_was_done() -> None:
    # The design names the claim's drug and disease and grades with it; it verifies nothing about them.
    claim = "Macrolide antibiotics raise the risk of infantile hypertrophic pyloric stenosis."
    design = "DESIGN Nationwide cohort of infants exposed to macrolide antibiotics, followed for pyloric stenosis."
    finding = "Infants exposed to macrolides in the first two weeks of life had pyloric stenosis 30 times as often."
    assert quoted_over(claim, design, finding) == [finding]
    # Asked, the design may answer.
    assert describes_methods("Which infants were followed?", design) is False


def test_the_quoter_never_quotes_a_claim_from_what_was_known_before_its_study() -> None:
    # The background states the claim's subject in its words and grades with it; it verifies nothing.
    claim = "Bariatric surgery lowers the rate of colorectal cancer."
    background = "BACKGROUND Bariatric surgery is a common treatment that may change the rate of colorectal cancer."
    finding = "Operated patients had colorectal tumours half as often in ten years of follow-up."
    assert quoted_over(claim, background, finding) == [finding]


def test_quotes_keep_document_order_within_a_passage(embed_model: Any) -> None:
    scorer = MarkerScorer({"approved in march": 0.8, "alpha project budget for 2024": 0.9})
    engine = make_engine(
        scorer, ScriptedLLM(), primary=[ALPHA], answer_mode="extract", strip_min_tokens=3, quote_threshold=0.0
    )
    trace = crag(engine.query(QUESTION))
    assert [q["text"] for q in trace["quotes"]] == [
        "The alpha project budget for 2024 is 3.2 million euros.",
        "It was approved in March by the board.",
    ]


def test_a_code_block_or_a_table_is_quoted_with_its_lines(embed_model: Any) -> None:
    code = "```python\ndef retry_delay(attempt):\n    if attempt > 5:\n        return 30\n    return 2 ** attempt\n```"
    table = "| Region | Uptime |\n|---|---|\n| EU-2 | 99.2% |\n| US-1 | 99.95% |"
    prose = "The Lisbon office opens at nine in the morning\non weekdays (a line the editor wrapped)."
    nodes = [TextNode(text=code, metadata={"title": "SDK retry"}), TextNode(text=table), TextNode(text=prose)]
    engine = CorrectiveQueryEngine.from_defaults(nodes=nodes, embed_model=embed_model, max_quotes=1)
    quoted = crag(engine.query("What does retry_delay return after attempt 5?"))["quotes"]
    assert [q["text"] for q in quoted] == [code]  # indentation is Python's meaning
    assert f'"{code}" (SDK retry, ' in str(engine.query("What does retry_delay return after attempt 5?"))
    assert [q["text"] for q in crag(engine.query("What was the uptime of EU-2?"))["quotes"]] == [table]
    trace = crag(engine.query("When does the Lisbon office open?"))
    assert [q["text"] for q in trace["quotes"]] == [" ".join(prose.split())]  # a wrapped sentence is one line


def test_extract_mode_streams_the_quotes_in_one_piece(sample_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index, answer_mode="extract", streaming=True)
    response = engine.query("Who is the chief executive officer of Harbor Analytics?")
    assert "Miriam Okafor" in "".join(response.response_gen)


@pytest.mark.parametrize(("llm", "mode"), [(None, "extract"), (MockLLM(), "extract"), (ScriptedLLM(), "generate")])
def test_the_answer_mode_follows_the_generator(llm: Any, mode: str) -> None:
    assert default_answer_mode(llm) == mode


def test_an_engine_without_any_llm_quotes(sample_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index, fallback_sources=("bm25",))
    assert engine.answer_mode == "extract"
    trace = crag(engine.query("What is the boiling point of mercury?"))
    assert trace["rewrite_source"] == "keyword" and trace["abstained"]


# --- the check of a generated answer ----------------------------------------------------------------------------


@pytest.fixture
def checker() -> GroundednessChecker:
    return GroundednessChecker()


def test_an_answer_from_its_sources_is_grounded(checker: GroundednessChecker) -> None:
    check = checker.check("The EU-2 outage in June 2023 lasted 4 hours and 14 minutes.", [OUTAGE])
    assert check.status == "checked" and check.grounded is True and check.unsupported == []


@pytest.mark.parametrize(
    ("answer", "unsupported"),
    [
        ("The June 2023 EU-2 outage lasted 14 days.", "14 days"),
        ("The outage lasted 4 hours and affected 118% of EU-2 customers.", "118%"),
        ("The outage was caused by Amazon Web Services.", "Amazon Web Services"),
        ("Customers had to reinstall harbor.js to recover.", "harbor.js"),
    ],
    ids=["wrong-unit", "invented-percent", "invented-name", "invented-code"],
)
def test_a_figure_name_or_code_not_in_the_sources_is_an_unsupported_span(
    checker: GroundednessChecker, answer: str, unsupported: str
) -> None:
    check = checker.check(answer, [OUTAGE], "How long did the June 2023 EU-2 outage last?")
    assert check.grounded is False and unsupported in check.unsupported
    assert check.sentences[0].score < 1.0


def test_a_preamble_with_no_answer_is_not_grounded(checker: GroundednessChecker) -> None:
    check = checker.check("Based on the context information and not prior knowledge, the answer is:", [OUTAGE])
    assert check.grounded is False and "nothing that can be checked" in (check.reason or "")


def test_every_sentence_gets_a_score(checker: GroundednessChecker) -> None:
    check = checker.check("The outage lasted 4 hours and 14 minutes. The CEO resigned in 1999.", [OUTAGE])
    assert [s.grounded for s in check.sentences] == [True, False] and len(check.sentences) == 2
    assert check.sentences[0].score > check.sentences[1].score and "1999" in check.unsupported


@pytest.mark.parametrize("answer", ["", "   \n "])
def test_an_empty_answer_is_checked_and_not_grounded(checker: GroundednessChecker, answer: str) -> None:
    check = checker.check(answer, [OUTAGE])
    assert check.status == "checked" and check.grounded is False and "empty" in (check.reason or "")


def test_an_answer_in_another_language_is_unchecked_never_grounded(checker: GroundednessChecker) -> None:
    check = checker.check("Der Ausfall dauerte vier Stunden und die Kunden in der Region waren betroffen.", [OUTAGE])
    assert check.status == "other_language" and check.grounded is None


def test_an_answer_longer_than_its_context_is_checked_sentence_by_sentence(checker: GroundednessChecker) -> None:
    answer = " ".join(["The outage lasted 4 hours and 14 minutes."] * 10)
    check = checker.check(answer, [OUTAGE])
    assert check.longer_than_context and check.status == "checked" and check.grounded is True


def test_an_answer_with_more_sentences_than_checked_is_not_grounded() -> None:
    check = GroundednessChecker(max_sentences=2).check(" ".join(["The outage lasted 4 hours."] * 3), [OUTAGE])
    assert check.grounded is False and "only the first 2" in (check.reason or "")


class Broken(MarkerScorer):
    """Scores queries as usual but fails when asked to score an answer sentence."""

    def score_texts(self, query: str, texts: Sequence[str]) -> List[float]:
        if query.startswith("ANSWER") or "budget is" in query:
            raise RuntimeError("scorer crashed")
        return super().score_texts(query, texts)


def test_a_grader_error_during_the_check_leaves_the_answer_unchecked() -> None:
    checker = GroundednessChecker(Broken({}), use_scorer=True)
    check = checker.check("The alpha project budget is 3.2 million euros.", [ALPHA.text])
    assert check.status == "error" and check.grounded is None and "scorer crashed" in (check.reason or "")


def test_the_grader_scores_each_sentence_when_asked() -> None:
    checker = GroundednessChecker(MarkerScorer({"alpha project budget": 0.9}, default=0.1), use_scorer=True)
    check = checker.check("The alpha project budget is 3.2 million euros.", [ALPHA.text])
    assert check.sentences[0].grader_score == 0.9 and check.grounded is True


# --- the check in the engine ------------------------------------------------------------------------------------

WRONG = "The alpha project budget is 118% of 14 days."
RIGHT = "The alpha project budget for 2024 is 3.2 million euros."


def _checked_engine(answer: str, **settings: Any) -> CorrectiveQueryEngine:
    return make_engine(MarkerScorer(ALPHA_SCORER), Answering(answer=answer), primary=[ALPHA, BETA], **settings)


def test_a_grounded_answer_is_kept_and_its_check_is_in_the_trace() -> None:
    response = _checked_engine(RIGHT).query(QUESTION)
    trace = crag(response)
    assert str(response) == RIGHT and trace["answered_by"] == "generate" and trace["grounded"] is True
    check = trace["answer_check"]
    assert check["outcome"] == "kept" and check["sentences"][0]["score"] == 1.0 and trace["timings_ms"]["check"] > 0


def test_flag_keeps_an_ungrounded_answer_marked_with_the_evidence_beside_it() -> None:
    response = _checked_engine(WRONG, on_ungrounded="flag").query(QUESTION)
    trace = crag(response)
    assert str(response) == WRONG and trace["grounded"] is False and trace["answer_check"]["outcome"] == "flagged"
    assert {"118%", "14 days"} <= set(trace["answer_check"]["unsupported"])
    assert trace["quotes"] and "3.2 million" in trace["quotes"][0]["text"]


def test_flag_keeps_withheld_quotes_in_the_trace_as_weak_evidence() -> None:
    # No strip reaches a quote threshold of 1: the best is withheld, and a flagged answer is kept.
    trace = crag(_checked_engine(WRONG, on_ungrounded="flag", quote_threshold=1.0).query(QUESTION))
    assert trace["answered_by"] == "generate" and trace["answer_check"]["outcome"] == "flagged"
    check = trace["quote_check"]
    assert trace["quotes"] == [] and check["passed"] is False and check["grade"] < 1.0
    assert "3.2 million" in check["withheld"][0]["text"]


def test_extract_never_gives_withheld_quotes_and_says_why_it_abstained() -> None:
    trace = crag(_checked_engine(WRONG, on_ungrounded="extract", quote_threshold=1.0).query(QUESTION))
    assert trace["abstained"] and trace["answered_by"] == "abstain" and trace["quotes"] == []
    assert "failed its check" in trace["abstain_reason"]
    grade = trace["quote_check"]["grade"]
    assert (
        f"; no quotes were given instead: the answer model gives its best strip {grade:.3f}, under the quote "
        "threshold 1.000" in trace["abstain_reason"]
    )


def test_extract_replaces_an_ungrounded_answer_with_the_quoted_evidence() -> None:
    response = _checked_engine(WRONG, on_ungrounded="extract").query(QUESTION)
    trace = crag(response)
    assert str(response).startswith(QUOTED_HEADER) and "3.2 million euros" in str(response)
    assert trace["answered_by"] == "extract" and trace["answer_mode"] == "generate" and trace["grounded"] is False


def test_abstain_turns_an_ungrounded_answer_into_an_abstention() -> None:
    response = _checked_engine(WRONG, on_ungrounded="abstain").query(QUESTION)
    trace = crag(response)
    assert trace["abstained"] and "failed its check" in trace["abstain_reason"] and "118%" in trace["abstain_reason"]
    assert str(response).startswith("I don't know") and trace["answered_by"] == "abstain"


def test_an_empty_generated_answer_becomes_the_quoted_evidence() -> None:
    trace = crag(_checked_engine("").query(QUESTION))
    assert trace["answered_by"] == "extract" and trace["answer_check"]["reason"] == "the answer is empty"


def test_the_check_can_be_turned_off() -> None:
    trace = crag(_checked_engine(WRONG, check_answers=False).query(QUESTION))
    assert trace["answered_by"] == "generate" and trace["answer_check"] is None and trace["grounded"] is None


def test_a_grader_error_in_the_engines_check_is_never_presented_as_checked() -> None:
    engine = make_engine(
        Broken(ALPHA_SCORER), Answering(answer=RIGHT.replace("for 2024 ", "")), primary=[ALPHA], check_with_grader=True
    )
    trace = crag(engine.query(QUESTION))
    assert trace["grounded"] is None and trace["answer_check"]["status"] == "error"
    assert trace["answered_by"] == "extract"


async def test_the_async_path_checks_too() -> None:
    trace = crag(await _checked_engine(WRONG).aquery(QUESTION))
    assert trace["grounded"] is False and trace["answered_by"] == "extract"


def test_a_streamed_answer_is_checked_when_the_stream_ends() -> None:
    engine = _checked_engine(WRONG, streaming=True)
    response = engine.query(QUESTION)
    assert crag(response)["answer_check"]["status"] == "pending"
    assert "".join(response.response_gen).strip() == WRONG
    check = crag(response)["answer_check"]
    assert check["status"] == "checked" and check["streamed"] and check["outcome"] == "flagged"
    assert crag(response)["grounded"] is False and crag(response)["quotes"]
    assert crag(response)["quote_check"]["passed"] is True


def test_a_stream_cut_midway_is_recorded_as_unchecked() -> None:
    response = _checked_engine(RIGHT, streaming=True).query(QUESTION)
    tokens = response.response_gen
    next(tokens)
    tokens.close()
    check = crag(response)["answer_check"]
    assert check["status"] == "incomplete" and check["grounded"] is None and crag(response)["grounded"] is None


async def test_an_async_stream_is_checked_when_it_ends() -> None:
    response = await _checked_engine(RIGHT, streaming=True).aquery(QUESTION)
    parts = [token async for token in response.response_gen]
    assert "".join(parts).strip() == RIGHT
    await asyncio.sleep(0)
    assert crag(response)["answer_check"]["status"] == "checked" and crag(response)["grounded"] is True


# --- training the answer model ---------------------------------------------------------------------------------


def _sample_sentence_pairs(path: Path) -> int:
    """Question-sentence pairs from the sample corpus: the sentence that holds each answer, and the others."""
    documents = {d.doc_id: d.text for d in load_documents()}
    rows = []
    for question in load_questions():
        for doc in question.relevant_doc_ids:
            for sentence in split_sentences(documents.get(doc, "")):
                label = int(any(a in sentence for a in question.answers))
                rows.append({"question": question.question, "passage": sentence, "label": label, "source": "sample"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return len(rows)


def test_train_answers_writes_a_model_the_engine_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pairs = tmp_path / "pairs.jsonl"
    assert _sample_sentence_pairs(pairs) > 100
    assert main(["train-answers", "--pairs-file", str(pairs), "--out", str(tmp_path / "model"), "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "Answer model trained on" in said and f"CRAG_ANSWER_MODEL={tmp_path / 'model'}" in said
    model = AnswerModel.load(tmp_path / "model")
    assert model.ranker is not None and "held_out_first_answers" in model.info
    pairs_used = model.info["pairs"]
    assert pairs_used["made_by_swapping"] > 0
    assert (
        pairs_used["train"] + pairs_used["held_out"]
        == len(pairs.read_text().splitlines()) + pairs_used["made_by_swapping"]
    )
    monkeypatch.setenv("CRAG_ANSWER_MODEL", str(tmp_path / "model"))
    monkeypatch.setenv("CRAG_QUOTE_THRESHOLD", "0")
    engine = CorrectiveQueryEngine.from_defaults(nodes=[TextNode(text=OUTAGE)], answer_mode="extract")
    assert engine.quoter.model.info == model.info
    trace = crag(engine.query("How long did the June 2023 EU-2 outage last?"))
    assert trace["answered_by"] == "extract" and trace["quotes"]


def test_training_adds_negatives_with_the_asked_figure_or_name_swapped() -> None:
    rows = [
        {"question": "What was ARR in Q2 2023?", "passage": "ARR was $61.4 million in Q2 2023.", "label": 1},
        {"question": "When did the Singapore office open?", "passage": "The Singapore office opened in 2021.",
         "label": 1},
        {"question": "When did the Toronto office open?", "passage": "The Toronto office opened in 2020.", "label": 0},
    ]  # fmt: skip
    made = swapped(rows)
    assert [(m["kind"], m["label"]) for m in made] == [("figure_swapped", 0), ("name_swapped", 0)]
    figure, name = made
    assert figure["passage"] != rows[0]["passage"] and (
        "Q2" not in figure["passage"] or "2023" not in figure["passage"]
    )
    assert "Singapore" not in name["passage"] and name["passage"].endswith("office opened in 2021.")


def test_the_package_metadata_names_the_code_and_the_data_licences() -> None:
    metadata = importlib.metadata.metadata("llama-index-crag")
    assert metadata["License-Expression"] == "MIT AND CC-BY-SA-4.0"
    files = metadata.get_all("License-File") or []
    assert {"LICENSE", "llama_index_crag/data/grader/NOTICE", "llama_index_crag/data/answer_model/NOTICE"} <= set(files)


# --- the demo ---------------------------------------------------------------------------------------------------


def test_the_demo_quotes_by_default_without_a_generator(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--limit", "2", "--ollama-url", "http://127.0.0.1:9"]) == 0
    out = capsys.readouterr().out
    assert "Generator: none needed" in out and out.count("answer (quoted):") == 2
    assert "Miriam Okafor" in out and "answered by quoting 2, by generating 0" in out


@pytest.mark.parametrize("quote_threshold", [None, 1.0])
def test_the_demo_prints_what_the_sources_say_beside_a_flagged_answer(
    quote_threshold: Optional[float], capsys: pytest.CaptureFixture[str]
) -> None:
    from llama_index_crag.cli.demo import _print_row

    response = _checked_engine(WRONG, on_ungrounded="flag", quote_threshold=quote_threshold).query(QUESTION)
    _print_row(Question("q1", QUESTION), str(response), crag(response), ["alpha"])
    out = capsys.readouterr().out
    assert "answer (generated, NOT SUPPORTED by its sources" in out and WRONG in out
    said = out.split("the sources say", 1)[1]
    assert "3.2 million euros" in said
    # The strip the answer model withheld is shown, and said to be weak, with its probability.
    withheld = bool(quote_threshold) and "under the quote threshold 1.000" in said
    assert ("weakly" in said and "the answer model gives this strip" in said) == withheld == bool(quote_threshold)


_FOUNDED = (
    "Harbor Analytics sells dashboards to retailers. It was founded in 2016 by Miriam Okafor, who still runs it. "
    "Its offices are in Portland and Toronto."
)
_MEETING = (
    "The club was started in 1901 by a group of teachers. {} people attended the first meeting of the club in the "
    "town hall. It now has a library."
)
_LEAGUE = (
    "Rovers won the league in 1998 with a record points total. Athletic finished {} in the league in 1998, two "
    "points behind. United were relegated."
)


@pytest.mark.parametrize(
    ("question", "passage", "answer"),
    [
        ("WHO FOUNDED HARBOR ANALYTICS?", _FOUNDED, "Miriam Okafor"),
        ("who founded harbor analytics", _FOUNDED, "Miriam Okafor"),
        ("Who fonded Harbor Analytcs?", _FOUNDED, "Miriam Okafor"),
        ("How many people attended the first meeting of the club?", _MEETING.format("Over fifty"), "fifty"),
        ("How many people attended the first meeting of the club?", _MEETING.format("About 52"), "52"),
        ("Which team finished 3rd in the league in 1998?", _LEAGUE.format("third"), "third"),
        ("which team finished third in the league in 1998", _LEAGUE.format("3rd"), "3rd"),
        (
            "what did stills ' fellow band members think of the tour",
            "Stills ' fellow band members , Crosby and Nash , thought the tour was a mistake . `` It was a long "
            "year , '' Nash said . The album sold well .",
            "mistake",
        ),
        ("Wer hat Harbor Analytics gegründet?", _FOUNDED, None),
        ("How tall is the lighthouse?", "", None),
        ("How tall is the lighthouse?", "The lighthouse " + "and the long wall " * 3000 + "stands.", None),
    ],
    ids=[
        "capitals", "lower-case", "typos", "number-in-words", "number-in-digits", "ordinal-in-words",
        "ordinal-in-digits", "nq-tokenisation", "german", "empty-passage", "one-long-sentence",
    ],
)  # fmt: skip
def test_the_answer_step_reads_bad_input_to_a_defined_outcome(
    question: str, passage: str, answer: Optional[str]
) -> None:
    nodes = [NodeWithScore(node=TextNode(text=passage, metadata={"title": "Notes"}), score=0.9)]
    scorer = EvidenceScorer(corpus=[passage or "empty"])
    # Every strip read, the one that answers first.
    ranked = EvidenceQuoter(scorer, max_quotes=1, strip_min_tokens=3, answer_threshold=0).quote(question, nodes, 0.5)
    if answer is not None:
        assert len(ranked.quotes) == 1 and answer in ranked.quotes[0].text, ranked
    # The default decision quotes or withholds, and says which in the trace's check; an empty passage has no strip.
    decided = EvidenceQuoter(scorer, strip_min_tokens=3).quote(question, nodes, 0.5)
    if not passage:
        assert decided.quotes == [] and decided.grade is None and decided.check() is None
        return
    check = decided.check()
    assert check is not None and 0.0 <= check["grade"] <= 1.0 and check["evidence_place"] == 0.5
    assert check["passed"] is bool(decided.quotes) and (check["passed"] or len(check["withheld"]) == 1)


_SETTINGS_PAGE = (
    "checkpoint_timeout (integer): the longest time between automatic WAL checkpoints. The default is five "
    "minutes. checkpoint_completion_target (floating point): the target of checkpoint completion, as a fraction "
    "of total time between checkpoints. The default is 0.9."
)


@pytest.mark.parametrize(
    ("question", "asked"),
    [
        ("What is the default value of checkpoint_segments?", False),
        ("What is the default value of checkpoint_timeout?", True),
        ("What is the default value of Checkpoint_Timeout?", True),
    ],
)  # fmt: skip
def test_a_setting_the_documents_do_not_name_gets_no_quote_of_its_neighbours_default(
    question: str, asked: bool
) -> None:
    nodes = [NodeWithScore(node=TextNode(text=_SETTINGS_PAGE, metadata={"title": "Checkpoints"}), score=0.9)]
    quoter = EvidenceQuoter(EvidenceScorer(corpus=[_SETTINGS_PAGE]), strip_min_tokens=3, answer_threshold=0.0)
    answer = quoter.quote(question, nodes)
    assert bool(answer.quotes) is asked, answer
    if not asked:
        assert answer.withheld, "the most probable strip is kept in the trace as withheld"


def test_an_identifier_the_user_names_before_asking_is_not_asked_about() -> None:
    # "my_cluster" is the user's own name for what they ran; the question asks about checkpoint_timeout.
    nodes = [NodeWithScore(node=TextNode(text=_SETTINGS_PAGE, metadata={"title": "Checkpoints"}), score=0.9)]
    quoter = EvidenceQuoter(EvidenceScorer(corpus=[_SETTINGS_PAGE]), strip_min_tokens=3, answer_threshold=0.0)
    told = "I started my_cluster and it checkpoints too often. What is the default value of checkpoint_timeout?"
    answer = quoter.quote(told, nodes)
    assert answer.quotes and answer.unnamed == [], answer
    # Asked about, the same name still withholds the quote.
    assert not quoter.quote("What is the default checkpoint_timeout of my_cluster?", nodes).quotes


def test_the_engine_abstains_on_a_setting_no_passage_names_and_says_which() -> None:
    # The passage grades CORRECT and a quote threshold of 0 quotes anything: only the missing name withholds it.
    page = TextNode(text=_SETTINGS_PAGE, metadata={"title": "Checkpoints"})
    engine = make_engine(
        MarkerScorer({"checkpoint": 0.95}), ScriptedLLM(), primary=[page], answer_mode="extract", quote_threshold=0.0
    )
    trace = crag(engine.query("What is the default value of checkpoint_segments?"))
    assert trace["action"] == "correct" and trace["abstained"] and trace["quotes"] == []
    assert trace["quote_check"]["unnamed"] == ["checkpoint_segments"] and trace["quote_check"]["withheld"]
    assert "do not name checkpoint_segments, which the question asks about" in trace["abstain_reason"]
    named = crag(engine.query("What is the default value of checkpoint_timeout?"))
    assert not named["abstained"] and named["quote_check"]["unnamed"] == []
    assert any("five minutes" in q["text"] for q in named["quotes"])


def test_an_identifier_named_anywhere_in_the_context_lets_a_sibling_passage_answer() -> None:
    # Documentation states one object's facts under a sibling's name: the strip is quotable when the name the
    # question asks about stands in another retrieved passage.
    sibling = "pg_stat_user_tables: same as pg_stat_all_tables, except that only user tables are shown."
    table = "n_live_tup: estimated number of live rows. n_dead_tup: estimated number of dead rows."
    nodes = [NodeWithScore(node=TextNode(text=t), score=0.9) for t in (sibling, table)]
    quoter = EvidenceQuoter(EvidenceScorer(corpus=[sibling, table]), strip_min_tokens=3, answer_threshold=0.0)
    question = "Which pg_stat_user_tables column gives the estimated number of dead rows?"
    assert any("n_dead_tup" in q.text for q in quoter.quote(question, nodes).quotes)
    alone = quoter.quote(question, nodes[1:])
    assert alone.quotes == [] and alone.withheld


@pytest.mark.parametrize(
    ("question", "found"),
    [
        ("What is the default value of checkpoint_segments?", ["checkpoint_segments"]),
        ("Which pg_dump switch excludes --exclude-extension and -T?", ["pg_dump", "--exclude-extension"]),
        ("Is a well-known e-mail co-op a name?", []),
        ("5'-nucleotidase metabolizes 6MP; histone 2A (H2A)-histone 2B", []),
        ("Who founded Procter and Gamble in 1837?", []),
    ],
)  # fmt: skip
def test_the_identifiers_a_question_names_are_underscored_words_and_long_options(
    question: str, found: List[str]
) -> None:
    assert IDENTIFIER.findall(question) == found


def test_the_demo_says_a_withheld_strip_was_withheld_for_a_name_no_source_holds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from llama_index_crag.cli.demo import _print_evidence, _print_row

    page = TextNode(text=_SETTINGS_PAGE, metadata={"title": "Checkpoints"})
    engine = make_engine(
        MarkerScorer({"checkpoint": 0.95}), ScriptedLLM(), primary=[page], answer_mode="extract", quote_threshold=0.0
    )
    question = "What is the default value of checkpoint_segments?"
    response = engine.query(question)
    _print_row(Question("q1", question), str(response), crag(response), [])
    out = capsys.readouterr().out
    assert (
        "why: no strip of the graded passages answers the question: the passages do not name checkpoint_segments" in out
    )
    # Beside a generated answer that failed its check, the withheld strip is shown with the same reason.
    _print_evidence({"quotes": [], "quote_check": crag(response)["quote_check"]})
    said = capsys.readouterr().out
    assert "weakly (they do not name checkpoint_segments, which the question asks about)" in said
    assert "checkpoint_timeout" in said or "checkpoint_completion_target" in said


def _entries(*entries: str) -> List[NodeWithScore]:
    """Passages of a reference page as ingest chunks them: each entry under its term's heading."""
    return [
        NodeWithScore(node=TextNode(text=text, metadata={"title": "Automatic Vacuuming"}), score=0.9)
        for text in entries
    ]


_FREEZE_MIN = (
    "#### vacuum_freeze_min_age (integer)\n\nSpecifies the cutoff age that vacuum uses to freeze rows. The default "
    "is 50 million transactions, at most half the value of autovacuum_freeze_max_age."
)
_FREEZE_MAX = (
    "#### autovacuum_freeze_max_age (integer)\n\nSpecifies the maximum age a table reaches before a forced vacuum. "
    "The default is 200 million transactions."
)


def test_a_strip_in_another_settings_entry_is_set_aside_even_where_it_names_the_setting_asked() -> None:
    question = "What is the default value of autovacuum_freeze_max_age?"
    quoter = EvidenceQuoter(EvidenceScorer(corpus=[_FREEZE_MIN, _FREEZE_MAX]), strip_min_tokens=3, answer_threshold=0.0)
    alone = quoter.quote(question, _entries(_FREEZE_MIN))
    assert alone.quotes == [] and alone.set_aside, alone
    assert alone.set_aside[0]["why"] == "it stands in the entry for vacuum_freeze_min_age (integer)"
    assert "set aside (it stands in the entry for vacuum_freeze_min_age" in alone.why_withheld()
    both = quoter.quote(question, _entries(_FREEZE_MIN, _FREEZE_MAX))
    said = " ".join(q.text for q in both.quotes)
    assert "200 million" in said and "50 million" not in said, both


@pytest.mark.parametrize(
    ("question", "entry", "other"),
    [
        ("What is the default value of autovacuum_freeze_max_age?", "vacuum_freeze_min_age (integer)", True),
        ("What is the default value of autovacuum_freeze_max_age?", "autovacuum_freeze_max_age (integer)", False),
        ("What does --no-owner do?", "-O --no-owner", False),
        ("What does --no-owner do?", "-x --no-privileges --no-acl", True),
        # a question about a program is answered in the entries of its options
        ("If I run pg_ctl stop without -m, which mode is used?", "-m mode --mode=mode", False),
        ("What is the default value of work_mem?", "19.4.1. Memory", False),  # a section's title names nothing
        ("What is the default value of the brine buffers?", "vacuum_freeze_min_age (integer)", False),
    ],
)  # fmt: skip
def test_the_entry_a_strip_stands_in_is_another_when_it_names_another_identifier_of_the_form_asked(
    question: str, entry: str, other: bool
) -> None:
    said = f"#### {entry}\n\nThe default is 4MB."
    candidate = Candidate(
        "The default is 4MB.", "The default is 4MB.", f"Settings {said}", entry_above(said, len(said))
    )
    assert (other_entry(question, candidate) == entry) is other


def test_a_question_about_a_default_is_answered_by_the_strip_that_states_it() -> None:
    page = (
        "#### rind_work_mem (integer)\n\nSets the base memory that turning a wheel of cheese uses before it spills "
        "to the cellar floor. The default is four megabytes."
    )
    quoter = EvidenceQuoter(EvidenceScorer(corpus=[page]), strip_min_tokens=3, answer_threshold=0.0)
    answer = quoter.quote("What is the default value of rind_work_mem?", _entries(page))
    assert [q.text for q in answer.quotes] == ["The default is four megabytes."], answer
    # The sentence does not say whose default it is: the answer names the entry it stands in.
    assert answer.quotes[0].entry == "rind_work_mem (integer)"
    cited = f"{answer.quotes[0].source}, under rind_work_mem (integer)"
    assert answer.text.endswith(f'"The default is four megabytes." ({cited})'), answer.text
    assert answer.set_aside and answer.set_aside[0]["why"] == "it states no default, which the question asks for"
    # Asked for what it sets, the strip that states no default answers.
    what = quoter.quote("What does rind_work_mem set?", _entries(page))
    assert any("Sets the base memory" in q.text for q in what.quotes) and not what.set_aside


_RIND_CLASSES = (
    "#### Rind Indexing\n\nTwo rind classes are provided. The default rind class for brine supports lookups with the "
    "salt-exists operators, the containment operator and the path match operators. The non-default rind class "
    "brine_path_ops does not support the salt-exists operators, but it does support containment."
)
_KEEPS_NEGATION = (
    "The non-default rind class brine_path_ops does not support the salt-exists operators, but it does support "
    "containment."
)


def test_a_negated_question_is_answered_by_the_strip_that_keeps_its_negation() -> None:
    question = "Which brine rind class cannot serve the salt-exists operators?"
    scorer = EvidenceScorer(corpus=[_RIND_CLASSES, "The cellar keeps its wheels at ten degrees."])
    turned = FEATURES.index("turned_round")
    # Two sentences hold as many of the question's words, and one negates: the passage is not turned round...
    assert scorer.features(question, [_RIND_CLASSES])[0, turned] == 0.0
    # ... where a passage whose one best sentence negates nothing is.
    stated = _RIND_CLASSES.split(" The non-default")[0]
    assert scorer.features(question, [stated])[0, turned] == 1.0
    quoter = EvidenceQuoter(scorer, strip_min_tokens=3, answer_threshold=0.0, max_quotes=1)
    answer = quoter.quote(question, _entries(_RIND_CLASSES))
    assert [q.text for q in answer.quotes] == [_KEEPS_NEGATION], answer
    assert TURNED_ROUND_WHY in {s["why"] for s in answer.set_aside}, answer.set_aside
    # Asked the other way round, nothing is turned round and nothing set aside.
    asked = quoter.quote("Which brine rind class supports the salt-exists operators?", _entries(_RIND_CLASSES))
    assert asked.quotes and not asked.set_aside, asked


def test_a_strip_holding_more_of_a_negated_questions_words_is_not_set_aside_for_a_lesser_negation() -> None:
    # SQuAD's negated questions are often answered in other words ("... remained outside the union"): the network
    # weighs that, and only a strip that negates with as many of the question's words sets another aside.
    page = "The members of each committee reflect the balance of parties across Parliament. The chair is not elected."
    quoter = EvidenceQuoter(EvidenceScorer(corpus=[page]), strip_min_tokens=3, answer_threshold=0.0)
    answer = quoter.quote("Which committees do not reflect the balance of parties across Parliament?", _entries(page))
    assert TURNED_ROUND_WHY not in {s["why"] for s in answer.set_aside}, answer.set_aside


def test_a_quote_that_holds_its_entry_or_stands_under_none_names_no_entry() -> None:
    quoter = EvidenceQuoter(EvidenceScorer(corpus=["x"]), strip_min_tokens=3, answer_threshold=0.0)
    page = "#### rind_work_mem (integer)\n\nrind_work_mem (integer) sets the base memory a wheel uses. It is 4MB."
    said = quoter.quote("What does rind_work_mem set?", _entries(page)).quotes
    assert said and all(q.entry == "" for q in said if "rind_work_mem (integer)" in q.text), said
    prose = quoter.quote("What does the wheel use?", _entries("The wheel uses the base memory of the cellar.")).quotes
    assert prose and all(q.entry == "" for q in prose) and "under" not in prose[0].cited


def test_a_question_about_an_option_left_out_is_answered_by_the_strip_that_states_the_default() -> None:
    # The option's entry describes it first; what applies without it is the sentence that states the default.
    page = (
        "#### -m mode --mode=mode\n\nSpecifies the ripening mode of the press. mode can be slow, fast or cold, or "
        "the first letter of one of these three. If this option is omitted, fast is the default."
    )
    quoter = EvidenceQuoter(EvidenceScorer(corpus=[page]), strip_min_tokens=3, answer_threshold=0.0)
    answer = quoter.quote("If I run the press without -m, which ripening mode is used?", _entries(page))
    assert [q.text for q in answer.quotes] == ["If this option is omitted, fast is the default."], answer
    assert [s["why"] for s in answer.set_aside] == ["it states no default, which the question asks for"] * len(
        answer.set_aside
    ) and answer.set_aside


def test_a_question_about_a_file_is_answered_only_by_a_strip_that_names_one() -> None:
    page = (
        "#### Rind Name Maps\n\nWhen a cellar uses an outside ledger, the name on the ledger might not be the "
        "cheesemaker's own. In this case, a rind name map can be applied to map the ledger name to a cheesemaker. "
        "Rind name maps are defined in the rind map file, which by default is named rind_ident.conf."
    )
    quoter = EvidenceQuoter(EvidenceScorer(corpus=[page]), strip_min_tokens=3, answer_threshold=0.0)
    question = "Which file maps ledger names to cheesemakers?"
    answer = quoter.quote(question, _entries(page))
    assert [q.text for q in answer.quotes] == [
        "Rind name maps are defined in the rind map file, which by default is named rind_ident.conf."
    ], answer
    assert {s["why"] for s in answer.set_aside} == {"it names no file, which the question asks for"}
    # Without the strip that names it, nothing about the maps answers "which file".
    without = page.rsplit(" Rind name maps", 1)[0]
    assert not quoter.quote(question, _entries(without)).quotes


def test_the_engine_abstains_on_a_neighbouring_entry_and_says_why() -> None:
    page = TextNode(text=_FREEZE_MIN, metadata={"title": "Automatic Vacuuming"})
    engine = make_engine(
        MarkerScorer({"freeze": 0.95}), ScriptedLLM(), primary=[page], answer_mode="extract", quote_threshold=0.0
    )
    trace = crag(engine.query("What is the default value of autovacuum_freeze_max_age?"))
    assert trace["action"] == "correct" and trace["abstained"] and trace["quotes"] == []
    assert "it stands in the entry for vacuum_freeze_min_age (integer)" in trace["abstain_reason"]
    assert any("50 million" in strip["text"] for strip in trace["quote_check"]["set_aside"])


def test_the_engine_searches_for_the_asked_entry_by_name_when_it_retrieved_only_a_neighbour() -> None:
    # Retrieval found the neighbouring entry (it names the asked setting); the fallback holds the asked one's own.
    neighbour = TextNode(text=_FREEZE_MIN, id_="freeze-min", metadata={"title": "Automatic Vacuuming"})
    own = TextNode(text=_FREEZE_MAX, id_="freeze-max", metadata={"title": "Automatic Vacuuming"})
    elsewhere = TextNode(text="The orchard holds a harvest fair every October.", id_="fair")
    fallback = FallbackRetriever.from_nodes([neighbour, own, elsewhere], sources=("bm25",), similarity_top_k=2)
    engine = make_engine(
        MarkerScorer({"freeze": 0.95}),
        ScriptedLLM(),
        primary=[neighbour],
        fallback=fallback,
        answer_mode="extract",
        quote_threshold=0.0,
    )
    response = engine.query("What is the default value of autovacuum_freeze_max_age?")
    trace = crag(response)
    assert trace["action"] == "correct" and not trace["abstained"], trace["abstain_reason"]
    assert trace["entry_search"] == "autovacuum_freeze_max_age"
    said = " ".join(q["text"] for q in trace["quotes"])
    assert "200 million" in said and "50 million" not in said, said
    assert {q["node_id"] for q in trace["quotes"]} == {"freeze-max"}
    assert "fair" not in {n.node.node_id for n in response.source_nodes}

    # Where the fallback has no such entry, the abstention stands and says that the search was made.
    bare = make_engine(
        MarkerScorer({"freeze": 0.95}),
        ScriptedLLM(),
        primary=[neighbour],
        fallback=FallbackRetriever.from_nodes([elsewhere], sources=("bm25",), similarity_top_k=2),
        answer_mode="extract",
        quote_threshold=0.0,
    )
    trace = crag(bare.query("What is the default value of autovacuum_freeze_max_age?"))
    assert trace["abstained"] and trace["entry_search"] == "autovacuum_freeze_max_age"
    assert "a search for autovacuum_freeze_max_age by name did not answer it either" in trace["abstain_reason"]
    # A question that names no identifier is never searched for by name.
    trace = crag(engine.query("What does vacuum freeze?"))
    assert trace["entry_search"] is None


def test_a_quote_leaves_out_the_marks_of_its_headings_but_not_a_number_sign_in_a_sentence() -> None:
    page = "#### rind_work_mem (integer)\n\nSets the base memory for turning wheels. The default is four megabytes."
    chart = "The song peaked at # 3 on the cellar chart in 1968, and Grange # 1 sang it first."
    quoter = EvidenceQuoter(EvidenceScorer(corpus=[page, chart]), strip_min_tokens=3, answer_threshold=0.0)
    heading = quoter.quote("What does rind_work_mem set?", _entries(page))
    assert heading.quotes and not any("#" in q.text for q in heading.quotes), heading
    assert heading.quotes[0].text.startswith("rind_work_mem (integer) Sets the base memory")
    sign = quoter.quote("Where did the song peak on the cellar chart?", _entries(chart))
    assert [q.text for q in sign.quotes] == [chart]
    # A strip that begins inside a line ("no. # 242 ...") keeps its sign; one that opens a heading line loses it.
    listed = "Historical Landmark Reference no. # 242 San Diego Historic Landmark."
    assert shown(Strip("# 242 San Diego Historic Landmark."), listed) == "# 242 San Diego Historic Landmark."
    assert shown(Strip("#### a_b (integer)\n\nSets x."), "#### a_b (integer)\n\nSets x.") == "a_b (integer) Sets x."
    # Nor is "# 242" inside a sentence the heading of an entry.
    assert entry_above(listed, len(listed)) == ""
    assert entry_above("Intro\n\n## a_b (integer)\n\nSets x.", 30) == "a_b (integer)"
    # Nor is a comment line of a script: a heading stands between blank lines, as the readers write it.
    script = "#### work_mem (integer)\n\nRaise it for reports:\n\n# raise max_wal_size too\nSET work_mem = '64MB';"
    assert entry_above(script, len(script)) == "work_mem (integer)"
