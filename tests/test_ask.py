"""``llama-crag ask`` over a small ingested folder of real files: questions as arguments or on stdin, plain and
``--json`` output, and ``--filters`` bounding what it reads."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from llama_index_crag.cli import main
from llama_index_crag.stores.folder import ingest

from .test_readers import ANSWER, QUESTION, write_mixed_folder

OFF_TOPIC = "Who wrote the novel Moby-Dick?"
HOURS = "When does the Ostmoor shop open?"


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, embed_model: Any) -> str:
    root = tmp_path_factory.mktemp("ask")
    docs = write_mixed_folder(root / "docs")
    (docs / "handbook.docx.meta.json").write_text(json.dumps({"tenant": "globex"}))
    (docs / "opening-hours.html.meta.json").write_text(json.dumps({"tenant": "acme"}))
    ingest(docs, root / "index", embed_model=embed_model)
    return str(root / "index")


def _ask(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["ask", "--llm", "none", *args])
    return code, capsys.readouterr().out


def _rows(out: str) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines()]


def test_questions_as_arguments_are_answered_with_action_and_sources(
    index: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _ask(capsys, "--index", index, QUESTION, OFF_TOPIC)
    assert code == 0
    first, second = out.strip().split("\n\n")
    assert first.startswith(f"Q: {QUESTION}\n  action: ") and "  answered\n" in first
    assert ANSWER in " ".join(first.split())
    assert first.splitlines()[-1].startswith("  sources: handbook.docx (Cellar Handbook)")
    assert second.splitlines()[:2] == [f"Q: {OFF_TOPIC}", "  action: incorrect  ABSTAINED"]
    assert "I don't know" in second and second.splitlines()[-1] == "  sources: -"


def test_questions_one_a_line_on_stdin_in_json(
    index: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{QUESTION}\n\n   \n{OFF_TOPIC}\n"))
    code, out = _ask(capsys, "--index", index, "--json")
    assert code == 0
    answered, abstained = _rows(out)  # blank lines are no questions
    assert set(answered) == {"question", "answer", "abstained", "action", "sources"}
    assert (
        answered["question"] == QUESTION
        and not answered["abstained"]
        and ANSWER in " ".join(answered["answer"].split())
    )
    assert answered["action"] in ("correct", "ambiguous")
    top = answered["sources"][0]
    assert (top["doc_id"], top["title"]) == ("handbook.docx", "Cellar Handbook") and 0 < top["score"] <= 1
    assert (abstained["question"], abstained["abstained"], abstained["action"], abstained["sources"]) == (
        OFF_TOPIC,
        True,
        "incorrect",
        [],
    )


def test_filters_bound_what_the_answer_may_come_from(index: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _ask(capsys, "--index", index, "--json", "--filters", '{"tenant": "acme"}', QUESTION, HOURS)
    assert code == 0
    other_tenant, own = _rows(out)
    assert all(s["doc_id"] != "handbook.docx" for s in other_tenant["sources"])  # globex's handbook is out of scope
    assert ANSWER not in other_tenant["answer"]
    assert not own["abstained"] and "opens at eight" in own["answer"]
    assert {s["doc_id"] for s in own["sources"]} == {"opening-hours.html"}
    code, out = _ask(capsys, "--index", index, "--json", "--filters", '{"tenant": ["globex", "acme"]}', QUESTION)
    (row,) = _rows(out)
    assert code == 0 and ANSWER in " ".join(row["answer"].split())


def test_what_ask_refuses_is_one_line_and_a_failed_question_is_a_row(
    index: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["ask", "--llm", "none", QUESTION]) == 2
    assert "ask needs either --index INDEX_DIR or --store" in capsys.readouterr().err
    assert main(["ask", "--llm", "none", "--index", str(tmp_path), QUESTION]) == 2
    assert "is not an index folder" in capsys.readouterr().err
    for bad, said in (('["acme"]', "a JSON object is needed"), ("{tenant: acme}", "not JSON"), ("{}", "empty")):
        with pytest.raises(SystemExit) as exited:
            main(["ask", "--index", index, "--filters", bad, QUESTION])
        assert exited.value.code == 2 and said in capsys.readouterr().err
    code, out = _ask(capsys, "--index", index, "--json", "x" * 9000, HOURS)
    too_long, fine = _rows(out)
    assert code == 1 and set(too_long) == {"question", "error"} and "opens at eight" in fine["answer"]


def test_auto_quotes_when_no_ollama_answers(index: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["ask", "--index", index, "--ollama-url", "http://127.0.0.1:9", HOURS])
    captured = capsys.readouterr()
    assert code == 0 and "no Ollama model" in captured.err and "answers quote the graded passages" in captured.err
    assert "Quoted from the documents" in captured.out
