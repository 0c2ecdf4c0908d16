"""The questions of an evaluation set, with the strings whose presence in a context means the answer is there."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

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


def load_eval_questions(folder: Path | str) -> List[EvalQuestion]:
    """The questions of a dataset folder, each with its gold strings (see ``EvalQuestion``)."""
    folder = Path(folder)
    questions = load_questions(folder)
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
