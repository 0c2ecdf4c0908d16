"""Text split into sentences (``split_sentences``: every strip and sentence the loop reads) and into content words
(``terms``: what lexical evidence, BM25 and full-text search match)."""

from __future__ import annotations

import functools
import re
from typing import Any, List

from llama_index.core.node_parser.text.utils import split_by_sentence_tokenizer_internal
from llama_index.core.utils import globals_helper
from nltk.stem.porter import PorterStemmer

#: Abbreviations that stand inside sentences of papers and encyclopaedias and NLTK's English model lacks ("e.g.
#: aspirin", "Smith et al. showed", "Fig. 2", "Mt. Everest"). "No." is not among them: "the answer was no." ends one.
_MORE_ABBREVIATIONS = frozenset(
    {"e.g", "i.e", "al", "fig", "figs", "mt", "approx", "ca", "cf", "ref", "refs", "vol", "eq", "pp"}
)
#: A numbered item's "No." or "Nos." ending a split, before the number that opens the next ("Regiments No. 13").
_NUMBER_SIGN = re.compile(r"\bNos?\.\s*$")
#: A question or exclamation mark ending a split (a closing quote or bracket after it), and a split that goes on
#: in lower case: the mark ended no sentence. Punkt ends one at every "?" and "!", but a manual writes them as
#: operators and prompts ("the key-exists operator ? is indexable", "@? and @@", "or ! when in a failed
#: transaction"), and prose quotes a question in a sentence ('"Why?" he asked').
_MARK_ENDS = re.compile(r"[?!][\"'”’)\]]*\s*$")
_GOES_ON = re.compile(r"[a-z]")


@functools.lru_cache(maxsize=1)
def _sentence_tokenizer() -> Any:
    """NLTK's trained English punkt model (``punkt_tab``, which LlamaIndex bundles) with ``_MORE_ABBREVIATIONS``.

    LlamaIndex's own ``split_by_sentence_tokenizer`` uses an untrained ``PunktSentenceTokenizer``, which knows no
    abbreviation and cuts "Dr. Smith", "the St. Lawrence" and "the U.S. Army" in two. Where the model cannot be
    loaded, that untrained tokenizer is used with the abbreviations added.
    """
    from nltk.tokenize import PunktSentenceTokenizer, PunktTokenizer

    globals_helper.wait_for_nltk_check()  # puts LlamaIndex's bundled NLTK data on NLTK's path
    try:
        tokenizer = PunktTokenizer("english")
    except LookupError:
        tokenizer = PunktSentenceTokenizer()
    # NLTK has no public way to add abbreviations to a loaded model; its parameters are a plain set.
    tokenizer._params.abbrev_types.update(_MORE_ABBREVIATIONS)
    return tokenizer


def split_sentences(text: str) -> List[str]:
    """``text`` in sentences: consecutive slices, each running to where the next begins (so together they are the
    text from its first sentence on, spaces kept), as LlamaIndex's splitter cuts them, with abbreviations known
    (``_sentence_tokenizer``), a numbered item's "No." kept with its number, and a "?" or "!" that a lower-case word
    follows kept inside its sentence."""
    sentences: List[str] = []
    for sentence in split_by_sentence_tokenizer_internal(text, _sentence_tokenizer()):
        if sentences and (
            (sentence[:1].isdigit() and _NUMBER_SIGN.search(sentences[-1]))
            or (_GOES_ON.match(sentence) and _MARK_ENDS.search(sentences[-1]))
        ):
            sentences[-1] += sentence
        else:
            sentences.append(sentence)
    return sentences


_STOPWORDS = frozenset(
    "a an the of in on at to for from by with and or is are was were be been being what which who whom whose when "
    "where why how did does do done that this these those it its as into than then there their they them he she his "
    "her i you we our your not no yes can could would should will may might must has have had about after before "
    "over under between during most more less least also such other any all each some many much one name named "
    "called type kind use used".split()
)
_WORD = re.compile(r"[^\W_]+", re.UNICODE)
_STEMMER = PorterStemmer()


@functools.lru_cache(maxsize=200_000)
def _term(word: str) -> str:
    """The stem of a lower-cased word, or "" for a stopword (cached: the same words recur in every passage)."""
    return "" if word in _STOPWORDS else _STEMMER.stem(word)


def terms(text: str) -> List[str]:
    """Lower-cased, Porter-stemmed content words (any script), stopwords removed: "ages" and "aged" match."""
    return [t for t in (_term(m.group(0).lower()) for m in _WORD.finditer(text)) if t]
