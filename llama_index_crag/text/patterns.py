"""Numbers, units, codes and names in text: the one set of patterns the scorer, the answer step and the check read.

Three parts of the loop look for the same kinds of token. The scorer's answer-type and
constraint features (``scorers/answer_type.py``) ask whether a passage holds a length, a
date or an amount, and whether it gives the year a question sets. The answer step
(``answers/extract.py``) asks whether a strip states the figures, codes and names a
question names. The check (``answers/grounding.py``) lists the figures, codes and names an
answer states and looks for each in its sources. The knowledge strips' subjects, the
keyword rewrite and the compound-question split read names too. Every such pattern is here,
named by what it matches; where two parts need different forms of one kind (a code a
question names, and a code an answer must state verbatim), both are here, side by side,
with what tells them apart. They are regular expressions: deterministic, no model call,
fast enough for every batch, and the same on every machine. The answer step's network reads
features computed with them, so a change to a pattern here is a change to its inputs: it
needs the network trained again and a check-half run.
"""

from __future__ import annotations

import re
from typing import Dict, FrozenSet

# -- numbers ----------------------------------------------------------------------------------------------------

#: A year written in digits, 1000 to 2099 (a pattern's source, for larger patterns).
YEAR = r"1[0-9]{3}|20[0-9]{2}"
#: A number as a passage writes a quantity: digits, a number word, or a vague count ("a few", "dozens").
NUMBER = (
    r"(?:\d[\d,]*(?:\.\d+)?|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen"
    r"|fifteen|sixteen|seventeen|eighteen|nineteen|(?:twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety)"
    r"(?:[- ](?:one|two|three|four|five|six|seven|eight|nine))?|(?:a |one )?(?:hundred|thousand|million|billion)s?"
    r"|a few|several|a dozen|dozens)"
)
#: Number words up to twenty and the digits they stand for ("fourteen" states 14).
NUMBER_WORDS: Dict[str, str] = {
    w: str(i)
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen twenty".split()
    )
}
#: A number standing alone: not part of a name or code such as "EU-2", "Q3" or "v4.3.1".
VALUE = re.compile(r"(?<![\w.-])\d[\d,]*(?:\.\d+)?(?![\w-]|\.\d)")
#: A range of plain numbers ("76-85").
NUMBER_RANGE = re.compile(r"\d+(?:\.\d+)?-\d+(?:\.\d+)?")

# -- units ------------------------------------------------------------------------------------------------------

MONTHS = (
    "january|february|march|april|may|june|july|august|september|october|november|december"
    "|jan|feb|mar|apr|jun|jul|aug|sep|sept|oct|nov|dec"
)
LENGTH_UNITS = (
    r"(?:kilo|centi|milli)?met(?:re|er)s?|km|cm|mm|m|miles?|mi|feet|foot|ft|inch(?:es)?|in\.|yards?|yd"
    r"|nautical miles?|light[- ]years?|(?:square|sq\.?) (?:met(?:re|er)s?|miles?|feet|km)|acres?|hectares?"
    r"|storeys|stories"
    # the size of data: a name "may be 63 bytes long", a WAL segment "is 16MB"
    r"|bytes?|characters?|kilobytes?|megabytes?|gigabytes?|terabytes?|kb|mb|gb|tb"
)
DURATION_UNITS = (
    r"(?:milli)?seconds?|secs?|minutes?|mins?|hours?|hrs?|days?|weeks?|months?|years?|decades?|centur(?:y|ies)"
)
CURRENCY = r"[$€£¥₹]|\b(?:usd|eur|gbp|dollars?|euros?|pounds?|yen|francs?|marks?|rupees?)\b"
#: A scale after a figure ("$61.4 million", "3bn").
SCALE = r"(?:thousand|million|billion|trillion|[kmb]n?)\b"
#: The units the check reads after a number it compares: a share, a span of time or a scale.
CHECKED_UNIT = r"(?:%|per ?cent\b|(?:second|minute|hour|day|week|month|year|thousand|million|billion|trillion)s?\b)"
#: A number (digits or a number word) and the unit that follows it, if any: "14 days", "118%", "$61.4 million".
QUANTITY = re.compile(
    rf"(?<![\w.-])(\d[\d,]*(?:\.\d+)?|{'|'.join(NUMBER_WORDS)})(?![\w-]|\.\d)(?:[\s-]*({CHECKED_UNIT}))?",
    re.IGNORECASE,
)
#: The space a text may put between a number and its unit ("40 mg" for "40mg").
UNIT_GAP = re.compile(r"(?<=\d)\s+(?=[^\W\d_])")

#: Where a text states a default, with what it is: "The default is 4MB", "defaults to 0.9", "(default 100)",
#: "Read Committed is the default", "uses spread checkpoints by default", "spread (the default)", "B-trees use a
#: default fillfactor of 90".
STATED_DEFAULT = re.compile(
    r"\bdefaults?(?:\s+value)?\s*(?:\b(?:is|are|was|to)\b|:|=)\s*[^\s.,;]+"
    r"|\(defaults?:?\s+[^)\s]+[^)]*\)"
    r"|[^\s.,;]+\s+(?:is|are|was)\s+(?:the\s+)?default\b"
    r"|[^\s.,;]+\s+by\s+default\b"
    r"|[^\s.,;(]+\s+\((?:the\s+)?default\)"
    r"|\bdefault\s+[\w-]+(?:\s+[\w-]+)?\s+of\s+\d[^\s,;]*",
    re.IGNORECASE,
)

# -- codes ------------------------------------------------------------------------------------------------------

#: Figures and codes a question names, loosely: any word with a digit in it (years, quarters, versions, regions:
#: "2023", "Q2", "7.2.1", "EU-2"); the answer step looks for each in a strip.
FIGURES_AND_CODES = re.compile(r"[\w-]*\d(?:[\w-]|\.\d)*")
#: Codes and versions an answer states, strictly: letters and a digit, a dotted version or a file name ("Q3",
#: "EU-2", "v4.3.1", "4.3.1", "harbor.js"); the check wants each verbatim in a source. A plain number is a
#: quantity (``QUANTITY``), compared as a number, not as a code.
CODE = re.compile(r"(?<![\w.])(?:[A-Za-z]+[-_]?\d[\w.-]*|\d+(?:\.\d+){2,}|[a-z]\w*\.(?:js|py|json|yaml|yml|sh|io))\b")
#: An identifier of software a question names: a word joined by underscores ("max_connections",
#: "pg_stat_replication") or a long command-line option ("--strict-names"); no dictionary writes it another way.
IDENTIFIER = re.compile(
    r"(?<![\w'-])[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+(?![\w-])|(?<!\S)--[A-Za-z][\w-]*[A-Za-z0-9]"
)
#: A word that describes a code rather than belongs to it ("SF1-expressing neurons", "UCP1-dependent", "M2-like").
CODE_SUFFIX = re.compile(
    r"-(?:(?:in)?dependent|expressing|like|induced|mediated|deficient|positive|negative|specific|related|associated"
    r"|containing|derived|type)$"
)

# -- names ------------------------------------------------------------------------------------------------------

#: A capitalised word with a lower-case letter ("Singapore", "McKinsey"): a name a question asks about (not an
#: acronym or a code, which ``FIGURES_AND_CODES`` and ``CODE`` read).
NAME = re.compile(r"(?<![\w-])[A-Z][\w'-]*[a-z][\w'-]*")
#: Capitalised words that open a question or a sentence and name nothing.
NOT_NAMES: FrozenSet[str] = frozenset(
    "i what who when where which how why whose whom the a an in on of and is was does did".split()
)
#: A proper name as an answer kind: a capitalised word with a lower-case letter, not opening a sentence, and the
#: capitalised words and joiners after it ("Kestrel Bridge", "University of Notre Dame").
NAME_PHRASE = re.compile(
    r"(?<![.!?]\s)(?<!^)\b[A-Z][\w'’-]*[a-z][\w'’-]*(?:\s+(?:[A-Z][\w'’.-]+|of|de|van|von|al|bin))*"
)
#: A run of capitalised words not opening a sentence ("Harbor Analytics"): the names the keyword rewrite keeps.
CAPITALISED_RUN = re.compile(r"(?<!^)(?<![.?!]\s)\b[A-Z][\w'’-]*(?:\s+[A-Z][\w'’-]*)*")
#: One word of a name as the check reads an answer: capitalised, with the marks names carry ("AT&T", "St.").
NAME_WORD = re.compile(r"[A-Z][\w'’&.-]*")
#: Lower-case words a name may hold between its capitalised ones ("Bank of England", "Ludwig van Beethoven").
NAME_JOINERS: FrozenSet[str] = frozenset(
    {"of", "de", "da", "van", "von", "der", "del", "la", "le", "and", "&", "the", "al", "bin"}
)
#: A capitalised word anywhere: a name, part of one, or a code ("Kestrel", "Farrow", "EU-2", "Q3").
CAPITALISED = re.compile(r"\b[A-Z][\w'’-]*")

# -- quoted text ------------------------------------------------------------------------------------------------

#: Text a question puts in quotation marks ("the song "Halo""): a title or term a passage must hold as written.
QUOTED = re.compile(r"[\"“”]([^\"“”]{2,80})[\"“”]")
#: Text an answer quotes or marks as code (backticks: `max_connections`), which the check wants verbatim.
QUOTED_OR_CODE = re.compile(r"[\"“`]([^\"“”`]{2,80})[\"”`]")
