"""Questions that ask several things at once, and their parts.

People join questions: "When was the university founded, and who designed the cathedral?", "What lock does
TRUNCATE take, and what lock does ALTER TABLE take?", "what are the defaults for log_min_messages and for
client_min_messages". Graded as one query, such a question matches no passage well (each passage answers one
part), so it is abstained on whole although each part is in the documents. ``split_question`` finds the parts
offline, by rules that only split when they are sure:

- several sentences each ending in a question mark;
- a question joined to another by ``and`` (``, and`` / ``; and`` / ``;`` / ``and also``) where what follows starts
  as a question of its own (a question word or an auxiliary verb, maybe after a preposition: "and after how
  long is ...");
- one question asking about two things with a repeated preposition ("the defaults for A and for B"): the stem
  is given to both.

- a comparison of named things, "<question>, <A> or <B>?" ("Who was born first, Mikhail Kravchuk or Israel
  Gelfand?", "Which is faster, COPY or INSERT?", a list "..., A, B or C?"): one part a side, the question's frame
  given to each ("Who was born first, Mikhail Kravchuk?"), so that each side's fact is searched, graded and
  quoted from its own passage; the reader compares them. Each side is short (at most ``MAX_SIDE_WORDS`` words)
  and names something (a capitalised word, a figure or an identifier): "Is it better to be fast or slow?" is not
  split, nor is a choice with no comma before its sides ("Does 1MB mean 1000 kB or 1024 kB?").

``and`` inside a name ("Procter and Gamble", "Pride and Prejudice") is never split: what follows is not a
question. A later part that refers back ("..., and when was it published?") cannot be asked alone, so such a
question is not split. A part left empty after splitting is dropped; at most ``max_parts`` parts are kept, and
the split says how many were dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Tuple

#: The most parts a question is split into (a longer list is capped, and the split says so).
MAX_PARTS = 4
#: The fewest words a part must have to stand as a question of its own.
MIN_PART_WORDS = 3

_WH = r"(?:what|which|who|whom|whose|when|where|why|how)"
_AUX = r"(?:is|are|was|were|do|does|did|can|could|should|shall|will|would|may|might|must|has|have|had)"
_PREPOSITION = r"(?:after|before|in|for|at|by|on|from|to|with|within|under|since|until|during|of|about)"
#: What starts a question of its own.
_QUESTION_START = re.compile(rf"^(?:{_PREPOSITION}\s+)?(?:{_WH}|{_AUX})\b", re.IGNORECASE)
#: Where two questions are joined.
_JOIN = re.compile(r"\s*(?:[,;]\s*(?:and\s+(?:also\s+)?)?|\s+and\s+(?:also\s+)?)", re.IGNORECASE)
#: "... <prep> A and <prep> B" with the same preposition twice.
_REPEATED = re.compile(rf"^(?P<stem>.*?\b)(?P<prep>{_PREPOSITION})\s+(?P<a>.+?)\s+and\s+(?P=prep)\s+(?P<b>.+)$", re.I)
_SENTENCE_QUESTIONS = re.compile(r"[^?]+\?")
#: A later part that refers back to an earlier one ("Who wrote Pride and Prejudice, and when was it published?")
#: cannot be asked alone: it stays joined to the part before. A part with a pronoun and a name of its own ("what did
#: Joseph Haas say in his email") is taken to refer to that name.
_PRONOUN = re.compile(r"\b(?:it(?! means?\b)|its|they|them|their|he|him|his|she|her|hers)\b", re.IGNORECASE)
#: A question word that starts a question of its own (an auxiliary is not enough after a bare comma or "and":
#: "was criticized by the NFL" continues the question before).
_WH_START = re.compile(rf"^(?:{_PREPOSITION}\s+)?{_WH}\b", re.IGNORECASE)
#: The fewest words of a part cut off a sentence ("..., and in which city?", "... and for what purpose" continue
#: the question before).
MIN_BARE_PART_WORDS = 4
#: The longest side of a repeated preposition ("for A and for B").
MAX_SIDE_WORDS = 6
_NAME = re.compile(r"(?<!^)\b[A-Z][\w-]*")
#: A question word anywhere ("the price of oil was stable until when").
_WH_ANYWHERE = re.compile(rf"\b{_WH}\b", re.IGNORECASE)
#: Where the sides of a comparison are cut: ", " and a last " or " (", or ").
_ALTERNATIVES = re.compile(r"\s*,\s*or\s+|\s+or\s+|\s*,\s*", re.IGNORECASE)
#: A clause joined on, not a side of a comparison.
_JOINED = re.compile(r"^(?:and|but|also|then)\b", re.IGNORECASE)
#: What a side of a comparison must hold to name something: a capitalised word, a figure, an identifier.
_NAMES_SOMETHING = re.compile(r"\b[A-Z]|\d|\w_\w")
#: A request that asks on its own after ", and" ("..., and give the importance of alkaloids").
_REQUEST = re.compile(r"^(?:describe|explain|list|name|give|define|summari[sz]e|compare|tell me)\b", re.IGNORECASE)


@dataclass
class Split:
    """A question's parts (one part: not compound), and how many parts past the cap were dropped."""

    question: str
    parts: List[str] = field(default_factory=list)
    dropped: int = 0
    #: Each part's subject: the side of a comparison it asks about ("Harvard"), "" for a part that is a question
    #: of its own; empty when no part is a side.
    subjects: List[str] = field(default_factory=list)
    #: What found the parts: "parser" (the rules here, before retrieval) or "rewrite" (the LLM's rewrite, on the
    #: INCORRECT branch of the question asked whole).
    by: str = "parser"

    def subject(self, part: int) -> str:
        """The side of a comparison part ``part`` (0-based) asks about, or ""."""
        return self.subjects[part] if part < len(self.subjects) else ""

    @property
    def compound(self) -> bool:
        return len(self.parts) > 1


#: What a question that asks several things holds: a joining word, a comma or semicolon, or two question marks.
_MAY_ASK_SEVERAL = re.compile(r"\b(?:and|or|as well as|also|plus|both|versus|vs)\b|[,;&/]|\?\s*\S.*\?", re.IGNORECASE)


def may_ask_several(question: str) -> bool:
    """Whether ``question`` could ask several things at all: without a joining word ("and", "or", "as well
    as", ...), a comma, a semicolon or a second question mark it asks one. Looser than ``split_question``: it
    says where an LLM may be asked for the parts the rules did not find."""
    return bool(_MAY_ASK_SEVERAL.search(question))


def split_question(question: str, max_parts: int = MAX_PARTS) -> Split:
    """``question``'s parts when it asks several things (see the module), else itself alone."""
    text = " ".join(question.split())
    found: List[Tuple[str, str]] = []
    for sentence in _sentences(text):
        for joined in _joined(sentence):
            sides = _comparison(joined)
            found.extend(sides if sides else [(part, "") for part in _repeated(joined)])
    found = [(tidy, subject) for tidy, subject in ((_tidy(p), subject) for p, subject in found) if tidy]
    if len(found) < 2:
        return Split(question, [question])
    kept = found[: max(1, max_parts)]
    subjects = [subject for _, subject in kept] if any(subject for _, subject in kept) else []
    return Split(question, [part for part, _ in kept], len(found) - len(kept), subjects)


def _sentences(text: str) -> List[str]:
    """The question's sentences, when it holds several questions each ending in a question mark."""
    found = [m.group(0).strip() for m in _SENTENCE_QUESTIONS.finditer(text)]
    rest = _SENTENCE_QUESTIONS.sub("", text).strip()
    if len(found) < 2 or rest:
        return [text]
    return found


def _joined(sentence: str) -> List[str]:
    """``sentence`` cut where a question is joined to another that asks on its own.

    Without a comma (" and how ..."), only a sentence that starts as a question is cut, before a part that starts
    as one too. After ", and" (or ";"), a part that starts as a question or a request is cut off, and one holding a
    question word anywhere when the part before holds one too. After a bare comma, only between two questions. A
    part that refers back stays joined to the one before."""
    asks = bool(_QUESTION_START.match(sentence))
    joins = [j for j in _JOIN.finditer(sentence) if j.start() > 0]
    pieces: List[str] = []
    seams: List[str] = []
    start = 0
    for i, join in enumerate(joins):
        if join.start() < start:
            continue
        end = joins[i + 1].start() if i + 1 < len(joins) else len(sentence)
        before, after = sentence[start : join.start()], sentence[join.end() : end]
        if len(before.split()) < MIN_PART_WORDS or not _asks_apart(before, after, join.group(0), asks):
            continue
        pieces.append(before)
        seams.append(join.group(0))
        start = join.end()
    pieces.append(sentence[start:])
    parts = [pieces[0]]
    for seam, piece in zip(seams, pieces[1:]):
        if _refers_back(piece) or len(piece.split()) < MIN_BARE_PART_WORDS:
            parts[-1] = parts[-1] + seam + piece
        else:
            parts.append(piece)
    return parts


def _asks_apart(before: str, after: str, seam: str, asks: bool) -> bool:
    """Whether ``after`` is a question of its own joined to ``before`` by ``seam``."""
    starts = bool(_QUESTION_START.match(after))
    before_asks = bool(_QUESTION_START.match(before) or _WH_ANYWHERE.search(before))
    if "," not in seam and ";" not in seam:
        return asks and bool(_WH_START.match(after)) and len(after.split()) >= MIN_BARE_PART_WORDS
    if "and" not in seam.lower() and ";" not in seam:
        return bool(_WH_START.match(after)) and before_asks
    return starts or bool(_REQUEST.match(after)) or (before_asks and bool(_WH_ANYWHERE.search(after)))


#: "this mode", "those rows", "that setting's": a later part naming what an earlier one asked about ("Which setting
#: ..., and what is that setting's default value?"). A bare "that" mostly opens a clause ("the doctor that led the
#: research"), so only its possessive counts.
_DEMONSTRATIVE = re.compile(
    r"\b(?:this|these|those)\s+(?!(?:is|are|was|were|has|have|had|can|could|will|would|shall|should|may|might"
    r"|must|does|do|did|the|a|an|i|you|we|they|it|he|she|there|not|to|of|in|on|for|week|weekend|month|year"
    r"|season|day|time|morning|evening|century|decade|way)\b)[a-z][\w-]*"
    r"|\bthat\s+[a-z][\w-]*'s\b",
    re.IGNORECASE,
)


def _refers_back(part: str) -> bool:
    """A pronoun or a demonstrative ("that setting"), and no name of the part's own for it to stand for."""
    return bool(_PRONOUN.search(part) or _DEMONSTRATIVE.search(part)) and not _NAME.search(part.strip())


def _comparison(question: str) -> List[Tuple[str, str]]:
    """ "Which is older, Harvard or Yale?" as ("Which is older, Harvard", "Harvard"), ("Which is older, Yale",
    "Yale") (see the module); nothing when it is not a comparison."""
    text = question.strip().rstrip("?").strip()
    if not _QUESTION_START.match(text):
        return []
    for comma in (m.start() for m in re.finditer(",", text)):
        frame, rest = text[:comma].strip(), text[comma + 1 :].strip()
        if len(frame.split()) < MIN_PART_WORDS - 1 or len(re.findall(r"\bor\b", rest, re.IGNORECASE)) != 1:
            continue
        sides = _ALTERNATIVES.split(rest)
        if not re.search(r"\bor\s+\S+$", rest, re.IGNORECASE) and len(sides) < 2:
            continue
        if len(sides) < 2 or any(len(side.split()) > MAX_SIDE_WORDS for side in sides):
            continue
        if all(_names_a_side(side) for side in sides):
            return [(f"{frame}, {side.strip()}", side.strip()) for side in sides]
    return []


def _names_a_side(side: str) -> bool:
    """Whether ``side`` of a comparison names one thing, not a clause ("and who founded MIT")."""
    side = side.strip()
    return bool(side and _NAMES_SOMETHING.search(side)) and not _WH_ANYWHERE.search(side) and not _JOINED.match(side)


def _repeated(question: str) -> List[str]:
    """ "the defaults for A and for B" as "the defaults for A", "the defaults for B"."""
    found = _REPEATED.match(question.rstrip("?").strip())
    if not found or not _QUESTION_START.match(question) or not found.group("stem").strip() or "," in question:
        return [question]
    if max(len(found.group("a").split()), len(found.group("b").split())) > MAX_SIDE_WORDS:
        return [question]
    stem, prep = found.group("stem"), found.group("prep")
    return [f"{stem}{prep} {found.group('a')}", f"{stem}{prep} {found.group('b')}"]


def _tidy(part: str) -> str:
    """A part as a question of its own: trimmed of joins and stray punctuation, capitalised, with its mark."""
    part = part.strip().strip(",;").strip()
    if len(part.split()) < MIN_PART_WORDS:
        return ""
    part = part.rstrip("?").rstrip()
    return part[0].upper() + part[1:] + "?"
