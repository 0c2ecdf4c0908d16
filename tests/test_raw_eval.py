"""``llama-crag eval-docs``: raw documents ingested as a user would, every question asked, and the answers scored
right, wrong or abstained by the rules of a raw-document set (a compound question needs every answer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from llama_index.core.base.response.schema import Response

from llama_index_crag.cli import main
from llama_index_crag.datasets import Halves, half_of
from llama_index_crag.errors import DatasetError
from llama_index_crag.evaluation.raw_docs import (
    ABSTAINED,
    CRAG,
    PLAIN_TOP,
    RIGHT,
    WRONG,
    DocEvalConfig,
    DocQuestion,
    holds,
    load_doc_questions,
    outcome,
    run_doc_evaluation,
    split_set,
)

DOCS = {
    "memory.html": "<html><head><title>Memory</title><script>var nav = 1;</script></head><body><nav>Home | Up</nav>"
    "<h1>Resource consumption</h1><p>work_mem sets the base maximum amount of memory to be used by a query "
    "operation. The default value is four megabytes (4MB).</p><p>maintenance_work_mem defaults to 64 "
    "megabytes (64MB).</p></body></html>",
    "vacuum.md": "# Autovacuum\n\nThe autovacuum launcher wakes every 60 seconds by default "
    "(autovacuum_naptime). It starts at most three workers at a time.\n\nVACUUM FULL takes an ACCESS "
    "EXCLUSIVE lock on the table.\n",
    "auth.txt": "Client authentication is controlled by pg_hba.conf. The reject method refuses the connection "
    "unconditionally. The scram-sha-256 method performs SCRAM-SHA-256 authentication.\n",
}

#: (qid, kind, question, answers, source, what the scripted engine says: None abstains).
QUESTIONS: List[Tuple[str, str, str, List[str], str, Any]] = [
    ("a1", "answerable", "What is the default work_mem?", ["4MB", "four megabytes"], "memory.html", "FOUR   megabytes"),
    ("a2", "answerable", "How often does autovacuum wake?", ["60 seconds"], "vacuum.md", "every 60\nseconds"),
    ("a3", "answerable", "What lock does VACUUM FULL take?", ["ACCESS EXCLUSIVE"], "vacuum.md", "a SHARE lock"),
    ("a4", "answerable", "Which file controls client authentication?", ["pg_hba.conf"], "auth.txt", None),
    ("c1", "compound", "Default work_mem and maintenance_work_mem?", ["4MB", "64MB"], "memory.html", "4MB and 64mb"),
    (
        "c2",
        "compound",
        "Naptime and auth method that refuses?",
        ["60 seconds", "reject"],
        "vacuum.md || auth.txt",
        "60 seconds",
    ),  # noqa: E501
    (
        "c3",
        "compound",
        "VACUUM FULL lock and scram method?",
        ["ACCESS EXCLUSIVE", "scram-sha-256"],
        "vacuum.md || auth.txt",
        "scram-sha-256",
    ),  # noqa: E501
    ("c4", "compound", "Workers and work_mem?", ["three", "4MB"], "vacuum.md || memory.html", None),
    ("n1", "near_miss", "What is the default of autovacuum_max_workers in release 18?", [], "", None),
    ("n2", "near_miss", "Which method uses Kerberos tickets?", [], "", None),
    ("n3", "near_miss", "What is the default temp_buffers?", [], "", None),
    ("n4", "near_miss", "How often does the stats collector write?", [], "", "every 60 seconds"),
    ("o1", "off_topic", "What is the highest mountain in Japan?", [], "", None),
    ("o2", "off_topic", "Who wrote Hamlet?", [], "", None),
    ("o3", "off_topic", "What is the boiling point of water?", [], "", None),
    ("o4", "off_topic", "How many legs does a spider have?", [], "", None),
]


def _write_set(root: Path) -> Path:
    (root / "docs").mkdir(parents=True)
    for name, text in DOCS.items():
        (root / "docs" / name).write_text(text, encoding="utf-8")
    rows = [
        {"qid": q, "question": text, "answerable": bool(answers), "answers": answers, "source": source, "kind": kind}
        for q, kind, text, answers, source, _ in QUESTIONS
    ]
    (root / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return root


class _ScriptedEngine:
    """Answers each question as ``QUESTIONS`` scripts it (None: abstains), as the engine's response would."""

    def __init__(self) -> None:
        self.said = {text: said for _, _, text, _, _, said in QUESTIONS}

    def query(self, question: str) -> Response:
        said = self.said[question]
        trace: Dict[str, Any] = {
            "abstained": said is None,
            "action": "incorrect" if said is None else "correct",
            "warnings": [],
        }
        return Response(response="I don't know." if said is None else said, metadata={"crag": trace})


@pytest.fixture()
def dataset(tmp_path: Path) -> Path:
    return _write_set(tmp_path / "set")


def _question(kind: str, answers: Tuple[str, ...] = ()) -> DocQuestion:
    return DocQuestion("q", "?", kind, bool(answers), answers)


def test_an_answer_is_right_with_one_answer_found_case_and_whitespace_aside() -> None:
    assert holds("The default is FOUR\n  Megabytes.", ["4MB", "four megabytes"])
    assert not holds("The default is 4 MB.", ["4MB"])
    assert not holds("anything", [])
    answerable = _question("answerable", ("4MB", "four megabytes"))
    assert outcome(answerable, "it is 4mb", abstained=False) == RIGHT
    assert outcome(answerable, "it is 8MB", abstained=False) == WRONG
    assert outcome(answerable, "", abstained=True) == ABSTAINED


def test_a_compound_question_needs_every_answer() -> None:
    compound = _question("compound", ("plain", "pg_restore"))
    assert outcome(compound, "plain text, restored with pg_restore", abstained=False) == RIGHT
    assert outcome(compound, "restored with pg_restore", abstained=False) == WRONG
    assert outcome(compound, "", abstained=True) == ABSTAINED
    # The same answers on an ordinary question: one is enough.
    assert outcome(_question("answerable", ("plain", "pg_restore")), "pg_restore", abstained=False) == RIGHT


def test_an_unanswerable_question_is_right_only_when_abstained_on() -> None:
    for kind in ("near_miss", "off_topic"):
        assert outcome(_question(kind), "", abstained=True) == RIGHT
        assert outcome(_question(kind), "Mount Fuji", abstained=False) == WRONG


def test_questions_are_read_with_their_sources_and_refused_when_they_cannot_be_scored(dataset: Path) -> None:
    questions = {q.qid: q for q in load_doc_questions(dataset / "questions.jsonl")}
    assert questions["c2"].sources == ("vacuum.md", "auth.txt") and questions["c2"].needs_every_answer
    assert questions["o1"].sources == () and not questions["o1"].answerable
    bad = dataset / "bad.jsonl"
    bad.write_text(json.dumps({"qid": "x", "question": "?", "answerable": True, "answers": []}) + "\n")
    with pytest.raises(DatasetError, match="no answers"):
        load_doc_questions(bad)


def test_the_halves_cut_by_source_page_keep_a_compound_questions_pages_together(dataset: Path) -> None:
    questions = load_doc_questions(dataset / "questions.jsonl")
    halves = {s: split_set(questions, sorted(DOCS), s) for s in ("design", "check")}
    for kept, docs in halves.values():
        for question in kept:  # a question's pages are in the index of its half
            assert set(question.sources) <= set(docs)
    design, check = halves["design"], halves["check"]
    assert sorted(q.qid for q in design[0] + check[0]) == sorted(q[0] for q in QUESTIONS)
    assert sorted(design[1] + check[1]) == sorted(DOCS)
    # A question with no source falls by its qid, as Halves puts a claim without evidence.
    assert {q.qid for q in check[0] if not q.sources} == {
        q[0] for q in QUESTIONS if not q[4] and half_of(f"question:{q[0]}") == "check"
    }
    # The pages the compound questions name form one group here, so every page falls in one half.
    groups = Halves.of_questions([q.as_question() for q in questions], "check").groups
    assert len({groups[d] for d in DOCS}) == 1


def test_scored_end_to_end_over_an_ingested_folder(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("llama_index_crag.core.persisted.load_engine", lambda loaded, llm: _ScriptedEngine())
    config = DocEvalConfig(dataset / "docs", dataset / "questions.jsonl", tmp_path / "out", progress=False)
    results = run_doc_evaluation(config)
    crag: Dict[str, Any] = results["figures"][CRAG]
    counts = {k: (v[RIGHT], v[WRONG], v[ABSTAINED]) for k, v in crag["kinds"].items()}
    assert counts == {"answerable": (2, 1, 1), "compound": (1, 2, 1), "near_miss": (3, 1, 0), "off_topic": (4, 0, 0)}
    assert (crag[RIGHT], crag[WRONG], crag[ABSTAINED]) == (10, 4, 2)
    assert crag["truthfulness"] == pytest.approx(6 / 16)
    assert crag["truthfulness_pm"] > 0
    # Plain quotes its top passage and never abstains: every unanswerable question is wrong.
    plain = results["figures"][PLAIN_TOP]
    assert plain[ABSTAINED] == 0 and plain["kinds"]["off_topic"][WRONG] == 4
    meta = results["meta"]
    assert meta["documents"] == 3 and meta["embeddings_made"] > 0 and meta["peak_memory_mb"]["end"] > 0
    assert (tmp_path / "out" / "report.md").read_text().count("| compound (4) | 1 / 2 / 1 |") == 1
    # The index folder is reused: an unchanged folder embeds nothing the second time.
    again = run_doc_evaluation(config)
    assert again["meta"]["index_reused"] and again["meta"]["embeddings_made"] == 0
    assert again["figures"][CRAG] == crag


def test_the_command_runs_the_real_engine(dataset: Path, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "out"
    code = main(["eval-docs", "--dataset", str(dataset), "--split", "all", "--out", str(out), "--no-progress"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    crag = results["figures"][CRAG]
    assert crag[RIGHT] + crag[WRONG] + crag[ABSTAINED] == len(QUESTIONS)
    assert results["figures"]["answer_in_plain_top_k"]["answerable"] == 8
    assert "truthfulness" in capsys.readouterr().out
    assert main(["eval-docs", "--out", str(out)]) == 2  # no set named
    assert "--dataset DIR" in capsys.readouterr().err
    assert main(["eval", "--dataset", str(dataset), "--out", str(out)]) == 2  # raw documents, not passages
    assert "eval-docs" in capsys.readouterr().err
