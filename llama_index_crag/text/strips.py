"""Knowledge strips: a passage decomposed into sentences or short windows (tables and code whole), each with the
subject a strip that refers back is read with; and the strips a recomposed node records."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from llama_index.core.schema import NodeWithScore

from llama_index_crag.text.headings import heading
from llama_index_crag.text.patterns import CAPITALISED
from llama_index_crag.text.split import split_sentences, terms

_FENCE = re.compile(r"^\s*(```|~~~)")
_TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$")
#: A blank line between paragraphs.
_PARAGRAPH = re.compile(r"\n[ \t]*\n")


#: Words that open a sentence by referring back to something named before it: such a strip has lost its subject.
_REFERS_BACK = re.compile(
    r"^\W*(it|its|it's|they|their|them|this|these|that|those|he|his|him|she|her|such|both|the latter|the former"
    r"|the (?:company|firm|group|organi[sz]ation|city|town|village|country|state|region|team|club|band|film|movie"
    r"|book|novel|album|song|show|series|bridge|building|river|station|school|university|product|service|platform"
    r"|project|system|device|model|program(?:me)?|party|species|disease|drug|study|paper|event|war|church|museum"
    r"|game|agency|department|court|law|act|report|plan|policy|feature|release|version|tool|app|outage|incident))\b",
    re.IGNORECASE,
)


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
    return " ".join(dict.fromkeys(w for w in CAPITALISED.findall(before) if terms(w)))


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
    """The strips of prose: its sentences, none running across a blank line (a paragraph's end is a sentence's,
    whether or not a full stop marks it: a heading, a list's term, a table cell written as a paragraph), a short
    one merged into the next (the last into the one before). Each strip is the text as it stands, line breaks
    kept, from its first sentence's start to its last one's end."""
    spans: List[Tuple[int, int, bool]] = []  # each sentence's start and end, and whether it is a heading
    at = 0
    for paragraph in _PARAGRAPH.split(text):
        titled = heading(paragraph.strip(), None, None) is not None
        for sentence in split_sentences(paragraph):
            found = sentence.strip()
            if found:
                start = text.find(found, at)
                start = at if start < 0 else start  # a sentence is a slice of its paragraph: found, always
                spans.append((start, start + len(found), titled))
                at = start + len(found)
    merged: List[Tuple[int, int]] = []
    pending: Optional[Tuple[int, int]] = None
    for start, end, titled in spans:  # a heading always goes with what it heads
        pending = (pending[0] if pending else start, end)
        if not titled and len(text[pending[0] : pending[1]].split()) >= min_tokens:
            merged.append(pending)
            pending = None
    if pending:
        if merged:
            merged[-1] = (merged[-1][0], pending[1])
        else:
            merged.append(pending)
    return [Strip(text[start:end]) for start, end in merged]
