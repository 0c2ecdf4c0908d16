"""StripRefiner: decompose chunks into knowledge strips, re-score them, recompose the relevant ones."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.indices.base import BaseIndex
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, NodeRelationship, NodeWithScore, QueryBundle, TextNode

from llama_index_crag.core.grader import scorer_over
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.scorers.evidence import terms
from llama_index_crag.stores.chunking import split_sentences

_FENCE = re.compile(r"^\s*(```|~~~)")
_TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$")


#: Words that open a sentence by referring back to something named before it: such a strip has lost its subject.
_REFERS_BACK = re.compile(
    r"^\W*(it|its|it's|they|their|them|this|these|that|those|he|his|him|she|her|such|both|the latter|the former"
    r"|the (?:company|firm|group|organi[sz]ation|city|town|village|country|state|region|team|club|band|film|movie"
    r"|book|novel|album|song|show|series|bridge|building|river|station|school|university|product|service|platform"
    r"|project|system|device|model|program(?:me)?|party|species|disease|drug|study|paper|event|war|church|museum"
    r"|game|agency|department|court|law|act|report|plan|policy|feature|release|version|tool|app|outage|incident))\b",
    re.IGNORECASE,
)
#: A capitalised word: a name, or part of one, or a code ("Kestrel", "Farrow", "EU-2", "Q3").
_CAPITALISED = re.compile(r"\b[A-Z][\w'’-]*")


@dataclass(frozen=True)
class Strip:
    """One knowledge strip: a sentence window, or a whole table or code block.

    ``context`` is what a strip that refers back ("It spans 312 metres ...") needs to be
    read: its subject (``subject_of``: the names in the strip before it, or the
    passage's title for the strip that opens it). It is graded with the strip
    (``graded_text``) but never kept: the kept text is ``text``.
    """

    text: str
    whole_block: bool = False
    context: str = ""

    @property
    def graded_text(self) -> str:
        """The text a scorer judges: the context, then the strip."""
        return f"{self.context} {self.text}" if self.context else self.text


#: Metadata of a recomposed node: its kept strips as they were graded (text, context and score, as JSON), so that
#: a later step (the quoter) takes them as the refiner graded them instead of splitting the recomposed text again,
#: which would lose the subject a pronoun-led strip was read with, and scoring them again in another batch, which
#: changes a score whose features are relative to the batch (the evidence scorer's).
STRIPS_KEY = "crag_strips"


def kept_strips(node: NodeWithScore) -> Optional[List[Tuple[Strip, float]]]:
    """The strips a recomposed node was made of, with the scores the refiner gave them; None for any other node."""
    recorded = node.node.metadata.get(STRIPS_KEY)
    if not isinstance(recorded, str):
        return None
    try:
        return [
            (Strip(str(s["text"]), bool(s.get("whole_block")), str(s.get("context") or "")), float(s["score"]))
            for s in json.loads(recorded)
        ]
    except (ValueError, TypeError, KeyError):
        return None


def refers_back(text: str) -> bool:
    """Whether a sentence opens with a word that refers to something named before it ("It", "They", "The company")."""
    return bool(_REFERS_BACK.match(text))


@dataclass(frozen=True)
class StripGrade:
    """One strip as the trace shows it: its text, the candidate it came from, its score, and whether it was kept."""

    node_id: str
    text: str
    score: float
    kept: bool


@dataclass(frozen=True)
class Refinement:
    """What the refiner kept: recomposed nodes, the strip counts, and every strip graded (kept or not)."""

    nodes: List[NodeWithScore]
    kept: int
    dropped: int
    used_original: bool
    strips: List[StripGrade] = field(default_factory=list)


def decompose(text: str, min_tokens: int, title: str = "") -> List[Strip]:
    """Split a chunk into strips in document order.

    Tables and fenced code are single strips (splitting them destroys their meaning).
    Prose is split into sentences, and a sentence shorter than ``min_tokens`` words is
    merged with its neighbour, so no strip is too short to support a citation. A chunk
    that yields one strip comes back whole. A prose strip that refers back
    (``refers_back``) carries its subject as its ``context`` (``subject_of``: the
    names in the strip before it, or, opening the chunk, the ``title``, a document's or page's).
    """
    strips: List[Strip] = []
    prose: List[str] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line):
            end = i + 1
            while end < len(lines) and not _FENCE.match(lines[end]):
                end += 1
            block, i = lines[i : end + 1], end + 1
        elif _TABLE_ROW.match(line):
            end = i
            while end < len(lines) and _TABLE_ROW.match(lines[end]):
                end += 1
            block, i = lines[i:end], end
        else:
            prose.append(line)
            i += 1
            continue
        strips.extend(_prose_strips("".join(prose), min_tokens))
        prose = []
        strips.append(Strip("".join(block).strip(), whole_block=True))
    strips.extend(_prose_strips("".join(prose), min_tokens))
    return _with_subjects(strips, title.strip())


def subject_of(title: str, before: str) -> str:
    """What a strip that refers back is graded with: the names and codes in the strip ``before`` it ("Kestrel
    Bridge Farrow" for "It spans 312 metres ..."), or, for the strip that opens a passage or follows a table or
    code block (``before`` empty), the passage's ``title``.

    Not the strip before it whole: its own facts would then be read as the strip's, and a sentence that only
    follows the answer ("It was repainted in 2019." after "The bridge opened in 1887.") would grade as the
    answer does. Nor the title where a strip before it names nothing: a title holds the words of every question
    about its document ("Customer Onboarding: Installing the Tracking SDK"; a paper's title states its finding),
    and only the strips that refer back would be read with them (``benchmarks/strip_subjects.py`` and
    docs/grading.md measure the readings)."""
    if not before:
        return title.strip()
    return " ".join(dict.fromkeys(w for w in _CAPITALISED.findall(before) if terms(w)))


def _with_subjects(strips: List[Strip], title: str) -> List[Strip]:
    out: List[Strip] = []
    for i, strip in enumerate(strips):
        if not strip.whole_block and refers_back(strip.text):
            before = strips[i - 1].text if i and not strips[i - 1].whole_block else ""
            subject = subject_of(title, before)
            strip = Strip(strip.text, context=subject) if subject else strip
        out.append(strip)
    return out


def _prose_strips(text: str, min_tokens: int) -> List[Strip]:
    if not text.strip():
        return []
    sentences = [s.strip() for s in split_sentences(text) if s.strip()]
    merged: List[str] = []
    pending = ""
    for sentence in sentences:
        pending = f"{pending} {sentence}".strip()
        if len(pending.split()) >= min_tokens:
            merged.append(pending)
            pending = ""
    if pending:
        if merged:
            merged[-1] = f"{merged[-1]} {pending}"
        else:
            merged.append(pending)
    return [Strip(s) for s in merged]


class StripRefiner(BaseNodePostprocessor):
    """Knowledge refinement for the AMBIGUOUS band (CRAG's decompose-then-recompose).

    Each node is split into strips (see ``decompose``), every strip is scored against
    the query with the grader's scorer in one batch, strips scoring at least
    ``threshold`` are kept, and each node's kept strips are joined in their original
    order into a new node that points back to its source. If no strip survives, the
    original nodes are returned unchanged: the original ranking beats nothing.

    ``threshold`` defaults to the scorer's own strip threshold (``default_thresholds``);
    ``from_nodes`` and ``from_index`` also give the scorer the corpus's word statistics.
    """

    threshold: float = Field(ge=0.0, le=1.0, description="Strips scoring at least this are kept.")
    strip_min_tokens: int = Field(default=8, ge=1, description="Shortest strip in words; shorter sentences are merged.")
    _scorer: RelevanceScorer = PrivateAttr()

    def __init__(
        self, scorer: RelevanceScorer, threshold: Optional[float] = None, strip_min_tokens: int = 8, **kwargs: Any
    ) -> None:
        if threshold is None:
            threshold = scorer.shipped_threshold("strip_threshold", "StripRefiner")
        super().__init__(threshold=threshold, strip_min_tokens=strip_min_tokens, **kwargs)
        self._scorer = scorer

    @classmethod
    def class_name(cls) -> str:
        return "StripRefiner"

    @property
    def scorer(self) -> RelevanceScorer:
        """The scorer the strips are graded with (the grader's, in the engine)."""
        return self._scorer

    @classmethod
    def from_nodes(
        cls,
        nodes: Sequence[BaseNode],
        scorer: Optional[RelevanceScorer] = None,
        embed_model: Optional[BaseEmbedding] = None,
        **kwargs: Any,
    ) -> StripRefiner:
        """A refiner whose scorer (the default one when None) knows the word statistics of ``nodes``.

        Args:
            nodes: The corpus the retriever searches.
            scorer: The scorer; an evidence-feature scorer learns its IDF weights from ``nodes``.
            embed_model: The embedding model of the default scorer.
            **kwargs: The refiner's other arguments (``threshold``, ``strip_min_tokens``).
        """
        return cls(scorer_over(nodes, scorer, embed_model), **kwargs)

    @classmethod
    def from_index(cls, index: BaseIndex, **kwargs: Any) -> StripRefiner:
        """``from_nodes`` over the nodes of ``index``'s docstore (``kwargs`` as ``from_nodes`` takes them)."""
        return cls.from_nodes(list(index.docstore.docs.values()), **kwargs)

    def refine(self, query_bundle: QueryBundle, nodes: Sequence[NodeWithScore]) -> Refinement:
        """Decompose, re-score and recompose ``nodes`` for ``query_bundle``."""
        per_node = [
            decompose(n.node.get_content(), self.strip_min_tokens, str(n.node.metadata.get("title") or ""))
            for n in nodes
        ]
        flat = [strip.graded_text for strips in per_node for strip in strips]
        scores = self._scorer.score_texts(query_bundle.query_str, flat) if flat else []
        refined: List[NodeWithScore] = []
        graded: List[StripGrade] = []
        kept = 0
        cursor = 0
        for source, strips in zip(nodes, per_node):
            strip_scores = scores[cursor : cursor + len(strips)]
            cursor += len(strips)
            chosen = [(s, score) for s, score in zip(strips, strip_scores) if score >= self.threshold]
            graded.extend(
                StripGrade(source.node.node_id, s.text, round(float(score), 4), score >= self.threshold)
                for s, score in zip(strips, strip_scores)
            )
            if not chosen:
                continue
            kept += len(chosen)
            refined.append(_recompose(source, chosen))
        if not refined:
            return Refinement(nodes=list(nodes), kept=0, dropped=len(flat), used_original=True, strips=graded)
        return Refinement(nodes=refined, kept=kept, dropped=len(flat) - kept, used_original=False, strips=graded)

    async def arefine(self, query_bundle: QueryBundle, nodes: Sequence[NodeWithScore]) -> Refinement:
        """``refine`` off the event loop (scoring is CPU-bound)."""
        return await asyncio.to_thread(self.refine, query_bundle, nodes)

    def _postprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        if query_bundle is None:
            raise ValueError("StripRefiner needs the query: pass query_bundle or query_str")
        return self.refine(query_bundle, nodes).nodes


def _recompose(source: NodeWithScore, chosen: List[tuple[Strip, float]]) -> NodeWithScore:
    original = source.node
    if len(chosen) == 1 and chosen[0][0].text == original.get_content().strip():
        return NodeWithScore(node=original, score=chosen[0][1])
    text = "\n".join(strip.text for strip, _ in chosen)
    graded = [
        {"text": s.text, "whole_block": s.whole_block, "context": s.context, "score": round(float(score), 6)}
        for s, score in chosen
    ]
    node = TextNode(
        id_=f"{original.node_id}#strips",
        text=text,
        metadata={**original.metadata, STRIPS_KEY: json.dumps(graded)},
        excluded_embed_metadata_keys=[*original.excluded_embed_metadata_keys, STRIPS_KEY],
        excluded_llm_metadata_keys=[*original.excluded_llm_metadata_keys, STRIPS_KEY],
        relationships={NodeRelationship.SOURCE: original.as_related_node_info()},
    )
    return NodeWithScore(node=node, score=max(score for _, score in chosen))
