"""GroundednessChecker: does each sentence of a generated answer stand in the passages it was generated from?"""

from __future__ import annotations

import asyncio
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.text.patterns import CODE, NAME_JOINERS, NAME_WORD, NUMBER_WORDS, QUANTITY, QUOTED_OR_CODE
from llama_index_crag.text.split import split_sentences, terms
from llama_index_crag.text.strips import decompose

#: A label the generator put before its answer ("Answer:", "A:"): not part of what it claims.
_LABEL = re.compile(r"^[A-Za-z]{1,12}:\s+")
#: Words of answer boilerplate ("Based on the context, the answer is"): neither a claim nor support.
_BOILERPLATE = frozenset(
    terms(
        "based context information prior knowledge answer question provided given according document documents "
        "text passage passages source sources mentioned state states stated"
    )
)
#: Function words of English and of other common languages, to tell an answer in another language.
_ENGLISH = frozenset("the a an of and is in to was for on with that by it as are at from be this has or not".split())
_OTHER_LANGUAGES = frozenset(
    "der die das und ist nicht ein eine mit von den dem zu auf für im wurde le la les et est une des du dans pour "
    "qui sur pas el los las y es un una del en por con que se fue il della di che gli sono het een van niet zijn "
    "dat os um uma não são".split()
)

Status = str  # "checked", "empty", "other_language", "incomplete", "error"


@dataclass
class SentenceCheck:
    """One sentence of the answer: its support score, whether it is grounded, and what in it is not supported."""

    text: str
    score: float
    grounded: bool
    unsupported: List[str] = field(default_factory=list)
    #: How many checkable things (figures, codes, names, content words) the sentence states.
    claims: int = 0
    #: The grader's score of the sentence against its best passage strip (``use_scorer``), else None.
    grader_score: Optional[float] = None


@dataclass
class AnswerCheck:
    """The check of one answer against its sources.

    ``grounded`` is True or False only when the answer was read (``status`` ``checked``);
    it is None for an answer that could not be checked (``incomplete``, ``error``,
    ``other_language``), which the engine never presents as checked.
    """

    status: Status
    grounded: Optional[bool]
    score: Optional[float] = None
    sentences: List[SentenceCheck] = field(default_factory=list)
    reason: Optional[str] = None
    longer_than_context: bool = False
    ms: float = 0.0

    @property
    def unsupported(self) -> List[str]:
        """Every unsupported span, in answer order, each once."""
        seen: Dict[str, None] = {}
        for sentence in self.sentences:
            seen.update(dict.fromkeys(sentence.unsupported))
        return list(seen)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready, with the unsupported spans gathered."""
        return {**asdict(self), "unsupported": self.unsupported}


@dataclass(frozen=True)
class _Evidence:
    text: str
    words: FrozenSet[str]
    terms: FrozenSet[str]
    values: FrozenSet[str]
    quantities: FrozenSet[Tuple[str, str]]
    strips: Tuple[str, ...]


def _value(raw: str) -> str:
    raw = raw.lower()
    return NUMBER_WORDS.get(raw, raw.replace(",", ""))


def _unit(raw: Optional[str]) -> str:
    """A unit in one spelling: "%" for percent, singular otherwise ("days" -> "day")."""
    if not raw:
        return ""
    raw = raw.lower().replace(" ", "")
    if raw in ("%", "percent"):
        return "%"
    return raw[:-1] if raw.endswith("s") else raw


def _quantities(text: str) -> List[Tuple[str, str, str]]:
    """(span, value, unit) of every number in ``text``; a bare number word (no unit) is not a figure."""
    found = []
    for m in QUANTITY.finditer(text):
        number, unit = m.group(1), m.group(2)
        if number.lower() in NUMBER_WORDS and not unit:
            continue
        found.append((m.group(0).strip(), _value(number), _unit(unit)))
    return found


def _evidence(texts: Sequence[str], strip_min_tokens: Optional[int]) -> _Evidence:
    """What the sources hold; split into strips only given ``strip_min_tokens`` (only the grader's check reads them)."""
    text = "\n".join(texts)
    quantities = [(v, u) for _, v, u in _quantities(text)]
    values = {v for v, _ in quantities} | {
        _value(w) for w in re.findall(r"[A-Za-z]+", text) if w.lower() in NUMBER_WORDS
    }
    strips: Tuple[str, ...] = ()
    if strip_min_tokens is not None:
        strips = tuple(s.graded_text for t in texts for s in decompose(t, strip_min_tokens))
    return _Evidence(
        text=text.casefold(),
        words=frozenset(re.findall(r"[^\W_]+", text.casefold())),
        terms=frozenset(terms(text)),
        values=frozenset(values),
        quantities=frozenset(q for q in quantities if q[1]),
        strips=strips,
    )


def _names(sentence: str) -> List[str]:
    """Runs of capitalised words: names of people, products, places; the sentence's first word only if clearly one."""
    tokens = list(re.finditer(r"\S+", sentence))
    names: List[str] = []
    run: List[str] = []
    for i, m in enumerate(tokens):
        word = m.group(0).strip("\"“”'‘’()[],;:!?")
        is_name = bool(NAME_WORD.fullmatch(word.rstrip("."))) and any(c.isalpha() for c in word)
        if is_name and i == 0:
            following = tokens[1].group(0) if len(tokens) > 1 else ""
            is_name = word.endswith(("'s", "’s")) or word.isupper() or following[:1].isupper()
        if is_name:
            run.append(word.rstrip("."))
        elif run and word.lower() in NAME_JOINERS and i + 1 < len(tokens) and tokens[i + 1].group(0)[:1].isupper():
            run.append(word)
        else:
            if run:
                names.append(" ".join(run))
            run = []
        if m.group(0)[-1:] in ",;:!?" and run:
            names.append(" ".join(run))
            run = []
    if run:
        names.append(" ".join(run))
    return [n for n in names if any(c.isalpha() for c in n)]


def _name_supported(name: str, evidence: _Evidence, asked: Set[str]) -> bool:
    words = [re.sub(r"['’]s$", "", w).casefold() for w in re.findall(r"[^\s]+", name)]
    words = [w.strip(".&") for w in words if w.casefold() not in NAME_JOINERS]
    return all(
        w in evidence.words or w in asked or all(p in evidence.words for p in re.findall(r"[^\W_]+", w))
        for w in words
        if w
    )


def is_other_language(answer: str, evidence_text: str) -> bool:
    """Whether the answer is written in another language than its sources (function words, or another script)."""
    words = re.findall(r"[^\W\d_]+", answer.lower())
    if len(words) < 5:
        return False
    latin = sum(1 for c in answer if c.isalpha() and c.isascii() or "\u00c0" <= c <= "\u024f")
    letters = sum(1 for c in answer if c.isalpha())
    if letters and latin / letters < 0.5:
        source_letters = [c for c in evidence_text if c.isalpha()]
        source_latin = sum(1 for c in source_letters if c.isascii() or "\u00c0" <= c <= "\u024f")
        return source_latin / max(1, len(source_letters)) >= 0.5
    english = sum(w in _ENGLISH for w in words) / len(words)
    other = sum(w in _OTHER_LANGUAGES for w in words) / len(words)
    if other < 0.15 or english >= other / 2:  # an English answer: the sources need not be read
        return False
    source_words = re.findall(r"[^\W\d_]+", evidence_text.lower())
    return sum(w in _ENGLISH for w in source_words) / max(1, len(source_words)) >= 0.08


class GroundednessChecker:
    """Checks a generated answer against the passages it was generated from (Self-CRAG's critique).

    The answer is split into sentences. In each, every figure (a number with its unit:
    "14 days" is not supported by "14 hours"), code or version ("EU-2", "4.3.1"), quoted
    text and name must stand in the passages (or in the question), and at least
    ``min_word_support`` of its content words must too. A sentence that fails lists what
    was missing as its unsupported spans. Answer boilerplate ("Based on the context, the
    answer is") is neither claim nor support, and an answer that states nothing
    checkable is not grounded: there is nothing in it a reader could verify.

    With ``use_scorer``, each sentence is also scored against the passages' strips with
    the grader's scorer (its best strip), and must reach ``scorer_threshold``.

    Args:
        scorer: The grader's scorer, for ``use_scorer``.
        use_scorer: Also score each sentence with ``scorer``.
        scorer_threshold: The scorer's score a sentence needs with ``use_scorer``.
        min_word_support: The share of a sentence's content words the passages must hold.
        max_sentences: Sentences checked; an answer with more is not grounded.
        strip_min_tokens: Strip size for the scorer, as the refiner's.
    """

    def __init__(
        self,
        scorer: Optional[RelevanceScorer] = None,
        use_scorer: bool = False,
        scorer_threshold: float = 0.5,
        min_word_support: float = 0.5,
        max_sentences: int = 64,
        strip_min_tokens: int = 8,
    ) -> None:
        if use_scorer and scorer is None:
            raise ValueError("use_scorer=True needs the grader's scorer: pass scorer=")
        self.scorer = scorer
        self.use_scorer = use_scorer
        self.scorer_threshold = scorer_threshold
        self.min_word_support = min_word_support
        self.max_sentences = max_sentences
        self.strip_min_tokens = strip_min_tokens

    def check(self, answer: str, evidence: Sequence[str], question: str = "") -> AnswerCheck:
        """Check ``answer`` against the passage texts ``evidence``; never raises for what the answer holds."""
        import time

        started = time.perf_counter()
        result = self._check(answer, evidence, question)
        result.ms = round((time.perf_counter() - started) * 1000.0, 3)
        return result

    async def acheck(self, answer: str, evidence: Sequence[str], question: str = "") -> AnswerCheck:
        """``check`` off the event loop (the scorer is CPU-bound)."""
        return await asyncio.to_thread(self.check, answer, evidence, question)

    def _check(self, answer: str, evidence: Sequence[str], question: str) -> AnswerCheck:
        text = _LABEL.sub("", " ".join((answer or "").split()), count=1)
        if not text:
            return AnswerCheck("checked", False, 0.0, reason="the answer is empty")
        sources = [e for e in evidence if e and e.strip()]
        if not sources:
            return AnswerCheck("checked", False, 0.0, reason="the answer has no source passage to stand in")
        joined = "\n".join(sources)
        longer = len(text) > len(joined)
        if is_other_language(text, joined):
            return AnswerCheck(
                "other_language",
                None,
                reason="the answer is not in the language of its sources, so its words cannot be checked",
                longer_than_context=longer,
            )
        found = _evidence(sources, self.strip_min_tokens if self.use_scorer else None)
        asked_words = set(re.findall(r"[^\W_]+", question.casefold()))
        asked_terms = set(terms(question))
        sentences = [s.strip() for s in split_sentences(text) if s.strip()] or [text]
        checked = sentences[: self.max_sentences]
        results = [self._sentence(s, found, asked_words, asked_terms) for s in checked]
        if self.use_scorer and found.strips:
            assert self.scorer is not None
            try:
                for result in results:
                    if result.claims:
                        best = max(self.scorer.score_texts(result.text, list(found.strips)))
                        result.grader_score = round(float(best), 4)
                        result.score = round((result.score + float(best)) / 2.0, 4)
                        result.grounded = result.grounded and best >= self.scorer_threshold
            except Exception as exc:
                return AnswerCheck(
                    "error",
                    None,
                    reason=f"the grader failed during the check: {type(exc).__name__}: {exc}",
                    longer_than_context=longer,
                )
        claiming = [r for r in results if r.claims]
        reason = None
        if not claiming:
            grounded, score = False, 0.0
            reason = "the answer states nothing that can be checked against its sources"
        else:
            grounded = all(r.grounded for r in claiming)
            score = min(r.score for r in claiming)
            if not grounded:
                reason = "some of the answer is not in its sources"
        if len(sentences) > len(checked):
            grounded = False
            reason = f"the answer has {len(sentences)} sentences; only the first {len(checked)} were checked"
        return AnswerCheck("checked", grounded, round(score, 4), results, reason, longer)

    def _sentence(self, sentence: str, found: _Evidence, asked_words: Set[str], asked_terms: Set[str]) -> SentenceCheck:
        unsupported: List[str] = []
        claims = 0
        spans: List[str] = []
        for span, value, unit in _quantities(sentence):
            claims += 1
            if unit and unit not in ("thousand", "million", "billion", "trillion"):
                ok = (value, unit) in found.quantities or value in asked_words
            else:
                ok = value in found.values or value in asked_words
            if not ok:
                unsupported.append(span)
            spans.append(span)
        for m in CODE.finditer(sentence):
            code = m.group(0).rstrip(".")
            if any(code in s for s in spans):
                continue
            claims += 1
            if code.casefold() not in found.text and code.casefold() not in asked_words:
                unsupported.append(code)
            spans.append(code)
        for quoted in QUOTED_OR_CODE.findall(sentence):
            claims += 1
            if quoted.casefold().strip() not in found.text:
                unsupported.append(quoted)
        for name in _names(sentence):
            if any(name in s or s in name for s in spans):
                continue
            claims += 1
            if not _name_supported(name, found, asked_words):
                unsupported.append(name)
        facts = claims
        words: Dict[str, str] = {}  # each content word's stem -> the word as the answer spells it
        for m in re.finditer(r"[^\W_]+", sentence):
            stem = next(iter(terms(m.group(0))), "")
            if stem and stem not in _BOILERPLATE and not stem.isdigit():
                words.setdefault(stem, m.group(0))
        missing = [word for stem, word in words.items() if stem not in found.terms and stem not in asked_terms]
        word_share = 1.0 - len(missing) / len(words) if words else 1.0
        claims += len(words)
        fact_share = (facts - len(unsupported)) / facts if facts else 1.0
        score = (fact_share + word_share) / 2.0 if facts else word_share
        grounded = not unsupported and word_share >= self.min_word_support
        if word_share < self.min_word_support:
            unsupported.extend(w for w in missing if not any(w in span for span in unsupported))
        return SentenceCheck(sentence, round(score, 4), grounded, unsupported, claims)
