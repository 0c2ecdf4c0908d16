"""Question sets in the shared format: ``corpus.jsonl`` and ``questions.jsonl`` in one folder."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from llama_index.core.schema import Document

from llama_index_crag.errors import DatasetError
from llama_index_crag.text.cleaning import clean_text

SAMPLE_DIR = Path(__file__).parent / "data"
#: The halves of a question set (``split_of``): every threshold, weight and rule is fitted or chosen on ``design``, and
#: every figure reported from ``check``; ``all`` is the whole set.
SPLITS = ("design", "check", "all")


@dataclass(frozen=True)
class Question:
    """One labelled question: ``answerable`` False means the corpus cannot answer it."""

    qid: str
    question: str
    answers: List[str] = field(default_factory=list)
    answerable: bool = True
    relevant_doc_ids: List[str] = field(default_factory=list)
    split: Optional[str] = None
    evidence: Dict[str, List[int]] = field(default_factory=dict)


def read_jsonl(path: Path) -> Iterator[dict]:
    """The JSON objects of a JSON-lines file, one a line (blank lines skipped); a clear error names a bad line."""
    for _, row in numbered_rows(path):
        yield row


def numbered_rows(path: Path) -> Iterator[Tuple[str, dict]]:
    """``read_jsonl``'s objects, each with where it stands (``path:line``) for an error about its fields."""
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: a dataset folder holds corpus.jsonl and questions.jsonl")
    with path.open(encoding="utf-8") as handle:
        number = 0
        try:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path}:{number} is not valid JSON: {exc}") from exc
                if not isinstance(row, dict):
                    raise DatasetError(f"{path}:{number} is not a JSON object but {type(row).__name__}")
                yield f"{path}:{number}", row
        except UnicodeDecodeError as exc:
            raise DatasetError(f"{path}:{number + 1} is not UTF-8 text ({exc.reason})") from exc


def text_field(row: dict, where: str, *names: str) -> str:
    """The row's first non-empty text field of ``names`` (a number is read as its digits), or an error naming it."""
    for name in names:
        value = row.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if isinstance(value, str) and value.strip():
            return value
    wanted = " or ".join(f"'{n}'" for n in names)
    raise DatasetError(f"{where} has no {wanted} text (a non-empty string)")


def _texts(row: dict, where: str, name: str) -> List[str]:
    """A list field of texts (absent or null: empty); a bare string or a list of objects is refused, since a
    string would be read a character at a time (every answer "correct", every document "relevant")."""
    value = row.get(name) or []
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
        raise DatasetError(f"{where} has {name!r} {json.dumps(value)[:80]}: it must be a list of strings")
    return [str(v) for v in value]


def load_documents(folder: Path | str = SAMPLE_DIR, split: str = "all") -> List[Document]:
    """The corpus as LlamaIndex documents: ``doc_id`` as id and metadata (hidden from models), ``title`` shown.

    ``split`` ``design`` or ``check`` keeps the documents of that half (``Halves``), ``all`` every one."""
    halves = Halves.of(folder, split)
    documents: List[Document] = []
    seen: Dict[str, str] = {}
    for where, row in numbered_rows(Path(folder) / "corpus.jsonl"):
        doc_id = clean_text(text_field(row, where, "doc_id"))  # an id is stored as text too (PostgreSQL refuses NUL)
        if doc_id in seen:  # the later would replace the earlier in any index, and answers would cite the wrong one
            raise DatasetError(f"{where} repeats doc_id {doc_id!r} of {seen[doc_id]}: each document needs its own id")
        seen[doc_id] = where
        text = row.get("text")
        if not isinstance(text, str):
            raise DatasetError(f"{where} has no 'text' string (document {doc_id!r})")
        if not halves.keeps_document(doc_id):
            continue
        metadata = {"doc_id": doc_id}
        if row.get("title"):
            metadata["title"] = clean_text(str(row["title"]))
        documents.append(
            Document(
                text=clean_text(text),
                id_=doc_id,
                metadata=metadata,
                excluded_embed_metadata_keys=["doc_id"],
                excluded_llm_metadata_keys=["doc_id"],
            )
        )
    return documents


def load_questions(folder: Path | str = SAMPLE_DIR, split: str = "all") -> List[Question]:
    """The labelled questions (SciFact's ``claim`` is read as the question); a repeated ``qid`` is refused.

    ``split`` ``design`` or ``check`` keeps the questions of that half (``Halves``), ``all`` every one."""
    questions = _all_questions(Path(folder))
    if split == "all":
        return questions
    halves = Halves.of_questions(questions, split)
    return [q for q in questions if halves.keeps_question(q)]


def _all_questions(folder: Path) -> List[Question]:
    """Every question of ``folder``, checked."""
    questions = [
        Question(
            qid=text_field(row, where, "qid"),
            question=text_field(row, where, "question", "claim"),
            answers=_texts(row, where, "answers"),
            answerable=bool(row.get("answerable", True)),
            relevant_doc_ids=_texts(row, where, "relevant_doc_ids"),
            split=row.get("split"),
            evidence={str(doc): list(e.get("sentences", [])) for doc, e in (row.get("evidence") or {}).items()},
        )
        for where, row in numbered_rows(Path(folder) / "questions.jsonl")
    ]
    repeated = sorted(q for q, n in Counter(q.qid for q in questions).items() if n > 1)
    if repeated:
        raise DatasetError(f"{Path(folder) / 'questions.jsonl'} repeats qid {', '.join(map(repr, repeated[:5]))}")
    return questions


def half_of(key: str) -> str:
    """The half a key falls in, ``design`` or ``check``: a hash, the same on every machine and in every run."""
    return SPLITS[hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[0] & 1]


@dataclass(frozen=True)
class Halves:
    """A question set cut in two by document, so that a question and its passages are always on the same side.

    Documents that some question names together (``relevant_doc_ids``) form one group, and a group falls in the
    half of its smallest ``doc_id`` (``half_of``); a document no question names falls by its own id, and a question
    that names no document (a claim with no evidence) by its ``qid``. Fitting on ``design`` and reporting ``check``
    shows what a threshold, weight or rule learned from the rows it was chosen on.
    """

    split: str
    groups: Dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, folder: Path | str, split: str) -> Halves:
        """The halves of the question set in ``folder`` (nothing is read for ``all``)."""
        path = Path(folder) / "questions.jsonl"
        return cls.of_questions(_all_questions(Path(folder)) if split != "all" and path.exists() else [], split)

    @classmethod
    def of_questions(cls, questions: List[Question], split: str) -> Halves:
        """The halves that ``questions`` make of their documents."""
        if split not in SPLITS:
            raise DatasetError(f"unknown split {split!r}: choose {', '.join(SPLITS)}")
        parent: Dict[str, str] = {}

        def root(doc: str) -> str:
            while parent.setdefault(doc, doc) != doc:
                parent[doc] = parent[parent[doc]]
                doc = parent[doc]
            return doc

        for question in questions:
            for doc in question.relevant_doc_ids[1:]:
                first, other = root(question.relevant_doc_ids[0]), root(doc)
                if first != other:
                    parent[max(first, other)] = min(first, other)
        return cls(split, {doc: root(doc) for doc in list(parent)})

    def half_of_document(self, doc_id: str) -> str:
        """The half ``doc_id`` falls in, with its group."""
        return half_of(self.groups.get(doc_id, doc_id))

    def keeps_document(self, doc_id: str) -> bool:
        """Whether ``doc_id`` belongs to this split."""
        return self.split == "all" or self.half_of_document(doc_id) == self.split

    def keeps_question(self, question: Question) -> bool:
        """Whether ``question`` belongs to this split: with its documents, or by its ``qid`` when it names none."""
        if self.split == "all":
            return True
        if question.relevant_doc_ids:
            return self.half_of_document(question.relevant_doc_ids[0]) == self.split
        return half_of(f"question:{question.qid}") == self.split


def normalise_text(text: str) -> str:
    """Lower case, punctuation to spaces, whitespace collapsed: for matching answers and sentences in text."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def words_in(needle: str, haystack: str) -> bool:
    """Whether ``needle`` stands in ``haystack`` as whole words, both ``normalise_text``'d ("2 1" is not in
    "q2 1 9", nor "19" in "in 1998"); False for an empty needle."""
    return bool(needle) and f" {needle} " in f" {haystack} "


def content_hash(*paths: Path) -> str:
    """A short hash of files' content, so caches and resumed runs follow the data, not its location."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]
