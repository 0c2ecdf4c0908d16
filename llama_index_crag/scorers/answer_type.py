"""The kind of answer a question asks for, whether a passage holds one, and whether it keeps the question's terms.

Two evidence features that a bi-encoder cannot see. "How long is the Kestrel Bridge?"
asks for a length: a passage about the bridge that gives only its opening year is on
topic and does not answer. "What was revenue in 2017?" sets a constraint: a passage
that gives 2021's revenue contradicts it, however many words it shares. Both are
regular expressions over the text, deterministic and fast enough for every batch
(no model call), so the features mean the same on every machine.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Dict, FrozenSet, Optional, Tuple

from llama_index_crag.text.patterns import (
    CURRENCY,
    DURATION_UNITS,
    LENGTH_UNITS,
    MONTHS,
    NAME_PHRASE,
    NUMBER,
    QUOTED,
    SCALE,
    STATED_DEFAULT,
    VALUE,
    YEAR,
)

#: The kinds of answer, each with what a passage that holds one contains.
PATTERNS: Dict[str, re.Pattern[str]] = {
    "year": re.compile(rf"\b({YEAR})s?\b"),
    "date": re.compile(
        rf"\b({YEAR})s?\b|\b({MONTHS})\b|\b\d{{1,2}}(st|nd|rd|th)? century\b"
        r"|\b\d{1,2}[/.-]\d{1,2}[/.-]\d{2,4}\b|\b(monday|tuesday|wednesday|thursday|friday|saturday|sunday)\b"
        # a time of day answers "when" too: "opens at six in the morning", "at 9:30", "by 5 pm", "at noon"
        rf"|\b{NUMBER} (?:o'clock|in the (?:morning|afternoon|evening))"
        r"|\b\d{1,2}(?::\d{2})?\s*(?:am|pm|a\.m\.|p\.m\.)|\b\d{1,2}:\d{2}\b|\b(?:noon|midnight)\b",
        re.IGNORECASE,
    ),
    "length": re.compile(rf"\b{NUMBER}[\s-]*(?:{LENGTH_UNITS})(?![a-z])", re.IGNORECASE),
    "duration": re.compile(rf"\b{NUMBER}[\s-]*(?:{DURATION_UNITS})\b", re.IGNORECASE),
    "count": re.compile(rf"\b{NUMBER}\b", re.IGNORECASE),
    "amount": re.compile(rf"(?:{CURRENCY})\s*\d|\d[\d,.]*\s*(?:{SCALE}|(?:{CURRENCY}))", re.IGNORECASE),
    "percent": re.compile(r"\d(?:[\d.,]*)\s*(?:%|per ?cent\b|percentage points?)", re.IGNORECASE),
    "name": NAME_PHRASE,
    "default": STATED_DEFAULT,
    # a file's name: "pg_ident.conf", "recovery.signal", "postgresql.auto.conf"
    "file": re.compile(r"(?<![\w/-])[A-Za-z_][\w-]*(?:\.[\w-]+)*\.[a-z]{2,8}\b(?![.\w-]*\w)"),
}

#: Words that make a proper name an organisation, not a person.
_ORGANISATION = re.compile(
    r"\b(inc|corp|corporation|ltd|llc|plc|gmbh|company|co|group|university|college|institute|council|committee"
    r"|party|association|society|agency|bank|church|club|fc|league|union|ministry|department|foundation|team"
    r"|records|studios?|press|airlines?|railways?|school|academy|board|commission|museum|hospital|army|navy)\.?$",
    re.IGNORECASE,
)

#: "when" as the question's own word: first, before an auxiliary ("... and when did it open"), after "since",
#: or last. A "when" that opens a clause ("Who can enforce it when member states provide less?", "What is the
#: force called when two forces act?") asks for no date.
_ASKING_WHEN = (
    r"^\W*when\b|\bwhen\s+(?:did|does|do|was|were|is|are|will|would|can|could|has|have|had|should|must|might)\b"
    r"|\bsince when\b|\bwhen\W*$"
)
#: "Until when?" is answered by a date or by an event ("stable until the oil shock"), and an event has no pattern
#: to check: such a question asks for no kind that a passage must hold.
_UNTIL_WHEN = r"\b(?:until|till|til) when\b"

#: A command-line option as a question names it: "-m", "--format", "-F".
_OPTION = r"(?<!\S)--?[A-Za-z][\w-]*"

#: (question pattern, the kinds of answer that satisfy it), the first match wins; no kinds: none can be checked.
_QUESTION_KINDS: Tuple[Tuple[re.Pattern[str], FrozenSet[str]], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), frozenset(kinds.split()))
    for pattern, kinds in (
        # "What is the default value of work_mem?", "whats the defualt work_mem", "autovacuum_freeze_max_age default
        # value?": a manual's question about a setting's default is answered where the text states it. So is one
        # about what a program does when an option is left out ("pg_ctl stop without -m", "when no -F is given"):
        # the option's entry says "If this option is omitted, fast is the default."
        (
            r"\bwhat(?:'s|s)?\s+(?:is\s+|are\s+|was\s+)?(?:the\s+|its\s+)?(?:defaults?|defualt)\b"
            r"|\bdefaults?\s+(?:values?|settings?)\s*(?:of|for)\b|\bdefault\s+values?\W*$"
            rf"|\b(?:without|omitting)\s+(?:the\s+)?{_OPTION}|\b(?:when|if)\s+no\s+{_OPTION}(?:\s+option)?\s+is\s+"
            r"(?:given|specified|set|passed|used)\b"
            # "... by default?", "What does listen_addresses default to?", "out of the box", "when I don't
            # specify one", "if nobody ever changes the setting".
            r"|\bby\s+default\b|\bdefaults?\s+to\W*$|\bout[\s-]of[\s-]the[\s-]box\b"
            r"|\b(?:when|if)\s+(?:i|you|we|nobody|no\s+one)\s+(?:(?:do\s+not|don't|never|ever)\s+)?"
            r"(?:specify|set|change|give|pass|configure)s?\b",
            "default",
        ),
        # "Which file maps user names to roles?", "what configuration file ...": answered where a file is named.
        # Not "what file format", "which file system": those ask for something else.
        (
            r"(?:\b(?:which|what)\s+(?:[\w-]+\s+)?|\bname of the (?:[\w-]+\s+)?)file\b"
            r"(?!\s*(?:formats?|systems?|sizes?|types?|modes?|descriptors?|permissions?|extensions?)\b)",
            "file",
        ),
        (
            r"\bhow long\b.*\b(last|lasted|take|took|takes|run|ran|stay|stayed|serve|served|reign|reigned|wait"
            r"|live|lived)\b",
            "duration",
        ),
        (
            r"\bhow long\b|\bhow (tall|high|wide|deep|far|big|large)\b|\bwhat (is|was) the (length|height|width|depth|"
            r"distance|area|size)\b|\b(length|height|distance) of\b",
            "length duration",
        ),
        (r"\b(what|which|in what) (year|decade|century)\b|\bwhat year\b", "year"),
        (_UNTIL_WHEN, ""),
        (rf"{_ASKING_WHEN}|\bwhat (date|day|month|time)\b|\bwhich (date|day|month)\b", "date"),
        (r"\bwhat (percentage|percent|share|proportion)\b|\bhow many percent\b", "percent"),
        (
            r"\bhow much\b.*\b(cost|costs|pay|paid|spend|spent|worth|price|earn|earned|raise|raised|sell|sold|charge)\b"
            r"|\bwhat (is|was|were) (the |\w+'s )?(price|cost|budget|revenue|salary|fee|arr|income|profit|valuation)\b",
            "amount",
        ),
        (r"\bhow much\b", "amount count percent length"),
        (rf"\bhow many (?:{DURATION_UNITS})\b", "duration"),
        (r"\bhow (many|old)\b|\bwhat (number|age)\b", "count"),
        (r"\bwho(m|se)?\b", "person"),
        (r"\bwhere\b|\bwhat (city|country|town|place|state|region)\b|\bin which (city|country|town|state)\b", "place"),
    )
)


@lru_cache(maxsize=4096)
def asked_kinds(question: str) -> Optional[FrozenSet[str]]:
    """The kinds of answer the question asks for ("how long does it last" asks for a duration), or None.

    A claim (``asks``) asks for none: its "who" and "where" open clauses ("Students who perform poorly ...",
    "... depends on where the mutation is located")."""
    if not asks(question):
        return None
    for pattern, kinds in _QUESTION_KINDS:
        if pattern.search(question):
            return kinds or None
    return None


#: Kinds of answer that only a strip holding one can give: a question about a default is not answered by a strip
#: that states none, nor "which file" by one that names none: the quoter sets such strips aside.
STRICT_KINDS = frozenset({"default", "file"})


def strict_kind(question: str) -> Optional[str]:
    """The one kind of ``STRICT_KINDS`` ``question`` asks for, or None."""
    kinds = asked_kinds(question)
    if kinds is not None and len(kinds) == 1 and kinds <= STRICT_KINDS:
        return next(iter(kinds))
    return None


def _new_matches(pattern: re.Pattern[str], text: str, question: str) -> list[str]:
    asked = question.lower()
    return [m.group(0) for m in pattern.finditer(text) if m.group(0).lower().strip() not in asked]


@lru_cache(maxsize=20_000)
def holds_kind(kinds: FrozenSet[str], text: str, question: str) -> bool:
    """Whether ``text`` holds an answer of one of ``kinds`` that the question does not already contain."""
    for kind in kinds:
        if kind in ("person", "place"):
            names = _new_matches(PATTERNS["name"], text, question)
            # A person is a name that is not an organisation's; a place is any name (a city, a country, a venue).
            if any(kind == "place" or not _ORGANISATION.search(n) for n in names):
                return True
        elif _new_matches(PATTERNS[kind], text, question):
            return True
    return False


def answer_type(question: str, best_sentence: str, passage: str) -> float:
    """1 when the best sentence holds the kind of answer asked, 0.75 when only another sentence does, 0 when
    nothing does, 0.5 when the question's kind is unknown."""
    kinds = asked_kinds(question)
    if kinds is None:
        return 0.5
    if holds_kind(kinds, best_sentence, question):
        return 1.0
    return 0.75 if holds_kind(kinds, passage, question) else 0.0


def _values(text: str) -> Dict[str, set[str]]:
    found: Dict[str, set[str]] = {"year": set(), "number": set()}
    for m in VALUE.finditer(text):
        value = m.group(0).replace(",", "").rstrip(".")
        found["year" if re.fullmatch(YEAR, value) else "number"].add(value)
    return found


#: Words that negate. A question negated ("What did the treaty *not* cover?") asks about what a passage
#: states as not so; the passage's own negations are broader ("unable", "refused", "without", "non-Catholics").
_QUESTION_NEGATION = frozenset("not never no cannot none nobody nothing neither nor".split())
_PASSAGE_NEGATION = re.compile(
    r"\b(?:not|never|no|none|nobody|nothing|neither|nor|cannot|without|unable|except|excluding|absent|instead"
    r"|fail(?:s|ed|ing|ure)?|lack(?:s|ed|ing)?|refus\w*|den(?:y|ies|ied)|prevent\w*|prohibit\w*|ban(?:s|ned)?"
    r"|forb[ai]d\w*|non\w+|\w+n't|\w+less)\b",
    re.IGNORECASE,
)
#: "whether or not", "may or may not", "not only ... but": negations that do not turn the question round.
_NOT_A_NEGATION = re.compile(r"\bor not\b|\bor (?:may|might|can|could|did|do|does|was|is) not\b|\bnot only\b")
#: Pairs of opposite words. A question that asks about the "largest" is not answered by a passage that says
#: only "smallest" where the question's own word is nowhere. Not the pairs a passage turns round in its own
#: words as often as not: "B after A" for "A before B", "X lost to Y" for who won, "how long" for a short one.
_OPPOSITES = tuple(
    pair.split("/")
    for pair in (
        "more/less more/fewer most/least higher/lower highest/lowest largest/smallest larger/smaller biggest/smallest"
        " longest/shortest longer/shorter earliest/latest first/last maximum/minimum"
        " increase/decrease increased/decreased increases/decreases increase/reduce"
        " inside/outside above/below majority/minority best/worst better/worse strong/weak"
        " stronger/weaker weakest/strongest public/private internal/external imports/exports import/export"
        " accepted/rejected allowed/banned legal/illegal successful/unsuccessful rich/poor"
        " north/south east/west northern/southern eastern/western positive/negative upper/lower"
        " oldest/newest older/newer youngest/oldest"
    ).split()
)
OPPOSITE: Dict[str, FrozenSet[str]] = {
    w: frozenset(b for a, b in _OPPOSITES if a == w) | frozenset(a for a, b in _OPPOSITES if b == w)
    for pair in _OPPOSITES
    for w in pair
}
#: A word written in lower case: "No" and "North" in "No One Would Tell", "Mighty No. 9" and "North America"
#: are names, not a negation or a direction.
_LOWER_WORD = re.compile(r"(?<![\w'’-])[a-z]+(?:n't)?(?![\w'’-])")


#: Idioms whose words are no polarity: "at least two arms" says nothing against "the most".
_IDIOMS = re.compile(r"\bat (?:least|most)\b|\bmore or less\b|\b(?:no|not) (?:more|less|fewer) than\b")


def _lower_words(text: str) -> set[str]:
    return set(_LOWER_WORD.findall(_IDIOMS.sub(" ", text.replace("’", "'"))))


#: A query that asks: a question mark anywhere ("They did not allow which country?"), "what" (or "whats")
#: anywhere ("Space Island One starred what actress"), or a question word or an auxiliary first ("What was
#: developed for the Air Force"). A claim's "which", "where" or "when" opens a clause; it does not ask.
_ASKS = re.compile(
    r"\?|\bwhats?\b|^\W*(?:which|who|whom|whose|when|where|why|how|is|are|was|were|do|does|did|can|could|will|would"
    r"|should|has|have|had)\b",
    re.IGNORECASE,
)


#: A sentence ends before the next one opens ("I can't reach the server. What does listen_addresses default to?").
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
#: A clause that sets the question's conditions or leaves something out ("when no -F is given", "if nobody ever
#: changes it", "but not the ordinary queries"), to the next comma: a negation there is not what is asked. "When"
#: and "while" only after the question's start, where they do not ask.
_CONDITION = re.compile(
    r"(?:^|(?<=\s))(?:even\s+)?(?:if|unless|once|whenever|because|since|although|though|after|before|until|so that"
    r"|(?<!^)when|(?<!^)while|without|but not|and not|rather than|instead of)\b[^,;?]*",
    re.IGNORECASE,
)


def asking_sentence(question: str) -> str:
    """``question``'s last sentence that asks: a user's question often first says what happened ("I ran CREATE
    ROLE app_user and now it can't log in. Which login attribute does CREATE ROLE give by default?")."""
    parts = [p for p in _SENTENCE_END.split(question.strip()) if p.strip()]
    asking = [p for p in parts if asks(p)]
    return asking[-1] if asking else question


@lru_cache(maxsize=4096)
def asked_clause(question: str) -> str:
    """The part of ``question`` that asks: its ``asking_sentence``, less its clauses of condition and exclusion
    (``_CONDITION``)."""
    return _CONDITION.sub(" ", asking_sentence(question))


def asks(query: str) -> bool:
    """Whether ``query`` asks something (``_ASKS``), as a question does, rather than states it, as a claim does."""
    return bool(_ASKS.search(query))


def turned_round(question: str, best_sentence: str, passage: str) -> Optional[str]:
    """What in the passage turns the question round, or None.

    A negated question ("Which committees do *not* reflect the balance of parties?")
    whose best sentence negates nothing ("the members on each committee reflect the
    balance of parties"), where only the clause that asks counts (``asked_clause``:
    "Which database does CREATE DATABASE copy when no TEMPLATE is given?" is not
    negated); or a question's word whose opposite the best sentence holds
    where the passage never uses the word itself ("When is antibody production
    *higher*?" against "... production is *lower* ..."). Both are how a person makes a
    question the passage cannot answer out of one it can, with every other word kept.
    A claim is not turned round: a passage that says the opposite of a claim is the
    evidence that refutes it, which is what a user checking the claim needs.
    """
    if not asks(question):
        return None
    asked = _lower_words(question)
    clause = asked_clause(question)
    in_clause = _lower_words(clause)
    negated = bool(in_clause & _QUESTION_NEGATION) or any(w.endswith("n't") for w in in_clause)
    if negated and not _NOT_A_NEGATION.search(clause.lower()):
        if not _PASSAGE_NEGATION.search(best_sentence):
            return "the question is negated and its passage states it"
    polar = sorted(asked & OPPOSITE.keys())
    if not polar:  # most questions: the passage need not be read again
        return None
    held, best = set(re.findall(r"[a-z]+", passage.lower())), _lower_words(best_sentence)
    for word in polar:
        opposite = OPPOSITE[word] & best
        if opposite and word not in held:
            return f'the question says "{word}", its passage says "{sorted(opposite)[0]}"'
    return None


def constraints(question: str, passage: str) -> float:
    """Whether the passage keeps the question's years, numbers and quoted names.

    1 when every one is there; 0 when a year asked is missing and the passage holds
    another year instead (asked "in 2017", only "2021" there: a near miss that
    contradicts); 0.25 when one is missing otherwise; 0.5 when the question sets none.
    """
    asked = _values(question)
    quoted = [q.strip().lower() for q in QUOTED.findall(question)]
    if not any(asked.values()) and not quoted:
        return 0.5
    held = _values(passage)
    lowered = passage.lower()
    missing_quote = any(q not in lowered for q in quoted)
    # Only a year contradicts: another year is another time; another number is often another quantity.
    contradicted = bool(asked["year"] - held["year"] and held["year"] - asked["year"])
    if contradicted:
        return 0.0
    if missing_quote or any(asked[k] - held[k] for k in asked):
        return 0.25
    return 1.0
