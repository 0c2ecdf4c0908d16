"""The names a question asks about, and whether a quoted strip's passage has named them by the strip's end."""

from __future__ import annotations

import re

from llama_index.core.schema import NodeWithScore
from rapidfuzz import fuzz, process

from llama_index_crag.scorers.answer_type import asked_kinds
from llama_index_crag.text.strips import Strip

#: A capitalised word with a lower-case letter: "Singapore", "McKinsey", "Galor"; not "EU-2", "Q3" or "IL-2"
#: (codes, which ``states_what_is_asked`` reads), not inside a hyphenated word.
_NAME = re.compile(r"(?<![\w-])[A-Z][\w'-]*[a-z][\w'-]*")
#: Words written with a capital inside a question that name nothing.
_NOT_NAMES = frozenset("i what who when where which how why whose whom the a an in on of and is was does did".split())
#: How close a word must be to a name the question spells (rapidfuzz ratio): "Zeria" for "Zeira" is 80.
SPELLING = 80


def asked_names(question: str) -> list[str]:
    """The names ``question`` asks about, casefolded: its capitalised words but the first, and not an owner.

    An owner ("Scotland's voting population", "Harbor's largest site") is the frame of the question, often
    the whole document's subject, and a passage may write it another way ("Scottish") or leave it unsaid.
    """
    rest = question.strip().split(None, 1)[1:]
    found = (n.casefold() for n in _NAME.findall(rest[0] if rest else "") if not re.search(r"['’]s?$", n))
    return list(dict.fromkeys(n for n in found if n not in _NOT_NAMES))


def names_what_is_asked(question: str, node: NodeWithScore, strip: Strip) -> bool:
    """Whether every name ``question`` asks about is stated in the passage's title or its text up to the end of
    ``strip`` (or in the strip's graded text, which carries the subject a strip refers back to).

    A passage names a thing before it speaks of it, so a strip before the name's first mention is about
    something else: "The Toronto office opened in January 2020" comes before "The Singapore office ..." and
    does not say when the Singapore office opened, however well it grades. A name may be the start of a word
    ("Victoria" in "Victorian") or misspelt in the question ("Zeria" for "Zeira", ``SPELLING``). A claim asks
    for no kind of answer (``asked_kinds``) and is not held to its names: its subject is the abstract's.
    """
    names = asked_names(question)
    if not names or asked_kinds(question) is None:
        return True
    whole = node.node.get_content()
    start = whole.find(strip.text.strip()[:80])
    upto = whole if start < 0 else whole[: start + len(strip.text.strip())]
    said = f"{node.node.metadata.get('title') or ''} {upto} {strip.graded_text}".casefold()
    words = set(re.findall(r"\w+", said))
    return all(
        re.search(r"(?<!\w)" + re.escape(name), said)
        or (len(name) >= 5 and process.extractOne(name, words, scorer=fuzz.ratio, score_cutoff=SPELLING))
        for name in names
    )
