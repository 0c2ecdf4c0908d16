"""The questions of an evaluation set, with the strings whose presence in a context means the answer is there."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from llama_index_crag.datasets import Question, load_questions, read_jsonl

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


@dataclass(frozen=True)
class EvalQuestion:
    """A labelled question and its gold strings.

    ``answers`` are the short answers a generated answer is checked against (SQuAD);
    ``gold_context`` are the strings that show the context holds the answer: the
    answers themselves, or, for a set without short answers (SciFact), the evidence
    sentences of the relevant documents.
    """

    question: Question
    gold_context: Tuple[str, ...]

    @property
    def answers(self) -> Tuple[str, ...]:
        return tuple(self.question.answers)


def normalize(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.casefold().translate(_PUNCTUATION)).split())


def contains_any(haystack: str, needles: Tuple[str, ...]) -> Optional[bool]:
    """Whether any of ``needles`` occurs in ``haystack`` after normalisation; None with no needles."""
    wanted = [n for n in (normalize(n) for n in needles) if n]
    if not wanted:
        return None
    text = normalize(haystack)
    return any(n in text for n in wanted)


#: The fewest words a quote needs to count as quoting the evidence sentence it stands inside.
MIN_QUOTE_WORDS = 5


def quotes_any(quotes: Sequence[str], sentences: Tuple[str, ...]) -> Optional[bool]:
    """Whether any quote is one of ``sentences`` (SciFact's rationale), after normalisation: a sentence stands
    whole in a quote, or a quote of at least ``MIN_QUOTE_WORDS`` words stands inside a sentence. None with no
    sentences. A quote of the right abstract's background does not verify a claim; its rationale does."""
    wanted = [s for s in (normalize(s) for s in sentences) if s]
    if not wanted:
        return None
    for quote in (normalize(q) for q in quotes):
        if any(s in quote for s in wanted):
            return True
        if len(quote.split()) >= MIN_QUOTE_WORDS and any(quote in s for s in wanted):
            return True
    return False


def load_eval_questions(folder: Path | str, split: str = "all") -> List[EvalQuestion]:
    """The questions of a dataset folder (of one half, ``datasets.Halves``), each with its gold strings (see
    ``EvalQuestion``)."""
    folder = Path(folder)
    questions = load_questions(folder, split)
    evidence = _evidence_sentences(folder) if any(q.answerable and not q.answers for q in questions) else {}
    return [EvalQuestion(q, tuple(q.answers) or evidence.get(q.qid, ())) for q in questions]


def _evidence_sentences(folder: Path) -> Dict[str, Tuple[str, ...]]:
    """SciFact-style ``evidence`` (sentence indices per document), resolved to the sentences' text."""
    sentences = {str(row["doc_id"]): row.get("sentences") or [] for row in read_jsonl(folder / "corpus.jsonl")}
    found: Dict[str, Tuple[str, ...]] = {}
    for row in read_jsonl(folder / "questions.jsonl"):
        picked = [
            sentences[doc][i]
            for doc, item in (row.get("evidence") or {}).items()
            for i in item.get("sentences", [])
            if doc in sentences and i < len(sentences[doc])
        ]
        if picked:
            found[str(row["qid"])] = tuple(picked)
    return found
