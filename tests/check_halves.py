"""The check halves of the shared development sets, read by tests that measure a heuristic or a packaged model
against a baseline on real questions (never the design halves, on which they were chosen)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from llama_index_crag.datasets import Question, load_documents, load_questions, read_jsonl

DATASETS = Path(__file__).resolve().parent.parent.parent / "shared" / "datasets"


def dataset(name: str) -> Path:
    """The folder of a shared set; a test that needs it fails where the sets are not beside the project (they are
    in CI, and a skip would hide the measurement)."""
    folder = DATASETS / name
    if not (folder / "questions.jsonl").exists():
        pytest.fail(f"{folder} is not here: clone the project beside the shared development sets (../shared)")
    return folder


@cache
def check_half(name: str) -> Tuple[List[Question], Dict[str, str]]:
    """The check half's questions and its documents' texts by ``doc_id``."""
    folder = dataset(name)
    documents = {d.doc_id: d.text for d in load_documents(folder, "check")}
    return load_questions(folder, "check"), documents


@cache
def scifact_sentences() -> Dict[str, List[str]]:
    """SciFact's abstracts as their sentences, by ``doc_id`` (the units its rationales are numbered in)."""
    return {str(r["doc_id"]): list(r["sentences"]) for r in read_jsonl(dataset("scifact") / "corpus.jsonl")}
