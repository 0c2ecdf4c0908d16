"""Quoted-evidence answers: the strips of the context that answer the question, verbatim, with their sources.

Which strips answer is the learned answer model's call (``answers/answer_model.py``),
not a stack of hand rules; nothing is generated.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from llama_index.core.schema import NodeWithScore

from llama_index_crag.answers.answer_model import (
    AnswerModel,
    Candidate,
    QuoteDecision,
    answer_features,
    asked_identifiers,
    entry_above,
    names_no_file,
    other_entry,
    packaged_answer_model,
    states_no_default,
    unnamed_identifiers,
)
from llama_index_crag.answers.sources import source_name
from llama_index_crag.errors import ConfigError
from llama_index_crag.presets import QUOTE_PRESETS, QuoteRule
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.scorers.bi_encoder import bi_encoder_of
from llama_index_crag.scorers.evidence import EvidenceScorer
from llama_index_crag.text.strips import Strip, decompose, kept_strips

#: The line that opens every quoted answer, so that nobody reads it as generated text.
QUOTED_HEADER = "Quoted from the documents (not generated):"


@dataclass(frozen=True)
class Quote:
    """One quoted strip: its text as it stands in the source, where it comes from, and its grade."""

    text: str
    source: str
    node_id: str
    score: float
    #: The entry the strip stands in, when the strip does not say it: the heading above it on its page ("The
    #: default is 30 seconds." under "max_standby_streaming_delay (integer)"); "" otherwise.
    entry: str = ""

    @property
    def cited(self) -> str:
        """Where the quote comes from, as the answer says it: its source, and the entry it stands in."""
        return f"{self.source}, under {self.entry}" if self.entry else self.source


@dataclass(frozen=True)
class QuotedAnswer:
    """The quotes of an extractive answer, in document order.

    ``grade`` is the answer model's probability that the best strip answers the question
    (None when the context held no strip); ``threshold`` the probability a strip needed,
    given ``evidence``, where the grader's grade of the passages sat between its
    thresholds (0 at lower, 1 at upper; None when not given); ``withheld`` holds the best
    strip when it fell under the threshold, or when ``unnamed`` holds identifiers the question names and no
    passage does (``answer_model.unnamed_identifiers``), and nothing was quoted; ``set_aside`` up to three strips
    that could not answer whatever their probability (``set_aside_why``), each with ``text`` and ``why``;
    ``elsewhere`` the identifiers the question names when nothing was quoted and a strip was set aside for standing
    in another identifier's entry: the passages are the asked one's neighbours, and its own entry is to be searched
    for by name.
    """

    quotes: List[Quote]
    grade: Optional[float] = None
    withheld: List[Quote] = field(default_factory=list)
    threshold: float = 0.0
    evidence: Optional[float] = None
    unnamed: List[str] = field(default_factory=list)
    set_aside: List[Dict[str, str]] = field(default_factory=list)
    elsewhere: List[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The answer as a reader sees it: a header, then each quote with its source."""
        if not self.quotes:
            return ""
        lines = [f'"{q.text}" ({q.cited})' for q in self.quotes]
        return "\n".join([QUOTED_HEADER, *lines])

    def why_withheld(self) -> str:
        """Why the best strip was withheld, as the trace says it: the identifiers no passage names, else its
        probability under the threshold."""
        if self.unnamed:
            return (
                f"the passages do not name {', '.join(self.unnamed)}, which the question asks about, so the answer "
                f"model's best strip ({self.grade:.3f}) answers something else"
            )
        if self.set_aside and not self.withheld:
            return f"every strip that could answer was set aside ({self.set_aside[0]['why']})"
        return f"the answer model gives its best strip {self.grade:.3f}, under the quote threshold {self.threshold:.3f}"

    def to_list(self) -> List[Dict[str, Any]]:
        """The quotes as JSON-ready dicts (for the trace)."""
        return [asdict(q) for q in self.quotes]

    def check(self) -> Optional[Dict[str, Any]]:
        """The answer step's check for the trace: the best strip's probability, the threshold it needed at the
        evidence's place, the question's identifiers no passage names, what was withheld and what set aside."""
        if self.grade is None and not self.set_aside:
            return None
        return {
            "grade": self.grade,
            "threshold": self.threshold,
            "evidence_place": self.evidence,
            "passed": not self.withheld,
            "unnamed": list(self.unnamed),
            "withheld": [asdict(q) for q in self.withheld],
            "set_aside": list(self.set_aside),
            "elsewhere": list(self.elsewhere),
        }


def quoted(strip: Strip) -> str:
    """A strip as the answer model reads it: a sentence window on one line, a table or code block with its lines
    and indentation."""
    return strip.text.strip() if strip.whole_block else " ".join(strip.text.split())


def shown(strip: Strip, passage: str) -> str:
    """A strip as quoted to the reader: ``quoted``, less the Markdown marks of the headings it holds ("wal_level
    (enum) Sets ...", not "#### wal_level (enum) Sets ..."): marks that open a line of ``passage``, where the
    readers write headings ("Grange # 1" and "# 242" inside a sentence stay)."""
    if strip.whole_block:
        return quoted(strip)
    text = strip.text.strip()
    start = passage.find(text[:80])
    lines = text.split("\n")
    opens_a_line = start == 0 or (start > 0 and passage[start - 1] == "\n")
    kept = [_HEADING_MARKS.sub("", line) if i or opens_a_line else line for i, line in enumerate(lines)]
    return " ".join(" ".join(kept).split())


#: The marks that open a Markdown heading line ("#### "), which the readers write and nobody quotes.
_HEADING_MARKS = re.compile(r"^[ \t]*#{1,6}[ \t]+")


class SetAside(NamedTuple):
    """Why a strip cannot answer a question whatever its probability: ``kind`` (``OTHER_ENTRY``: it stands in
    another identifier's entry; ``NO_DEFAULT``: the question asks for a default it does not state; ``NO_FILE``: for
    a file it does not name) and ``why``, the reason as the trace gives it."""

    kind: str
    why: str


OTHER_ENTRY = "other_entry"
NO_DEFAULT = "no_default"
NO_FILE = "no_file"


def set_aside_why(question: str, candidate: Candidate) -> Optional[SetAside]:
    """Why ``candidate`` cannot answer ``question`` whatever the answer model's probability, or None: it stands in
    another identifier's entry (``other_entry``), or the question asks for a default it does not state, or for a
    file it does not name."""
    entry = other_entry(question, candidate)
    if entry is not None:
        return SetAside(OTHER_ENTRY, f"it stands in the entry for {entry}")
    if states_no_default(question, candidate):
        return SetAside(NO_DEFAULT, "it states no default, which the question asks for")
    if names_no_file(question, candidate):
        return SetAside(NO_FILE, "it names no file, which the question asks for")
    return None


class EvidenceQuoter:
    """Answers with the strips of the context that answer the question, instead of generating.

    Every context passage is split into knowledge strips (the refiner's ``decompose``;
    a refined passage gives the strips the refiner kept), and the answer model gives each
    the probability that it answers the question (``answers.answer_model``). The first
    ``max_quotes`` strips at or above the quote threshold, in the model's ranking (which
    also reads how each strip leads the others), are quoted, a passage's sentences in
    their own order; when none reaches it, nothing is quoted, the most probable strip is
    kept in the trace as withheld, and the engine abstains. The threshold follows the
    grader's grade of the evidence (the model's ``QuoteDecision``: a strip of passages
    graded near the lower threshold must show more than one of passages graded above the
    upper), or is ``answer_threshold`` whatever the grade.

    Args:
        scorer: The grader's scorer: its word statistics and bi-encoder give the model's features (another kind
            of scorer lends its bi-encoder, with every word weighed the same).
        max_quotes: The most strips quoted.
        strip_min_tokens: Strip size, as the refiner's.
        answer_threshold: The probability a strip must reach to be quoted, whatever the grade; None: the model's
            own decision, fitted on the design halves of the development sets.
        model: The answer model (the packaged one by default).
        preset: Rules a corpus opts into (``presets.QUOTE_PRESETS``): ``structured_abstracts``.
    """

    def __init__(
        self,
        scorer: RelevanceScorer,
        max_quotes: int = 2,
        strip_min_tokens: int = 8,
        answer_threshold: Optional[float] = None,
        model: Optional[AnswerModel] = None,
        preset: Optional[str] = None,
    ) -> None:
        self.scorer = scorer
        self.evidence = _evidence_scorer(scorer)
        self.model = model or packaged_answer_model()
        self.max_quotes = max_quotes
        self.strip_min_tokens = strip_min_tokens
        self.decision: QuoteDecision = (
            self.model.decision if answer_threshold is None else QuoteDecision.constant(float(answer_threshold))
        )
        if preset is not None and preset not in QUOTE_PRESETS:
            raise ConfigError(f"unknown quote preset {preset!r}: choose {', '.join(QUOTE_PRESETS)}")
        self.rules: Tuple[QuoteRule, ...] = QUOTE_PRESETS[preset] if preset else ()

    def candidates(self, nodes: Sequence[NodeWithScore]) -> List[Tuple[Candidate, NodeWithScore, int, int, str]]:
        """Every strip of ``nodes`` as the answer model reads it, with its node, its place (rank, position) and
        its text as quoted (``shown``)."""
        found = []
        for rank, node in enumerate(nodes):
            title = str(node.node.metadata.get("title") or "")
            kept = kept_strips(node)
            whole = node.node.get_content()
            strips: List[Strip] = [s for s, _ in kept] if kept else decompose(whole, self.strip_min_tokens, title)
            for position, strip in enumerate(strips):
                text = quoted(strip)
                if not text:
                    continue
                start = whole.find(strip.text.strip()[:80])
                said = whole if start < 0 else whole[: start + len(strip.text.strip())]
                entry = entry_above(whole, len(said))
                candidate = Candidate(text, strip.graded_text, f"{title} {said}", entry)
                found.append((candidate, node, rank, position, shown(strip, whole)))
        return found

    def threshold(self, place: Optional[float] = None) -> float:
        """The probability a strip needs to be quoted from evidence at ``place`` between the grader's thresholds
        (``answer_model.evidence_place``: 0 at lower, 1 at upper; read as 0 when not known)."""
        return self.decision.threshold(place)

    def quote(self, question: str, nodes: Sequence[NodeWithScore], place: Optional[float] = None) -> QuotedAnswer:
        """The quoted answer to ``question`` from ``nodes`` (empty when they hold no text), their grade at
        ``place``."""
        threshold = round(self.threshold(place), 4)
        evidence = None if place is None else round(place, 4)
        found = self.candidates(nodes)
        if not found:
            return QuotedAnswer([], threshold=threshold, evidence=evidence)
        features = answer_features(question, [f[0] for f in found], self.evidence)
        probabilities = self.model.probabilities(features)
        order = self.model.ranks(features, probabilities)
        unnamed = unnamed_identifiers(question, [f[0] for f in found])
        ranked = sorted(range(len(found)), key=lambda i: -order[i])
        ranked = [i for i in ranked if not any(rule(question, found[i][0].text) for rule in self.rules)]
        why = {i: set_aside_why(question, found[i][0]) for i in ranked}
        set_aside = [{"text": found[i][4], "why": w.why} for i, w in why.items() if w][:3]
        elsewhere = list(asked_identifiers(question)) if any(w and w.kind == OTHER_ENTRY for w in why.values()) else []
        ranked = [i for i in ranked if not why[i]]
        if not ranked:
            return QuotedAnswer([], threshold=threshold, evidence=evidence, set_aside=set_aside, elsewhere=elsewhere)
        seen: set[str] = set()
        chosen: List[int] = []
        for i in ranked:  # the ranker orders the strips; each quoted one must pass the threshold itself
            if len(chosen) == self.max_quotes:
                break
            if not unnamed and probabilities[i] >= threshold and found[i][0].text not in seen:
                seen.add(found[i][0].text)
                chosen.append(i)
        strongest = max(ranked, key=lambda i: probabilities[i])
        best = round(float(probabilities[strongest]), 4)
        if not chosen:
            withheld = [_quote(found[strongest], probabilities[strongest])]
            return QuotedAnswer(
                [],
                grade=best,
                withheld=withheld,
                threshold=threshold,
                evidence=evidence,
                unnamed=unnamed,
                set_aside=set_aside,
                elsewhere=elsewhere,
            )
        chosen.sort(key=lambda i: found[i][2:4])
        quotes = [_quote(found[i], probabilities[i]) for i in chosen]
        return QuotedAnswer(quotes, grade=best, threshold=threshold, evidence=evidence, set_aside=set_aside)

    async def aquote(
        self, question: str, nodes: Sequence[NodeWithScore], place: Optional[float] = None
    ) -> QuotedAnswer:
        """``quote`` off the event loop (reading strips is CPU-bound)."""
        return await asyncio.to_thread(self.quote, question, nodes, place)


def _quote(found: Tuple[Candidate, NodeWithScore, int, int, str], probability: float) -> Quote:
    node, entry = found[1], _entry_unsaid(found[0].entry, found[4])
    return Quote(
        text=found[4],
        source=source_name(node),
        node_id=node.node.node_id,
        score=round(float(probability), 4),
        entry=entry,
    )


#: The longest entry a quote names (a heading longer than that is a sentence, not a name).
MAX_ENTRY_CHARS = 80


def _entry_unsaid(entry: str, shown: str) -> str:
    """``entry`` (a heading's text) when the quote ``shown`` does not hold it and it is short enough to name
    something, else ""."""
    entry = " ".join(entry.split())
    if not entry or len(entry) > MAX_ENTRY_CHARS or entry.casefold() in " ".join(shown.split()).casefold():
        return ""
    return entry


def _evidence_scorer(scorer: RelevanceScorer) -> EvidenceScorer:
    """The evidence scorer whose features the answer model reads: the grader's own, or one over its bi-encoder."""
    if isinstance(scorer, EvidenceScorer):
        return scorer
    bi_encoder = bi_encoder_of(scorer)
    return EvidenceScorer(embed_model=bi_encoder.embed_model if bi_encoder is not None else None)
