"""The deterministic keyword rewrite: the query the INCORRECT branch searches with when the LLM's rewrite fails."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, List

from llama_index_crag.text.cleaning import clean_text
from llama_index_crag.text.patterns import CAPITALISED_RUN

#: Words that carry a figure or a code: years, quarters, versions, model numbers ("2023", "Q3", "EU-2", "4.3.1").
_CODED = re.compile(r"(?<!\S)\S*\d\S*", re.UNICODE)


@lru_cache(maxsize=8)
def _extractor(language: str) -> Any:
    import yake

    return yake.KeywordExtractor(lan=language, n=3, top=12, dedupLim=0.9)


def keyword_query(question: str, language: str = "en") -> str:
    """The question's search keywords, in the order they appear, each word once.

    Noun phrases and content words come from YAKE (a statistical keyword extractor
    with stopword lists for many languages, so the language is kept); figures and
    codes ("Q3 2023", "EU-2", "4.3.1"), which YAKE drops, and capitalised names are
    added from the question itself. Nothing is invented, so a rewrite never fails:
    at worst it is the question without its question words.
    """
    text = " ".join(clean_text(question).split())
    extractor = _extractor(language)
    found: List[tuple[int, str]] = []
    for phrase, _ in extractor.extract_keywords(text):
        start = text.find(phrase)
        found.append((start if start >= 0 else len(text), phrase))
    found += [(m.start(), m.group(0)) for m in _CODED.finditer(text)]
    found += [(m.start(), m.group(0)) for m in CAPITALISED_RUN.finditer(text)]
    words: List[str] = []
    seen = set()
    for _, phrase in sorted(found):
        for word in phrase.split():
            word = re.sub(r"['’]s$", "", word.strip("?!.,;:\"'()[]"))
            key = word.casefold()
            if word and key not in seen and key not in extractor.stopword_set:
                seen.add(key)
                words.append(word)
    return " ".join(words) or text
