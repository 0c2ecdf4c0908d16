"""Label-free calibration: questions made from the corpus's own sentences, with the real spaCy pipeline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llama_index_crag.calibration.fit import IN_CORPUS, OUT_OF_CORPUS, UNANSWERABLE
from llama_index_crag.calibration.synthetic import WH_WORDS, load_spacy, synthetic_batches, synthetic_questions
from llama_index_crag.cli import main
from llama_index_crag.datasets import SAMPLE_DIR, load_documents

from .conftest import assert_engine_loads_calibration


@pytest.fixture(scope="module")
def nlp() -> Any:
    return load_spacy()


def test_questions_ask_for_an_entity_their_source_holds_and_the_redacted_passage_lacks(nlp: Any) -> None:
    made = synthetic_questions(SAMPLE_DIR, 25, nlp=nlp, progress=False)
    texts = {d.doc_id: d.text for d in load_documents()}
    assert len(made) == 25
    assert len({m.question.relevant_doc_ids[0] for m in made}) == 25  # one question per document
    for item in made:
        answer = item.question.answers[0]
        source = texts[item.question.relevant_doc_ids[0]]
        assert answer in item.sentence and item.sentence in source
        assert answer.lower() not in item.question.question.lower()
        assert item.question.question.split()[0] in {w.split()[0] for w in WH_WORDS.values()}
        assert item.redacted and answer.lower() not in item.redacted.lower()
        assert set(item.redacted.split()) <= set(source.split())


def test_questions_are_reproducible_from_the_seed(nlp: Any) -> None:
    first = [m.question.question for m in synthetic_questions(SAMPLE_DIR, 10, seed=3, nlp=nlp, progress=False)]
    again = [m.question.question for m in synthetic_questions(SAMPLE_DIR, 10, seed=3, nlp=nlp, progress=False)]
    other = [m.question.question for m in synthetic_questions(SAMPLE_DIR, 10, seed=4, nlp=nlp, progress=False)]
    assert first == again and first != other


def test_batches_hold_the_three_cases_the_grader_must_tell_apart(nlp: Any) -> None:
    labelled = synthetic_batches(SAMPLE_DIR, count=20, nlp=nlp, progress=False)
    kinds = [b.kind for b in labelled.batches]
    assert kinds.count(OUT_OF_CORPUS) == kinds.count(UNANSWERABLE) == 20
    assert kinds.count(IN_CORPUS) >= 10
    for batch in labelled.batches:
        source = batch.question.relevant_doc_ids[0]
        assert len(batch.texts) == len(batch.doc_ids) == len(batch.gold) == 5
        if batch.kind == IN_CORPUS:
            assert batch.gold == [d == source for d in batch.doc_ids] and any(batch.gold)
        elif batch.kind == OUT_OF_CORPUS:
            assert source not in batch.doc_ids and not any(batch.gold)
        else:  # the source passage is there, without the sentences that hold the answer
            assert batch.doc_ids[0] == source and not any(batch.gold)
            assert batch.question.answers[0].lower() not in batch.texts[0].lower()


def test_calibrate_on_the_corpus_alone_writes_a_file_the_engine_loads(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "synthetic.json"
    args = ["calibrate", "--dataset", str(SAMPLE_DIR), "--synthetic", "40", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert "synthetic questions" in data["dataset"]
    assert all(qid.startswith("synthetic-") for qid in data["fitted_qids"])
    assert data["samples"]["out-of-corpus"] == data["samples"]["unanswerable"] == 40
    assert 0.0 <= data["thresholds"]["lower"] <= data["thresholds"]["upper"] <= 1.0
    assert "strip_threshold" in data["thresholds"]
    assert "Knowledge strips" in capsys.readouterr().out
    assert_engine_loads_calibration(out)
    # Every real question of the set is held out from a synthetic calibration: the report scores them all.
    report_dir = tmp_path / "report"
    args = ["grade-report", "--dataset", str(SAMPLE_DIR), "--scorers", "evidence,bi-encoder", "--calibration", str(out)]
    assert main([*args, "--out", str(report_dir), "--no-progress"]) == 0
    report = json.loads((report_dir / "grade-report.json").read_text())
    # The bi-encoder's row is cross-validated: the file was fitted for the evidence scorer alone.
    protocols = {r["scorer"]: r["protocol"] for r in report["results"]}
    assert protocols.pop(data["scorer"]) == "calibration file, held-out rows"
    assert set(protocols.values()) == {"5-fold cross-validation"}
    assert report["protocol"].endswith("; 5-fold cross-validation for the others")
    calibrated = next(r for r in report["results"] if r["scorer"] == data["scorer"])
    assert calibrated["rows"]["out-of-corpus"]["batches"] > 40
    other = tmp_path / "other.json"  # fitted for a scorer that is not measured: said, not passed off as used
    other.write_text(json.dumps({**data, "scorer": "cross-encoder:someone-else"}))
    args = ["grade-report", "--dataset", str(SAMPLE_DIR), "--scorers", "evidence", "--calibration", str(other)]
    assert main([*args, "--out", str(report_dir), "--no-progress", "--folds", "2"]) == 0
    report = json.loads((report_dir / "grade-report.json").read_text())
    assert {r["protocol"] for r in report["results"]} == {"2-fold cross-validation"}
    unused = "the calibration file was fitted for 'cross-encoder:someone-else', which no row is"
    assert report["protocol"] == f"2-fold cross-validation ({unused})"


def test_a_corpus_that_names_nothing_gives_a_clear_error(tmp_path: Path, nlp: Any) -> None:
    (tmp_path / "corpus.jsonl").write_text(
        json.dumps({"doc_id": "a", "text": "it is what it is. and so it goes on."}) + "\n"
    )
    with pytest.raises(ValueError, match="no question could be made"):
        synthetic_batches(tmp_path, count=5, nlp=nlp, progress=False)
