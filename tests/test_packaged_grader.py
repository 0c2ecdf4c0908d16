"""The reader shipped in the package: it loads offline, reads, is refused when damaged, and never stops the engine."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from llama_index.core.llms import MockLLM
from llama_index.core.schema import TextNode

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.scorers.evidence import EvidenceScorer
from llama_index_crag.scorers.reader import GraderLoadError, ReaderScorer, packaged_grader_path
from llama_index_crag.scorers.reader_model import GRADER_FILE, WEIGHTS_FILE, file_sha256
from llama_index_crag.scorers.registry import default_scorer

PACKAGED = packaged_grader_path()


@pytest.fixture(scope="module")
def packaged() -> ReaderScorer:
    return ReaderScorer(PACKAGED)


def test_the_packaged_grader_is_small_checksummed_and_carries_its_licence() -> None:
    info = json.loads((PACKAGED / GRADER_FILE).read_text())
    weights = PACKAGED / WEIGHTS_FILE
    assert weights.stat().st_size < 25_000_000
    assert info["weights_sha256"] == file_sha256(weights)
    assert info["weights_dtype"] == "float16" and info["kind"] == "reader"
    # Fitted on labelled data, not the untrained defaults: the stacked model and its thresholds travel with it.
    assert len(info["stack"]["weights"]) == len(info["stack"]["features"]) + 1
    assert 0.0 < info["thresholds"]["lower"] <= info["thresholds"]["upper"] < 1.0
    notice = (PACKAGED / "NOTICE").read_text()
    assert "CC BY-SA 4.0" in notice and "SQuAD 2.0" in notice and "HotpotQA" in notice


def test_the_packaged_grader_loads_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    scorer = ReaderScorer(PACKAGED)
    assert scorer.name.startswith("reader:grader#") and scorer.default_thresholds is not None
    assert scorer.weights[list(scorer.feature_names).index("reader")] > 0.0


# Each question with a passage that answers it and an on-topic passage of the same subject that does not.
READING = [
    (
        "How long is the Kestrel Bridge in Farrow?",
        "The Kestrel Bridge in Farrow spans 312 metres across the Lune estuary.",
        "The Kestrel Bridge in Farrow opened in 1887 and was repainted in 1990.",
    ),
    (
        "Who designed the Halden observatory?",
        "The Halden observatory was designed by the architect Maria Lindqvist in 1931.",
        "The Halden observatory sits on a hill above the town and is open to visitors in summer.",
    ),
    (
        "How many people live in Tarrow?",
        "Tarrow is a market town with a population of about 14,000 people.",
        "Tarrow is a market town on the river Esk, known for its Saturday fair.",
    ),
    (
        "When did the Vell Blue cheese win its first award?",
        "Vell Blue won its first award, a gold medal at the Brussels fair, in 1958.",
        "Vell Blue is a soft blue cheese aged in limestone caves near the village of Vell.",
    ),
]


@pytest.mark.parametrize("question,answers,on_topic", READING)
def test_the_packaged_grader_prefers_the_passage_that_answers(
    packaged: ReaderScorer, question: str, answers: str, on_topic: str
) -> None:
    # The grade a user gets is the stacked one (reader logit, answer type, evidence); the reader's logit alone
    # reads each case too (the top-three-layer reader before it missed the Kestrel length).
    answer, noise = packaged.score_texts(question, [answers, on_topic])
    assert answer > noise
    read_answer, read_noise = packaged.read(question, [answers, on_topic])
    assert read_answer > read_noise


def _damaged(tmp_path: Path) -> Path:
    copy = tmp_path / "grader"
    shutil.copytree(PACKAGED, copy)
    data = bytearray((copy / WEIGHTS_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the weights' body: still parses, no longer the shipped file
    (copy / WEIGHTS_FILE).write_bytes(bytes(data))
    return copy


def test_a_damaged_grader_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(GraderLoadError, match="damaged"):
        ReaderScorer(_damaged(tmp_path))
    truncated = tmp_path / "truncated"
    shutil.copytree(PACKAGED, truncated)
    (truncated / WEIGHTS_FILE).write_bytes((PACKAGED / WEIGHTS_FILE).read_bytes()[:1000])
    info = json.loads((truncated / GRADER_FILE).read_text())
    del info["weights_sha256"]  # without the checksum the safetensors reader itself must refuse the file
    (truncated / GRADER_FILE).write_text(json.dumps(info))
    with pytest.raises(GraderLoadError, match="cannot be read as safetensors"):
        ReaderScorer(truncated)
    (truncated / GRADER_FILE).write_text("{not json")
    with pytest.raises(GraderLoadError, match="not valid JSON"):
        ReaderScorer(truncated)


def test_weights_damaged_inside_their_tensors_are_refused_not_scored_as_zero(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "grader"
    shutil.copytree(PACKAGED, copy)
    tensors = load_file(str(copy / WEIGHTS_FILE))
    name = sorted(tensors)[0]
    tensors[name].view(-1)[:1000] = float("nan")  # what flipped exponent bits make of a float; the header stays valid
    save_file(tensors, str(copy / WEIGHTS_FILE))
    info = json.loads((copy / GRADER_FILE).read_text())
    del info["weights_sha256"]  # a grader straight from train-grader records none
    (copy / GRADER_FILE).write_text(json.dumps(info))
    with pytest.raises(GraderLoadError, match="not finite numbers: the file is damaged"):
        ReaderScorer(copy)


def test_a_damaged_packaged_grader_falls_back_to_the_evidence_scorer_and_every_trace_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    damaged = _damaged(tmp_path)
    monkeypatch.setattr("llama_index_crag.scorers.reader.packaged_grader_path", lambda: damaged)
    monkeypatch.delenv("CRAG_GRADER", raising=False)
    scorer = default_scorer(grader="packaged")
    assert type(scorer) is EvidenceScorer
    assert scorer.warnings and "could not be loaded" in scorer.warnings[0] and "damaged" in scorer.warnings[0]
    nodes = [TextNode(text="Vell Blue is aged for nine weeks in limestone caves.", id_="a")]
    engine = CorrectiveQueryEngine.from_defaults(nodes=nodes, llm=MockLLM(), scorer=scorer)
    trace = engine.query("How long is Vell Blue aged?").metadata["crag"]
    assert trace["warnings"] == list(scorer.warnings)
    # A grader named on purpose is not replaced silently: its error reaches the caller.
    monkeypatch.setenv("CRAG_GRADER", str(damaged))
    with pytest.raises(GraderLoadError):
        default_scorer()


def test_crag_grader_chooses_the_grader(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRAG_GRADER", "evidence")
    assert type(default_scorer()) is EvidenceScorer
    monkeypatch.setenv("CRAG_GRADER", "packaged")
    assert default_scorer().name.startswith("reader:grader#")


@pytest.mark.parametrize(
    ("question", "answers", "does_not"),
    [
        ("What does one share cost?", 1, 2),
        ("How much does membership cost?", 1, 0),
        ("Who chairs the cooperative?", 2, 1),
        ("How long is Vell Blue aged?", 3, 4),
    ],
)
def test_the_packaged_grader_passes_the_trained_readers_paraphrase_cases(
    packaged: ReaderScorer, question: str, answers: int, does_not: int
) -> None:
    from tests.test_reader import COOPERATIVE

    scores = packaged.score_texts(question, [COOPERATIVE[answers], COOPERATIVE[does_not]])
    assert scores[0] > scores[1], scores


def test_the_packaged_grader_explains_its_stacked_score(packaged: ReaderScorer) -> None:
    # The reader's column is explained beside the evidence features, and what turns a question round is named.
    question, passage = "Who did not design the Halden observatory?", READING[1][1]
    explained = packaged.explain(question, [passage])[0]
    assert list(explained["features"]) == [*packaged.feature_names]
    assert explained["features"]["reader"] == pytest.approx(float(packaged.read(question, [passage])[0]), abs=1e-3)
    logit = sum(explained["contributions"].values()) + explained["bias"]
    assert explained["score"] == pytest.approx(1.0 / (1.0 + math.exp(-logit)), abs=1e-3)
    assert explained["turned_round"] == "the question is negated and its passage states it"


def test_a_calibration_is_refused_for_another_grader_in_a_folder_of_the_same_name(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from llama_index_crag.errors import ConfigError
    from llama_index_crag.settings_sources import read_calibration

    mine, theirs = tmp_path / "mine" / "grader", tmp_path / "theirs" / "grader"
    shutil.copytree(PACKAGED, mine)
    shutil.copytree(PACKAGED, theirs)
    tensors = load_file(theirs / WEIGHTS_FILE)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] * 1.01  # retrained: the same shapes, other values
    save_file(tensors, theirs / WEIGHTS_FILE)
    info = json.loads((theirs / GRADER_FILE).read_text())
    info.pop("weights_sha256")  # as train-grader writes it, before pack-grader
    (theirs / GRADER_FILE).write_text(json.dumps(info))
    fitted_for, served_with = ReaderScorer(mine).name, ReaderScorer(theirs).name
    assert fitted_for != served_with and fitted_for.startswith("reader:grader#")
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"version": 1, "scorer": fitted_for, "thresholds": {"upper": 0.9, "lower": 0.4}}))
    assert read_calibration(calibration, ReaderScorer(tmp_path / "mine" / "grader").name)["scorer"] == fitted_for
    with pytest.raises(ConfigError, match="calibrate again for this scorer"):
        read_calibration(calibration, served_with)
