"""The answer model's ranker: which of the strips that may be quoted comes first."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import pytest
from llama_index.core.schema import NodeWithScore, TextNode

from llama_index_crag.answers.extract import (
    ANSWER_FEATURES,
    META_FILE,
    RANK_FEATURES,
    AnswerModel,
    EvidenceQuoter,
    leads,
    packaged_answer_model,
)
from llama_index_crag.calibration.answer_training import question_leads
from llama_index_crag.datasets import Question
from llama_index_crag.errors import ConfigError
from llama_index_crag.scorers.evidence import EvidenceScorer
from llama_index_crag.text.split import split_sentences

from .check_halves import check_half

#: Two paragraphs of SQuAD 2.0 (CC BY-SA 4.0) whose answering sentence shares fewer of the question's words with
#: the question than its neighbour does, and what it answers.
PARAGRAPHS = [
    (
        "How many Muslims came from around the world to fight in Afghanistan?",
        'While the military effectiveness of these "Afghan Arabs" was marginal, an estimated 16,000 to 35,000 Muslim '
        "volunteers came from around the world came to fight in Afghanistan. The conflict, pitting indigenous "
        "impoverished Muslims (mujahideen) against an anti-religious superpower, galvanized thousands of Muslims "
        "around the world to send aid and sometimes to go themselves to fight for their faith.",
        "16,000 to 35,000",
    ),
    (
        "What kind of interethnic marriage became common in the Jin dynasty?",
        "Interethnic marriage between Han and Jurchen became common at this time. Shi Tianze (Shih T'ien-tse), Zhang "
        "Rou (Chang Jou), and Yan Shi (Yen Shih) and other high ranking Chinese who served in the Jin dynasty and "
        "defected to the Mongols helped build the structure for the administration of the new state.",
        "Han and Jurchen",
    ),
]


def test_a_strip_leads_by_what_it_holds_beyond_the_best_other_strip() -> None:
    rows = np.zeros((3, len(ANSWER_FEATURES)))
    rows[:, : len(RANK_FEATURES)] = [[0.9, 0.5, 0.2, 0.0], [0.6, 0.5, 0.4, 0.0], [0.3, 0.1, 0.4, 0.0]]
    found = leads(rows)
    assert found.shape == (3, len(RANK_FEATURES))
    # The best strip leads the second best; every other strip trails the best; a tie at the top leads nothing.
    assert found[:, 0] == pytest.approx([0.3, -0.3, -0.6])
    assert found[:, 1] == pytest.approx([0.0, 0.0, -0.4])
    assert found[:, 2] == pytest.approx([-0.2, 0.0, 0.0])
    assert not leads(rows[:1]).any() and leads(rows[:0]).shape == (0, len(RANK_FEATURES))


def test_training_reads_each_pair_against_its_own_question_only() -> None:
    rows = [
        {"question": "q1", "source": "squad2", "kind": "sentence_with_answer"},
        {"question": "q1", "source": "squad2", "kind": "sentence_same_paragraph"},
        {"question": "q1", "source": "qnli", "kind": "sentence_entailment"},  # another source: another question
        {"question": "q1", "source": "squad2", "kind": "figure_swapped"},  # made by swapping: no group
    ]
    features = np.zeros((4, len(ANSWER_FEATURES)))
    features[:, 0] = [0.8, 0.5, 0.1, 0.9]
    found = question_leads(rows, features)
    assert found[:, 0] == pytest.approx([0.3, -0.3, 0.0, 0.0])


def _quote(
    model: AnswerModel, question: str, passage: str, threshold: float, quotes: int = 1
) -> Tuple[List[str], List[str], Optional[float]]:
    nodes = [NodeWithScore(node=TextNode(text=passage), score=0.9)]
    quoter = EvidenceQuoter(
        EvidenceScorer(corpus=[passage]), max_quotes=quotes, strip_min_tokens=3, answer_threshold=threshold, model=model
    )
    quoted = quoter.quote(question, nodes)
    return [q.text for q in quoted.quotes], [q.text for q in quoted.withheld], quoted.grade


@pytest.mark.parametrize(("question", "passage", "answer"), PARAGRAPHS, ids=["how-many", "what-kind"])
def test_the_ranker_quotes_the_sentence_that_answers_before_a_neighbour_with_more_of_the_question(
    question: str, passage: str, answer: str
) -> None:
    packaged = packaged_answer_model()
    alone = AnswerModel(packaged.parameters, packaged.info)  # the same network, without its ranker
    assert alone.ranker is None and packaged.ranker is not None
    (first,), _, _ = _quote(packaged, question, passage, threshold=0.0)
    (by_probability,), _, _ = _quote(alone, question, passage, threshold=0.0)
    assert answer in first and answer not in by_probability


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.5, 0.7, 1.0])
@pytest.mark.parametrize(("question", "passage", "answer"), PARAGRAPHS, ids=["how-many", "what-kind"])
def test_whether_anything_is_quoted_is_the_probability_s_alone(
    question: str, passage: str, answer: str, threshold: float
) -> None:
    packaged = packaged_answer_model()
    alone = AnswerModel(packaged.parameters, packaged.info)
    quotes, withheld, grade = _quote(packaged, question, passage, threshold, quotes=2)
    quotes_alone, withheld_alone, grade_alone = _quote(alone, question, passage, threshold, quotes=2)
    # The ranker changes the order of what is quoted, never whether, nor the grade or the strip withheld.
    assert (grade, withheld, bool(quotes)) == (grade_alone, withheld_alone, bool(quotes_alone))
    assert sorted(quotes) == sorted(quotes_alone)  # two sentences: both quoted, or the one that passes


def _first_quote_answers(model: AnswerModel, scorer: EvidenceScorer, question: Question, passage: str) -> bool:
    nodes = [NodeWithScore(node=TextNode(text=passage), score=0.9)]
    quoter = EvidenceQuoter(scorer, max_quotes=1, strip_min_tokens=3, answer_threshold=0.0, model=model)
    quoted = quoter.quote(question.question, nodes).quotes
    return bool(quoted) and any(a in quoted[0].text for a in question.answers)


@cache
def _answered_first(name: str) -> Dict[str, int]:
    """On a check half: how often the packaged model's first quote from an answerable question's own passage (of
    two sentences or more) holds its answer; the same network without its ranker; and the passage's lead sentence."""
    questions, documents = check_half(name)
    packaged = packaged_answer_model()
    alone = AnswerModel(packaged.parameters, packaged.info)
    scorer = EvidenceScorer(corpus=list(documents.values()))
    counts = {"ranker": 0, "probability": 0, "lead": 0, "asked": 0}
    for question in questions:
        if not question.answerable or not question.relevant_doc_ids:
            continue
        passage = documents[question.relevant_doc_ids[0]]
        sentences = split_sentences(passage)
        if len(sentences) < 2:
            continue
        counts["asked"] += 1
        counts["ranker"] += _first_quote_answers(packaged, scorer, question, passage)
        counts["probability"] += _first_quote_answers(alone, scorer, question, passage)
        counts["lead"] += any(a in sentences[0] for a in question.answers)
    return counts


def test_the_packaged_model_quotes_the_answer_first_far_more_often_than_the_lead_sentence() -> None:
    # SQuAD 2.0's check half (2026-12): 52 of 60 first quotes hold the answer, against 18 lead sentences.
    counts = _answered_first("squad2")
    assert counts["asked"] >= 50, counts
    assert counts["ranker"] >= 2 * counts["lead"] and counts["ranker"] >= 0.75 * counts["asked"], counts


def test_the_packaged_ranker_puts_the_answer_first_more_often_than_the_probability_alone() -> None:
    # Check halves (2026-12): SQuAD 2.0 52 against 54 of 60, ClapNQ 95 against 88 of 150; together 147 to 142.
    squad, clapnq = _answered_first("squad2"), _answered_first("clapnq")
    assert squad["ranker"] + clapnq["ranker"] > squad["probability"] + clapnq["probability"], (squad, clapnq)


def test_a_ranker_that_reads_other_features_is_refused(tmp_path: Path) -> None:
    packaged_answer_model().save(tmp_path)
    assert AnswerModel.load(tmp_path).ranker is not None
    meta = json.loads((tmp_path / META_FILE).read_text(encoding="utf-8"))
    meta["rank_features"] = ["coverage_lead"]
    (tmp_path / META_FILE).write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(ConfigError, match="ranker .* reads other features"):
        AnswerModel.load(tmp_path)
    with pytest.raises(ConfigError, match="no ranker"):
        AnswerModel(packaged_answer_model().parameters).read_against(np.zeros((1, len(ANSWER_FEATURES))))
