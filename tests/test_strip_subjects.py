"""Strips that refer back ("It spans ...") are graded with what they refer to, and kept as themselves."""

from __future__ import annotations

from typing import List, Sequence

from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode

from llama_index_crag.answers.extract import EvidenceQuoter
from llama_index_crag.core.refiner import StripRefiner
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.scorers.evidence import EvidenceScorer
from llama_index_crag.text.strips import STRIPS_KEY, decompose, refers_back

PAGE = (
    "The Kestrel Bridge in Farrow opened in 1887 after nine years of work. "
    "It spans 312 metres across the Lune estuary and carries the coast road. "
    "Farrow council repainted the railings in a deep green colour in 2019."
)


class SubjectScorer(RelevanceScorer):
    """Scores 0.9 a text that names the bridge and gives a length, else 0.1; records what it was given."""

    name = "subject-scorer"

    def __init__(self) -> None:
        self.seen: List[str] = []

    def score_texts(self, query: str, texts: Sequence[str]) -> List[float]:
        self.seen.extend(texts)
        return [0.9 if "Kestrel Bridge" in t and "metres" in t else 0.1 for t in texts]


def test_sentences_that_refer_back_are_recognised() -> None:
    assert refers_back("It spans 312 metres.") and refers_back("They voted in 2021.")
    assert refers_back("The company reported ARR of $48.2 million.")
    assert not refers_back("Ingrid Halvorsen chairs the cooperative.")
    assert not refers_back("Items in the list are sorted.")


def test_a_pronoun_led_strip_carries_its_subject_not_the_facts_of_the_sentence_before_it() -> None:
    strips = decompose(PAGE, min_tokens=8)
    # The names of the sentence before ("The", a stopword, is not one), not its year or its nine years of work.
    assert [s.context for s in strips] == ["", "Kestrel Bridge Farrow", ""]
    assert strips[1].graded_text == f"Kestrel Bridge Farrow {strips[1].text}"
    # The names stand for the subject. A title would lend the strip the words of every question about its
    # document, which the strips that do not refer back are read without: only the opening strip carries it.
    assert decompose(PAGE, min_tokens=8, title="Bridges of the Lune")[1].context == "Kestrel Bridge Farrow"
    unnamed = (
        "A county council built it over nine years to a local design. "
        "It spans 312 metres across the estuary and carries the coast road."
    )
    assert [s.context for s in decompose(unnamed, 8, "Kestrel Bridge")] == ["", ""]


def test_a_pronoun_led_first_strip_carries_the_title() -> None:
    strips = decompose("It spans 312 metres across the Lune estuary and carries the coast road.", 8, "Kestrel Bridge")
    assert strips[0].context == "Kestrel Bridge"


def test_a_sentence_that_follows_the_answer_does_not_grade_as_the_answer() -> None:
    # Read after the whole sentence before it, "It was repainted ..." held "opened in 1887" too and graded as high
    # as the sentence that answers; read with its subject alone it grades as what it is.
    page = (
        "The Kestrel Bridge in Farrow opened to traffic in 1887. "
        "It was repainted a deep green by the Farrow council in 2019."
    )
    scorer = EvidenceScorer(corpus=[page, "The Lune estuary is wide and shallow.", "Farrow has a harbour."])
    strips = decompose(page, min_tokens=8)
    answer, follower = scorer.score_texts("When did the Kestrel Bridge open?", [s.graded_text for s in strips])
    assert answer > 0.5 and follower < answer - 0.3


def test_the_refiner_grades_the_strip_with_its_subject_and_keeps_the_original_sentence() -> None:
    scorer = SubjectScorer()
    refiner = StripRefiner(scorer, threshold=0.5)
    node = NodeWithScore(node=TextNode(text=PAGE), score=0.6)
    refinement = refiner.refine(QueryBundle("How long is the Kestrel Bridge in Farrow?"), [node])
    kept = [s for s in refinement.strips if s.kept]
    assert [s.text for s in kept] == ["It spans 312 metres across the Lune estuary and carries the coast road."]
    assert refinement.nodes[0].node.get_content() == kept[0].text
    assert any(t.startswith("Kestrel Bridge Farrow It spans 312 metres") for t in scorer.seen)


def test_the_quoter_reads_a_refined_strip_with_the_context_the_refiner_read_it_with() -> None:
    # The refined passage holds only "It spans ...": split again, it would be read without the bridge it names.
    scorer = SubjectScorer()
    question = "How long is the Kestrel Bridge in Farrow?"
    refined = StripRefiner(scorer, threshold=0.5).refine(
        QueryBundle(question), [NodeWithScore(node=TextNode(text=PAGE))]
    )
    read = len(scorer.seen)
    quoter = EvidenceQuoter(scorer, answer_threshold=0.0)
    quotes = quoter.quote(question, refined.nodes).quotes
    # The answer model reads the strip as the refiner graded it, with its subject, and grades nothing again.
    assert len(scorer.seen) == read
    assert [q.text for q in quotes] == ["It spans 312 metres across the Lune estuary and carries the coast road."]
    [(candidate, _, _, _, _)] = quoter.candidates(refined.nodes)
    assert candidate.graded_text.startswith("Kestrel Bridge") and candidate.text == quotes[0].text
    # What the refiner recorded for the quoter stays out of the generator's prompt and the embedding.
    node = refined.nodes[0].node
    assert STRIPS_KEY in node.metadata
    assert STRIPS_KEY not in node.get_content(metadata_mode=MetadataMode.LLM)
    assert STRIPS_KEY not in node.get_content(metadata_mode=MetadataMode.EMBED)


#: A catalog table as an HTML reader writes one whose rows hold a term and its description as two paragraphs.
CATALOG = (
    "#### pg_stat_wheels\n\n"
    "wheel_id integer\n\nIdentifier of the wheel, unique in the cellar\n\n"
    "rind_age interval\n\nTime since the rind was last washed with brine, updated by every turning\n\n"
    "The view holds one row per wheel. It is reset when the cellar restarts."
)


def test_a_strip_never_runs_across_a_blank_line_and_keeps_the_text_as_it_stands() -> None:
    strips = decompose(CATALOG, min_tokens=8)
    texts = [s.text for s in strips]
    # Before, the paragraphs ran together as one sentence (no full stop between them) and were quoted as one.
    assert len(strips) >= 3 and all(t in CATALOG for t in texts), texts  # verbatim slices, line breaks kept
    assert texts[0].startswith("#### pg_stat_wheels\n\nwheel_id integer")  # a heading goes with what it heads
    assert not any("washed with brine" in t and "one row per wheel" in t for t in texts), texts
    assert texts[-1] == "The view holds one row per wheel. It is reset when the cellar restarts."
    # Short sentences still merge: no strip is shorter than the minimum, except a lone text's.
    assert all(len(t.split()) >= 8 for t in texts), texts
    assert [s.text for s in decompose("A short one.\n\nAnother.", min_tokens=8)] == ["A short one.\n\nAnother."]
