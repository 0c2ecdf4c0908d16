"""Training pairs for the reading grader, made from a corpus alone (QNLI-style, with hard negatives).

A sentence that names something is a question whose answer is known. Each such
question gives one positive, a window of text holding the sentence, and negatives
that teach what on-topic noise looks like, because that is what the evidence features
cannot see:

- ``answer_removed``: the same window with the answering sentence taken out (same
  topic, same words, no answer);
- ``entity_swapped``: the window with a name, date or number the question keeps
  replaced by another of the same type from the corpus;
- ``question_swapped``: the window unchanged, the question asking about a near miss
  instead (a name, date or number it keeps replaced by another of the same type from
  the same document: the same title won by another person, the same event in another
  year), as the adversarial unanswerable questions of SQuAD 2.0 are written;
- ``wh_swapped``: the window unchanged, the question asking for a kind of answer the
  window does not hold ("When ...?" where it names no date);
- ``sibling``: another window of the same document that shares the most question
  words but not the answer;
- ``random``: a window of another document.

Answers are named entities and also plain noun phrases ("What ... ?"), and for
claim-style corpora the question may be a claim (the sentence cut down, sometimes
negated: a passage that contradicts a claim still speaks to it). Questions are
reworded from the sentence (the answer replaced by its question word at the front,
the context cut to a few words either side, some content words dropped) so that a
question never repeats its sentence word for word. Documents are split into a
training part and a held-out part, so that held-out figures measure reading on text
the model never saw.
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

from tqdm import tqdm

from llama_index_crag.calibration.synthetic import WH_WORDS, load_spacy
from llama_index_crag.calibration.training import Pair, PairSet
from llama_index_crag.datasets import load_documents
from llama_index_crag.errors import DatasetError

POSITIVE = "positive"
ANSWER_REMOVED = "answer_removed"
ENTITY_SWAPPED = "entity_swapped"
QUESTION_SWAPPED = "question_swapped"
WH_SWAPPED = "wh_swapped"
SIBLING = "sibling"
RANDOM = "random"
PAIR_KINDS = (POSITIVE, ANSWER_REMOVED, ENTITY_SWAPPED, QUESTION_SWAPPED, WH_SWAPPED, SIBLING, RANDOM)

#: Question words for noun-phrase answers, by the phrase's role in its sentence.
_NOUN_PHRASE_DEPS = {"nsubj", "nsubjpass", "dobj", "pobj", "attr"}
#: Question words whose answer is an entity of one of these types: a window with none cannot answer them.
_ASKED_TYPES: Dict[str, FrozenSet[str]] = {
    "When": frozenset({"DATE", "TIME"}),
    "Who": frozenset({"PERSON", "ORG", "NORP"}),
    "Where": frozenset({"GPE", "LOC", "FAC"}),
    "How many": frozenset({"CARDINAL", "QUANTITY"}),
    "How much": frozenset({"MONEY", "QUANTITY", "CARDINAL"}),
    "What percentage": frozenset({"PERCENT"}),
}
_NEGATION = re.compile(r"\b(not|no|never|without|neither|nor|cannot|n't)\b", re.IGNORECASE)
_CONTEXT = 8


@dataclass
class _Doc:
    doc_id: str
    sentences: List[Any]  # spaCy spans


def _windows(sentences: Sequence[Any], words: int) -> List[Tuple[int, int]]:
    """Consecutive sentence ranges of at most ``words`` words (a longer sentence stands alone)."""
    out, start, size = [], 0, 0
    for i, sentence in enumerate(sentences):
        n = len(sentence)
        if size and size + n > words:
            out.append((start, i))
            start, size = i, 0
        size += n
    if start < len(sentences):
        out.append((start, len(sentences)))
    return out


def _text(sentences: Sequence[Any]) -> str:
    return " ".join(s.text.strip() for s in sentences)


def _window_around(sentences: Sequence[Any], index: int, words: int, rng: random.Random) -> Tuple[int, int]:
    """A window holding sentence ``index`` at a random position, grown with neighbours up to ``words`` words."""
    start, end = index, index + 1
    size = len(sentences[index])
    while True:
        grow = [side for side, ok in (("left", start > 0), ("right", end < len(sentences))) if ok]
        if not grow:
            break
        side = rng.choice(grow)
        extra = len(sentences[start - 1]) if side == "left" else len(sentences[end])
        if size + extra > words:
            break
        size += extra
        if side == "left":
            start -= 1
        else:
            end += 1
    return start, end


def _reword(sentence: Any, answer: Any, wh: str, rng: random.Random) -> Optional[Tuple[str, FrozenSet[int]]]:
    """The question for ``answer`` and the tokens it keeps: its question word first, then some of its context.

    A subject is asked about with its predicate ("Who added 186 customers during the
    quarter?"); anything else with a few words either side of it, the preposition that
    introduced it dropped. Content words outside names are dropped one time in five.
    """
    root = answer.root
    if root.dep_ in ("nsubj", "nsubjpass") and root.head.i >= answer.end:
        context = [t for t in root.head.subtree if answer.end <= t.i < sentence.end][:16]
    else:
        start = max(sentence.start, answer.start - _CONTEXT)
        end = min(sentence.end, answer.end + _CONTEXT)
        context = [
            t
            for t in sentence.doc[start:end]
            if not answer.start <= t.i < answer.end and not (t.i == answer.start - 1 and t.dep_ == "prep")
        ]
    kept = [
        t for t in context if not t.is_punct and not t.is_space and (t.is_stop or t.ent_type_ or rng.random() >= 0.2)
    ]
    if len(kept) < 3:
        return None
    return f"{wh} {_join(kept)}?", frozenset(t.i for t in kept)


def _join(tokens: Sequence[Any]) -> str:
    """Tokens as text: glued where they were glued in the sentence ("$88", "12-week"), else spaced."""
    text = ""
    for previous, token in zip([None, *tokens], tokens):
        glued = previous is not None and previous.i == token.i - 1 and not previous.whitespace_
        text += ("" if glued or not text else " ") + token.text
    return text


def _claim(sentence: Any, rng: random.Random) -> Optional[str]:
    """A claim cut down from the sentence (at least one content word dropped), negated one time in four."""
    words_of = [t for t in sentence if not t.is_punct and not t.is_space]
    # At least one content word goes from inside the sentence, so that the claim is never a prefix of it.
    inner = [t.i for t in words_of[1:-1] if not t.is_stop]
    if not inner:
        return None
    dropped = {rng.choice(inner)} | {t.i for t in words_of if not t.is_stop and rng.random() < 0.15}
    words = _join([t for t in words_of if t.i not in dropped]).split()
    if len(words) < 5:
        return None
    if rng.random() < 0.25:
        verbs = [
            i for i, t in enumerate(sentence) if t.pos_ == "AUX" and t.text.lower() in ("is", "are", "was", "were")
        ]
        if verbs and not _NEGATION.search(sentence.text):
            aux = sentence[verbs[0]].text
            position = next((i for i, w in enumerate(words) if w == aux), None)
            if position is not None:
                words.insert(position + 1, "not")
    claim = " ".join(words[:40]).rstrip(".")
    return None if claim.lower() in sentence.text.lower() else claim + "."


def _answers(sentence: Any) -> Iterator[Tuple[Any, str]]:
    """What a question can ask for in a sentence: its named entities, then its subject and object noun phrases."""
    for entity in sentence.ents:
        wh = WH_WORDS.get(entity.label_)
        if wh and len(entity.text) > 1:
            yield entity, wh
    for chunk in sentence.noun_chunks:
        if chunk.root.dep_ in _NOUN_PHRASE_DEPS and chunk.root.pos_ != "PRON" and 1 <= len(chunk) <= 5:
            if not any(e.start <= chunk.start < e.end for e in sentence.ents):
                yield chunk, "What"


def _kept_entities(sentence: Any, answer: Any, kept: FrozenSet[int]) -> List[Any]:
    """Entities of the sentence, other than the answer, that the question still names whole."""
    return [
        e
        for e in sentence.ents
        if not (e.start < answer.end and answer.start < e.end)
        and e.label_ in WH_WORDS
        and all(i in kept for i in range(e.start, e.end))
    ]


def make_pairs(
    folder: Path | str,
    count: int = 20_000,
    held_out_share: float = 0.1,
    window_words: int = 80,
    claims: float = 0.15,
    seed: int = 0,
    nlp: Any = None,
    progress: bool = True,
) -> PairSet:
    """About ``count`` pairs from ``folder``'s ``corpus.jsonl`` (no question or label of the dataset is read).

    About a third of the pairs are positive. ``claims`` is the share of questions made as
    claims rather than wh-questions. Documents are held out whole.
    """
    rng = random.Random(seed)
    documents = load_documents(folder)
    if not documents:
        raise DatasetError(f"{Path(folder) / 'corpus.jsonl'} holds no documents")
    order = list(range(len(documents)))
    rng.shuffle(order)
    nlp = nlp or load_spacy()
    docs: List[_Doc] = []
    pool: Dict[str, List[str]] = defaultdict(list)
    candidates: List[List[Tuple[int, int, Any, Any, str]]] = []
    texts = (documents[i].text for i in order)
    # Every question gives about three pairs; read documents until there are enough questions.
    wanted = count // 3 + 1
    found = 0
    bar = tqdm(total=wanted, desc="reading documents", unit="question", disable=not progress)
    for index, doc in zip(order, nlp.pipe(texts, batch_size=32)):
        sentences = [s for s in doc.sents if s.text.strip()]
        if len(sentences) < 2:
            continue  # no passage is left once the answer's sentence is removed
        d = len(docs)
        docs.append(_Doc(documents[index].doc_id, sentences))
        mine = []
        for i, sentence in enumerate(sentences):
            if len(sentence) < 6:
                continue
            for answer, wh in _answers(sentence):
                mine.append((i, sentence, answer, wh))
            for entity in sentence.ents:
                pool[entity.label_].append(entity.text)
        rng.shuffle(mine)
        candidates.append([(d, *c) for c in mine])
        found += min(len(mine), 12)
        bar.update(min(len(mine), 12))
        if found >= wanted and len(docs) >= 20:
            break
    bar.close()
    if not docs:
        raise DatasetError(f"no document of {Path(folder) / 'corpus.jsonl'} has two sentences to make pairs from")
    # Held out among the documents read (a long corpus is read only until there are enough questions).
    held_out_ids = {d.doc_id for d in rng.sample(docs, max(1, round(len(docs) * held_out_share)))}

    # Round-robin over documents, so that a long document does not crowd out the rest.
    queue: List[Tuple[int, int, Any, Any, str]] = []
    depth = 0
    while len(queue) < wanted and any(depth < len(c) for c in candidates):
        queue.extend(c[depth] for c in candidates if depth < len(c))
        depth += 1

    train: List[Pair] = []
    held_out: List[Pair] = []
    made = 0
    for d, i, sentence, answer, wh in tqdm(queue, desc="making pairs", unit="question", disable=not progress):
        if made >= count:
            break
        pairs = _pairs_for(docs, d, i, sentence, answer, wh, pool, window_words, claims, rng)
        (held_out if docs[d].doc_id in held_out_ids else train).extend(pairs)
        made += len(pairs)
    if not any(p.label for p in train) or not any(p.label for p in held_out):
        raise DatasetError(f"too few sentences with a name, date or noun phrase in {folder} to make training pairs")
    return PairSet(train, held_out)


def _pairs_for(
    docs: Sequence[_Doc],
    d: int,
    i: int,
    sentence: Any,
    answer: Any,
    wh: str,
    pool: Dict[str, List[str]],
    window_words: int,
    claims: float,
    rng: random.Random,
) -> List[Pair]:
    """The positive and its negatives for one (sentence, answer); empty when no question can be made."""
    doc = docs[d]
    as_claim = rng.random() < claims
    kept_tokens: FrozenSet[int] = frozenset()
    if as_claim:
        question = _claim(sentence, rng)
    else:
        made = _reword(sentence, answer, wh, rng)
        question, kept_tokens = made if made else (None, kept_tokens)
    if question is None:
        return []
    answer_text = sentence.text.strip() if as_claim else answer.text
    start, end = _window_around(doc.sentences, i, window_words, rng)
    window = doc.sentences[start:end]
    pairs = [Pair(question, _text(window), 1, POSITIVE, doc.doc_id)]

    def negative(passage: str, kind: str, lacks: str) -> None:
        if passage.strip() and lacks.lower() not in passage.lower():
            pairs.append(Pair(question, passage, 0, kind, doc.doc_id))

    # The window without its answering sentence, topped up with the next sentence out so it keeps its length
    # (for most questions: it is the easiest hard negative, the question's own words leave with the sentence).
    if rng.random() < 0.6:
        without = [s for s in window if s.start != sentence.start]
        if end < len(doc.sentences):
            without.append(doc.sentences[end])
        elif start > 0:
            without.insert(0, doc.sentences[start - 1])
        negative(_text(without), ANSWER_REMOVED, answer_text)

    roll = rng.random()
    kept = _kept_entities(sentence, answer, kept_tokens)
    if kept and roll < 0.2:
        entity = rng.choice(kept)
        others = [t for t in pool[entity.label_] if t != entity.text and t.lower() not in question.lower()]
        if others:
            # The answer is still there, but about something else than the question asks.
            negative(_text(window).replace(entity.text, rng.choice(others)), ENTITY_SWAPPED, entity.text)
            return pairs
    if kept and roll < 0.45:
        entity = rng.choice(kept)
        # Asked about a near miss: another name, date or number of the same kind, from the same document
        # when it has one (the same title won by another person, the same event in another year).
        near = {e.text for s in doc.sentences for e in s.ents if e.label_ == entity.label_} - {entity.text}
        near = {t for t in near if t.lower() not in sentence.text.lower()}
        others = sorted(near) or [t for t in pool[entity.label_] if t.lower() not in sentence.text.lower()]
        if others:
            swap = rng.choice(others)
            asked = re.sub(rf"(?<!\w){re.escape(entity.text)}(?!\w)", lambda _: swap, question, count=1)
            pairs.append(Pair(asked, pairs[0].passage, 0, QUESTION_SWAPPED, doc.doc_id))
            return pairs
    if not as_claim and roll < 0.65:
        # The same question asking for a kind of answer the window does not hold ("When" where no date is).
        present = {e.label_ for s in window for e in s.ents}
        absent = [w for w, labels in _ASKED_TYPES.items() if w != wh and not labels & present]
        if absent:
            other_wh = rng.choice(absent)
            pairs.append(Pair(other_wh + question[len(wh) :], pairs[0].passage, 0, WH_SWAPPED, doc.doc_id))
            return pairs
    if roll < 0.85:
        words = set(question.lower().split())
        siblings = [
            (len(words & set(_text(doc.sentences[a:b]).lower().split())), a, b)
            for a, b in _windows(doc.sentences, window_words)
            if b <= start or a >= end
        ]
        if siblings:
            _, a, b = max(siblings)
            negative(_text(doc.sentences[a:b]), SIBLING, answer_text)
            return pairs
    other = docs[rng.randrange(len(docs))]
    if other.doc_id != doc.doc_id:
        a, b = rng.choice(_windows(other.sentences, window_words))
        negative(_text(other.sentences[a:b]), RANDOM, answer_text)
    return pairs
