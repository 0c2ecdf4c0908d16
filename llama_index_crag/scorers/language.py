"""Whether a question is written in a language the bundled English models cannot read.

The bundled embedding model (all-MiniLM-L6-v2) and the answer model were trained on
English. A German question whose answer is in the corpus grades low against it and
ends as an abstention; the trace must say why. A question is taken for another
language when it holds at least two of that language's commonest words and more than
twice as many as of English's, or when a quarter of its letters are not Latin. A claim of technical English
("Tirasemtiv targets cardiac muscle.") holds no such words and is not flagged.
"""

from __future__ import annotations

import re
from typing import Dict, FrozenSet, Optional

from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.scorers.bi_encoder import BUNDLED_MODEL_NAME, bi_encoder_of

#: The commonest function words of each language (articles, pronouns, auxiliaries, question words).
FUNCTION_WORDS: Dict[str, FrozenSet[str]] = {
    name: frozenset(words.split())
    for name, words in {
        "English": "the an of to in is are was were what who when where which how why does did do and for with "
        "that this it by from on at be has have",
        "German": "der die das ist sind war wer wie wann wo warum welche welcher welches und nicht ein eine einen dem "
        "den des mit von für auf zu im hat haben wurde",
        "French": "le la les est sont était qui quoi quand où pourquoi comment quel quelle quels un une des du et "
        "pas dans pour avec sur au aux ce cette il elle",
        "Spanish": "el la los las es son fue qué quién cuándo dónde por cómo cuál un una del y no en para con al "
        "este esta se",
        "Italian": "il lo la gli le è sono era chi cosa quando dove perché come quale un una del della e non per "
        "con che nel",
        "Portuguese": "o a os as é são foi quem quando onde porque como qual um uma do da dos das e não em para "
        "com que no na",
        "Dutch": "de het een is zijn was wie wat wanneer waar waarom hoe welke en niet van met voor op te",
    }.items()
}
_WORD = re.compile(r"[^\W\d_]+", re.UNICODE)


def foreign_language(question: str) -> Optional[str]:
    """The language ``question`` seems written in when it is not English (its name, or "a non-Latin script"),
    else None."""
    letters = [c for c in question if c.isalpha()]
    latin = sum(1 for c in letters if c.isascii() or "\u00c0" <= c <= "\u024f")
    if letters and latin < 0.75 * len(letters):
        return "a non-Latin script"
    words = [w.casefold() for w in _WORD.findall(question)]
    hits = {name: sum(1 for w in words if w in found) for name, found in FUNCTION_WORDS.items()}
    english = hits.pop("English")
    best = max(hits, key=lambda name: hits[name])
    return best if hits[best] >= 2 and hits[best] > 2 * english else None


def language_warning(question: str, scorer: RelevanceScorer) -> Optional[str]:
    """What the trace says when ``question`` seems not English and ``scorer`` embeds with the bundled English
    model: grading, and so any answer, will likely fail, and how to fix it. None otherwise."""
    bi_encoder = bi_encoder_of(scorer)
    if bi_encoder is None or bi_encoder.name != f"bi-encoder:{BUNDLED_MODEL_NAME}":
        return None
    language = foreign_language(question)
    if language is None:
        return None
    return (
        f"the question seems written in {language}, and the bundled models ({BUNDLED_MODEL_NAME} and the answer "
        "model) read English only: passages that answer it may grade low and the engine abstain. Give a "
        "multilingual embed_model and calibrate it (docs/configuration.md#questions-in-other-languages)"
    )
