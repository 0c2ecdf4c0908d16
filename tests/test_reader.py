"""The reading grader: pairs made from a corpus, a real (short) training run on CPU, and the stacked scorer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from llama_index_crag.calibration.pairs import (
    ANSWER_REMOVED,
    ENTITY_SWAPPED,
    POSITIVE,
    SIBLING,
    PairSet,
    make_pairs,
)
from llama_index_crag.calibration.training import TrainingConfig, train_grader
from llama_index_crag.datasets import SAMPLE_DIR
from llama_index_crag.scorers.evidence import FEATURES
from llama_index_crag.scorers.reader import (
    GRADER_FILE,
    READER_FEATURES,
    GraderLoadError,
    ReaderScorer,
    load_reader,
    windows,
)
from llama_index_crag.scorers.reader_model import LORA_TARGETS, WEIGHTS_FILE
from llama_index_crag.scorers.reader_model import Reader as ReaderModel

# The module trains a reader once (60 real steps on CPU): on a loaded 2-core machine that alone can pass the suite's
# 300 s per-test limit, so this module gets more.
pytestmark = pytest.mark.timeout(1200)

COOPERATIVE = [
    "The Ostmoor Dairy Cooperative was founded in 1952 by eleven farming families.",
    "Members join the cooperative by buying one share, priced at 1,500 crowns.",
    "The cooperative is chaired by Ingrid Halvorsen, who was elected in 2021.",
    "Its creamery ages Vell Blue for nine weeks in limestone cellars.",
    "Milk is collected from member farms every morning before seven.",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample corpus plus a cooperative's page: the documents a user would train their grader on."""
    folder = tmp_path_factory.mktemp("corpus")
    lines = (SAMPLE_DIR / "corpus.jsonl").read_text().splitlines()
    lines.append(json.dumps({"doc_id": "coop", "text": " ".join(COOPERATIVE)}))
    (folder / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def pairs(corpus: Path) -> PairSet:
    # Seed 1 keeps the cooperative's page among the training documents (seed 0 holds it out).
    return make_pairs(corpus, count=1500, seed=1, progress=False)


def test_pairs_are_balanced_held_out_by_document_and_of_every_kind(pairs: PairSet) -> None:
    train_docs = {p.doc_id for p in pairs.train}
    held_docs = {p.doc_id for p in pairs.held_out}
    assert train_docs and held_docs and not train_docs & held_docs
    labels = [p.label for p in pairs.train]
    assert 0.25 <= sum(labels) / len(labels) <= 0.5
    kinds = pairs.counts()["train"]
    assert {POSITIVE, ANSWER_REMOVED, ENTITY_SWAPPED, SIBLING} <= set(kinds)
    assert all(p.label == (p.kind == POSITIVE) for p in pairs.train + pairs.held_out)


def test_questions_are_reworded_and_not_only_about_named_entities(pairs: PairSet) -> None:
    questions = [p for p in pairs.train if p.kind == POSITIVE]
    # A question never repeats a sentence of its passage word for word.
    assert not [p for p in questions if p.query.rstrip("?.").lower() in p.passage.lower()]
    starts = {p.query.split()[0] for p in questions}
    assert {"What", "Who", "When"} <= starts
    assert any(not p.query.endswith("?") for p in questions), "claims are made too"
    assert any(" not " in f" {p.query} " for p in make_pairs(SAMPLE_DIR, count=600, claims=1.0, progress=False).train)


def test_a_negative_lacks_what_it_was_made_without(pairs: PairSet) -> None:
    by_query: Dict[str, Any] = {}
    for p in pairs.train:
        by_query.setdefault(p.query, []).append(p)
    checked = 0
    for group in by_query.values():
        positive = next((p for p in group if p.kind == POSITIVE), None)
        removed = next((p for p in group if p.kind == ANSWER_REMOVED), None)
        if positive and removed:
            # The answer-removed window is the positive window less (at least) one sentence.
            assert removed.passage != positive.passage
            checked += 1
    assert checked > 100


def test_a_corpus_with_nothing_to_ask_is_refused(tmp_path: Path) -> None:
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"doc_id": "a", "text": "Hello."}) + "\n")
    with pytest.raises(ValueError, match="two sentences"):
        make_pairs(tmp_path, count=100, progress=False)


def test_pairs_of_one_label_are_refused_before_anything_is_written(pairs: PairSet, tmp_path: Path) -> None:
    positives = [p for p in pairs.train if p.label]
    with pytest.raises(ValueError, match="both positive and negative"):
        train_grader(PairSet(train=positives, held_out=pairs.held_out), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_windows_cover_a_long_passage_with_overlap() -> None:
    text = " ".join(f"w{i}" for i in range(200))
    parts = windows(text, words=80, stride=60)
    assert parts[0].split()[0] == "w0" and parts[-1].split()[-1] == "w199"
    assert all(len(p.split()) <= 80 for p in parts)
    assert windows("short text") == ["short text"]


@pytest.fixture(scope="module")
def grader(pairs: PairSet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reader trained for under a minute on the sample corpus (real training on CPU: 60 steps of 16 pairs)."""
    out = tmp_path_factory.mktemp("grader")
    # Bounded by its 60 steps; the time budget is only a guard, generous for a loaded machine.
    config = TrainingConfig(max_length=64, minutes=20, eval_every=20, eval_pairs=200, epochs=60 * 16 / len(pairs.train))
    train_grader(pairs, out, config=config, progress=False)
    return out


@pytest.mark.slow
def test_a_minute_of_training_raises_held_out_auroc_well_above_the_untrained_head(grader: Path) -> None:
    info = json.loads((grader / GRADER_FILE).read_text())
    untrained = info["history"][0]["held_out_auroc"]
    assert info["held_out_auroc"] >= untrained + 0.15, info["history"]
    assert abs(info["held_out_auroc_int8"] - info["held_out_auroc"]) < 0.05
    assert info["pairs"]["train"]["positive"] > 0 and info["base_fingerprint"]


@pytest.mark.slow
def test_training_resumes_from_its_checkpoint(pairs: PairSet, grader: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    shutil.copytree(grader, again)
    info = json.loads((again / GRADER_FILE).read_text())
    # A checkpoint written before the recipe options existed resumes as if they had their defaults.
    saved = torch.load(str(again / "checkpoint.pt"), weights_only=False)
    for newer in ("max_steps", "pooling", "lora_rank"):
        del saved["config"][newer]
    torch.save(saved, str(again / "checkpoint.pt"))
    # Bounded by its 60 steps; the time budget is only a guard, generous for a loaded machine.
    config = TrainingConfig(max_length=64, minutes=20, eval_every=20, eval_pairs=200, epochs=60 * 16 / len(pairs.train))
    resumed = train_grader(pairs, again, config=config, progress=False, log=lambda _: None)
    assert resumed["steps"] >= info["steps"] and resumed["history"][: len(info["history"])] == info["history"]
    # The saved weights deleted: the resumed run writes the checkpoint's, and says so.
    (again / WEIGHTS_FILE).unlink()
    said: List[str] = []
    train_grader(pairs, again, config=config, progress=False, log=said.append)
    assert (again / WEIGHTS_FILE).exists() and any("was missing" in line for line in said), said
    load_reader(again)
    with pytest.raises(ValueError, match="other settings"):
        train_grader(pairs, again, config=TrainingConfig(max_length=96, minutes=0.1), progress=False)


@pytest.mark.slow
def test_the_reader_scorer_stacks_the_reader_on_the_evidence_features(grader: Path) -> None:
    scorer = ReaderScorer(grader)
    question = "When did Harbor Analytics open its Toronto office?"
    texts = [
        "The Toronto office opened in January 2020 and hosts the North American customer support center.",
        "Employees travelling on business must book flights and hotels through the company travel portal.",
    ]
    rows = scorer.features(question, texts)
    assert rows.shape == (2, len(READER_FEATURES)) and READER_FEATURES[: len(FEATURES)] == FEATURES
    scores = scorer.score_texts(question, texts)
    assert scores[0] > scores[1] and scorer.reader_runs >= 2
    # A cascade whose evidence model settles every batch never runs the reader.
    scorer.settle_below, runs = 1.01, scorer.reader_runs
    assert scorer.score_texts(question, texts) and scorer.reader_runs == runs and scorer.settled == 1
    # The stacked model's state round-trips through a calibration file's scorer_state.
    state = scorer.state()
    other = ReaderScorer(grader).load_state(json.loads(json.dumps(state)))
    assert other.settle_below == 1.01 and np.allclose(other.weights, scorer.weights)


@pytest.mark.slow
def test_the_stacked_model_fits_its_cascade_from_labelled_rows(grader: Path) -> None:
    scorer = ReaderScorer(grader)
    rng = np.random.default_rng(0)
    labels = rng.random(600) < 0.3
    rows = rng.normal(size=(600, len(READER_FEATURES))) + labels[:, None] * 1.5
    scorer.fit(rows, labels)
    assert scorer.weights.shape == (len(READER_FEATURES) + 1,)
    assert scorer.evidence_weights.shape == (len(FEATURES) + 1,)
    first = 1 / (1 + np.exp(-(rows[:, : len(FEATURES)] @ scorer.evidence_weights[:-1] + scorer.evidence_weights[-1])))
    # Settling low drops at most 1% of the answering rows; settling high lets through at most 1% that do not answer.
    assert scorer.settle_below > 0.0 and (first[labels] < scorer.settle_below).mean() <= 0.01
    above = first >= scorer.settle_above
    assert scorer.settle_above > 1.0 or (~labels[above]).mean() <= 0.01


@pytest.mark.slow
def test_a_grader_trained_on_another_base_model_is_refused(grader: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(grader, copy)
    info = json.loads((copy / GRADER_FILE).read_text())
    info["base_fingerprint"] = "0" * 16
    (copy / GRADER_FILE).write_text(json.dumps(info))
    with pytest.raises(ValueError, match="trained on base model"):
        ReaderScorer(copy)
    with pytest.raises(GraderLoadError, match="not a grader directory"):
        ReaderScorer(tmp_path)


@pytest.mark.slow
def test_train_grader_writes_a_grader_directory_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llama_index_crag.cli import main

    out = tmp_path / "grader"
    args = ["train-grader", "--corpus", str(SAMPLE_DIR), "--out", str(out), "--pairs", "300", "--minutes", "0.05"]
    assert main([*args, "--max-length", "48", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "held out (other documents and questions)" in printed and f"CRAG_GRADER={out}" in printed
    info = json.loads((out / GRADER_FILE).read_text())
    assert info["stopped"].startswith("time budget") and (out / "reader.safetensors").exists()


def test_train_grader_stops_at_max_steps_with_cls_pooling_and_figures_by_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llama_index_crag.cli import main

    out = tmp_path / "grader"
    args = ["train-grader", "--corpus", str(SAMPLE_DIR), "--out", str(out), "--pairs", "300", "--minutes", "5"]
    assert main([*args, "--max-length", "48", "--max-steps", "2", "--pooling", "cls", "--no-progress"]) == 0
    assert "Held-out AUROC by source: corpus " in capsys.readouterr().out
    info = json.loads((out / GRADER_FILE).read_text())
    assert info["steps"] == 2 < info["total_steps"] and info["stopped"] == "step limit of 2 reached"
    assert set(info["held_out_auroc_by_source"]) == {"corpus"} and info["config"]["pooling"] == "cls"
    reader, _, _ = load_reader(out, quantize=False)
    assert reader.pooling == "cls"


def test_a_lora_adapter_is_saved_as_its_factors_and_a_plain_reader_adds_them(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    from llama_index_crag.calibration.packaging import pack_grader
    from llama_index_crag.cli import main

    out = tmp_path / "grader"
    args = ["train-grader", "--corpus", str(SAMPLE_DIR), "--out", str(out), "--pairs", "300", "--minutes", "5"]
    assert main([*args, "--max-length", "48", "--max-steps", "2", "--lora-rank", "4", "--no-progress"]) == 0
    info = json.loads((out / GRADER_FILE).read_text())
    assert info["config"]["learning_rate"] == 5e-4, "an adapter learns at LoRA's usual rate unless --lr says"
    saved = load_file(str(out / "reader.safetensors"))
    # Every layer is adapted (the lowest too); what is saved is the factors of rank 4 and the head, not the weights.
    assert set(saved) == set(info["trained_parameters"]) and "head.weight" in saved
    assert saved["encoder.encoder.layer.0.attention.self.query.lora_A.weight"].shape == (4, 384)
    assert saved["encoder.encoder.layer.5.output.dense.lora_B.weight"].shape == (384, 4)
    assert not any(n.endswith("query.weight") or "base_layer" in n for n in saved)
    assert (out / "reader.safetensors").stat().st_size < 1_000_000  # the six merged layers: 42 MB

    # A plain reader adds them to its weights exactly as peft merges them.
    reader, _, _ = load_reader(out, quantize=False)
    peft_model = get_peft_model(
        ReaderModel(reader.base).encoder, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS)
    )
    for name, weight in saved.items():
        if "lora_" in name:
            module = name.removeprefix("encoder.").replace(".lora_A.weight", "").replace(".lora_B.weight", "")
            factor = "lora_A" if ".lora_A." in name else "lora_B"
            getattr(peft_model.base_model.model.get_submodule(module), factor)["default"].weight.data.copy_(weight)
    merged = peft_model.merge_and_unload().state_dict()
    lowest = "encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(reader.encoder.state_dict()[lowest], ReaderModel(reader.base).encoder.state_dict()[lowest])
    for name, weight in reader.encoder.state_dict().items():
        assert torch.allclose(weight, merged[name], atol=1e-6), name

    # Packed, the adapter stays an adapter (float16) and reads as the trained one.
    packed = pack_grader(out, tmp_path / "packed")
    assert set(packed["trained_parameters"]) == set(saved)
    question = "Who chairs the cooperative?"
    shipped = ReaderScorer(tmp_path / "packed", quantize=False)
    trained = ReaderScorer(out, quantize=False)
    assert np.allclose(trained.read(question, COOPERATIVE), shipped.read(question, COOPERATIVE), atol=0.02)

    # An adapter that does not fit the reader is refused with what is wrong, not applied.
    saved["encoder.encoder.layer.0.attention.self.query.lora_B.weight"] = torch.zeros(100, 4)
    save_file(saved, str(out / "reader.safetensors"))
    with pytest.raises(GraderLoadError, match="layer.0.attention.self.query of shape"):
        load_reader(out)
    del saved["encoder.encoder.layer.0.attention.self.query.lora_B.weight"]
    save_file(saved, str(out / "reader.safetensors"))
    with pytest.raises(GraderLoadError, match="adapter for encoder.encoder.layer.0.attention.self.query"):
        load_reader(out)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("question", "answers", "does_not"),
    [
        ("What does one share cost?", 1, 2),  # "cost" against "priced at"
        ("How much does membership cost?", 1, 0),
        ("Who chairs the cooperative?", 2, 1),
        ("How long is Vell Blue aged?", 3, 4),  # "aged" against "ages ... for nine weeks"
    ],
)
def test_the_trained_reader_prefers_the_sentence_that_answers_a_paraphrase(
    grader: Path, question: str, answers: int, does_not: int
) -> None:
    reader, encoder, _ = load_reader(grader)
    logits = reader.score([question] * 2, [COOPERATIVE[answers], COOPERATIVE[does_not]], encoder=encoder)
    assert logits[0] > logits[1], logits


@pytest.mark.slow
def test_eval_grades_with_the_reader_named_in_crag_grader(grader: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llama_index_crag.scorers.registry import from_spec

    monkeypatch.delenv("CRAG_GRADER", raising=False)
    assert from_spec("reader").name.startswith("reader:grader#"), "no CRAG_GRADER: the packaged reader"
    monkeypatch.setenv("CRAG_GRADER", str(grader))
    scorer = from_spec("reader", corpus=COOPERATIVE)
    assert scorer.name.startswith(f"reader:{grader.name}#")
    scores = scorer.score_texts("Who chairs the cooperative?", COOPERATIVE)
    assert all(0.0 <= s <= 1.0 for s in scores) and len(scores) == len(COOPERATIVE)


@pytest.mark.slow
def test_a_packed_grader_reads_as_the_trained_one_at_half_the_size(grader: Path, tmp_path: Path) -> None:
    from llama_index_crag.calibration.packaging import pack_grader
    from llama_index_crag.cli import main

    packed = tmp_path / "packed"
    calibration = tmp_path / "calibration.json"
    args = ["calibrate", "--dataset", str(SAMPLE_DIR), "--scorer", f"reader:{grader}", "--out", str(calibration)]
    assert main([*args, "--no-progress"]) == 0
    info = pack_grader(grader, packed, calibration)
    assert (packed / "reader.safetensors").stat().st_size < 0.6 * (grader / "reader.safetensors").stat().st_size
    trained, shipped = ReaderScorer(grader, quantize=False), ReaderScorer(packed)
    assert info["quantize"] is False and shipped._encoder is shipped.reader.encoder
    question = "Who chairs the cooperative?"
    assert np.allclose(trained.read(question, COOPERATIVE), shipped.read(question, COOPERATIVE), atol=0.05)
    # The calibration travels inside: the packed grader grades with the fitted stack and thresholds.
    fitted = json.loads(calibration.read_text())
    assert shipped.weights.tolist() == pytest.approx(fitted["scorer_state"]["weights"])
    assert shipped.default_thresholds["upper"] == pytest.approx(fitted["thresholds"]["upper"])


def test_pack_grader_checks_everything_before_it_writes_anything(tmp_path: Path) -> None:
    from llama_index_crag.calibration.packaging import pack_grader
    from llama_index_crag.errors import ConfigError
    from llama_index_crag.scorers.reader import packaged_grader_path

    source = tmp_path / "grader"
    shutil.copytree(packaged_grader_path(), source)
    with pytest.raises(ConfigError, match="would overwrite its input"):
        pack_grader(source, source)
    calibration = tmp_path / "calibration.json"
    fitted = {"version": 1, "scorer": "reader:x", "thresholds": {"upper": 0.9, "lower": 0.4}}
    for broken, said in (
        (fitted, "no fitted stack"),
        ({**fitted, "scorer_state": {}, "thresholds": {"upper": 0.2, "lower": 0.9}}, "lower <= upper"),
    ):
        calibration.write_text(json.dumps(broken))
        with pytest.raises(ConfigError, match=said):
            pack_grader(source, tmp_path / "packed", calibration)
        assert not (tmp_path / "packed").exists()
