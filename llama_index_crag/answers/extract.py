"""Quoted-evidence answers: the strips of the context that answer the question, verbatim, with their sources.

Which strips answer is the learned answer model's call (``answers/answer_model.py``),
not a stack of hand rules; nothing is generated.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from llama_index.core.schema import NodeWithScore

from llama_index_crag.answers.answer_model import (
    AnswerModel,
    Candidate,
    QuoteDecision,
    answer_features,
    packaged_answer_model,
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


@dataclass(frozen=True)
class QuotedAnswer:
    """The quotes of an extractive answer, in document order.

    ``grade`` is the answer model's probability that the best strip answers the question
    (None when the context held no strip); ``threshold`` the probability a strip needed,
    given ``evidence``, where the grader's grade of the passages sat between its
    thresholds (0 at lower, 1 at upper; None when not given); ``withheld`` holds the best
    strip when it fell under the threshold, or when ``unnamed`` holds identifiers the question names and no
    passage does (``answer_model.unnamed_identifiers``), and nothing was quoted.
    """

    quotes: List[Quote]
    grade: Optional[float] = None
    withheld: List[Quote] = field(default_factory=list)
    threshold: float = 0.0
    evidence: Optional[float] = None
    unnamed: List[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The answer as a reader sees it: a header, then each quote with its source."""
        if not self.quotes:
            return ""
        lines = [f'"{q.text}" ({q.source})' for q in self.quotes]
        return "\n".join([QUOTED_HEADER, *lines])

    def why_withheld(self) -> str:
        """Why the best strip was withheld, as the trace says it: the identifiers no passage names, else its
        probability under the threshold."""
        if self.unnamed:
            return (
                f"the passages do not name {', '.join(self.unnamed)}, which the question asks about, so the answer "
                f"model's best strip ({self.grade:.3f}) answers something else"
            )
        return f"the answer model gives its best strip {self.grade:.3f}, under the quote threshold {self.threshold:.3f}"

    def to_list(self) -> List[Dict[str, Any]]:
        """The quotes as JSON-ready dicts (for the trace)."""
        return [asdict(q) for q in self.quotes]

    def check(self) -> Optional[Dict[str, Any]]:
        """The answer step's check for the trace: the best strip's probability, the threshold it needed at the
        evidence's place, the question's identifiers no passage names, and what was withheld."""
        if self.grade is None:
            return None
        return {
            "grade": self.grade,
            "threshold": self.threshold,
            "evidence_place": self.evidence,
            "passed": not self.withheld,
            "unnamed": list(self.unnamed),
            "withheld": [asdict(q) for q in self.withheld],
        }


def quoted(strip: Strip) -> str:
    """A strip as quoted: a sentence window on one line, a table or code block with its lines and indentation."""
    return strip.text.strip() if strip.whole_block else " ".join(strip.text.split())


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

    def candidates(self, nodes: Sequence[NodeWithScore]) -> List[Tuple[Candidate, NodeWithScore, int, int]]:
        """Every strip of ``nodes`` as the answer model reads it, with its node and its place (rank, position)."""
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
                found.append((Candidate(text, strip.graded_text, f"{title} {said}"), node, rank, position))
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
        if not ranked:
            return QuotedAnswer([], threshold=threshold, evidence=evidence)
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
                [], grade=best, withheld=withheld, threshold=threshold, evidence=evidence, unnamed=unnamed
            )
        chosen.sort(key=lambda i: found[i][2:])
        quotes = [_quote(found[i], probabilities[i]) for i in chosen]
        return QuotedAnswer(quotes, grade=best, threshold=threshold, evidence=evidence)

    async def aquote(
        self, question: str, nodes: Sequence[NodeWithScore], place: Optional[float] = None
    ) -> QuotedAnswer:
        """``quote`` off the event loop (reading strips is CPU-bound)."""
        return await asyncio.to_thread(self.quote, question, nodes, place)


def _quote(found: Tuple[Candidate, NodeWithScore, int, int], probability: float) -> Quote:
    candidate, node = found[0], found[1]
    return Quote(
        text=candidate.text, source=source_name(node), node_id=node.node.node_id, score=round(float(probability), 4)
    )


def _evidence_scorer(scorer: RelevanceScorer) -> EvidenceScorer:
    """The evidence scorer whose features the answer model reads: the grader's own, or one over its bi-encoder."""
    if isinstance(scorer, EvidenceScorer):
        return scorer
    bi_encoder = bi_encoder_of(scorer)
    return EvidenceScorer(embed_model=bi_encoder.embed_model if bi_encoder is not None else None)
