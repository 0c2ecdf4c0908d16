"""Calibration for the user's own embedding model and documents: ``llama-crag calibrate --embed-model`` and
``--index DIR --synthetic N``, with the real bundled MiniLM, a copy of it as "another model", and a real ingest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, List

import pytest
from llama_index.core import Document

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.cli import main
from llama_index_crag.cli.doctor import check_calibration
from llama_index_crag.core.persisted import load_engine
from llama_index_crag.errors import ConfigError
from llama_index_crag.local.bundled import bundled_embedding_path
from llama_index_crag.local.models import load_embed_model
from llama_index_crag.stores.folder import ingest, load_index

from .conftest import ScriptedLLM

DOCUMENTS = {
    "harbor.txt": "Harbor Analytics was founded in 2016 by Maria Lopez in Lisbon. The company sells forecasting "
    "software to shipping firms. Its first office had twelve employees and a view of the Tagus river.",
    "vell.txt": "Vell Blue is a cheese made in the Pyrenees. It is aged for nine weeks in limestone caves near "
    "Andorra. The dairy that makes it was opened by Joan Puig in 1987.",
    "bridge.txt": "The Ostrava footbridge opened in March 2009 after three years of work. It spans 214 metres over "
    "the Oder valley. The engineer Petra Novak designed its steel arch.",
    "orchard.txt": "The Kestrel orchard in Kent grows 40 varieties of apple. It was planted by Thomas Hale in 1952. "
    "Every October the orchard holds a harvest fair for the village.",
    "observatory.txt": "The Mirador observatory stands 2,400 metres above sea level in Chile. Its main telescope "
    "was built by the firm Optica Andina in 1998. Astronomers from Santiago run it all year.",
    "library.txt": "The Calder library in Glasgow holds 80,000 books. It was opened by the writer Anne Baird in "
    "1921. The reading room seats 150 people under a glass dome.",
}
SYNTHETIC = "4"


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("docs")
    for name, text in DOCUMENTS.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def ingested(docs: Path, embed_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    index_dir = tmp_path_factory.mktemp("ingested") / "index"
    ingest(docs, index_dir, embed_model=embed_model, warm_fallback=False)
    return index_dir


@pytest.fixture
def index_dir(ingested: Path, tmp_path: Path) -> Path:
    """A fresh copy of the ingested index, for a test that writes into it."""
    return Path(shutil.copytree(ingested, tmp_path / "index"))


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled MiniLM's files in a folder of another name: to the engine, another embedding model."""
    return Path(shutil.copytree(bundled_embedding_path(), tmp_path_factory.mktemp("models") / "other-minilm"))


@pytest.fixture(scope="module")
def other_model(other_model_dir: Path) -> Any:
    return load_embed_model(str(other_model_dir))


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same documents as a dataset folder (corpus.jsonl), for ``--dataset``."""
    folder = tmp_path_factory.mktemp("corpus")
    rows = [{"doc_id": name, "title": name.split(".")[0], "text": text} for name, text in DOCUMENTS.items()]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _nodes() -> List[Document]:
    return [Document(text=text, id_=name) for name, text in DOCUMENTS.items()]


def test_calibrate_index_stores_a_calibration_the_engine_over_the_index_grades_with(
    index_dir: Path, embed_model: Any
) -> None:
    assert main(["calibrate", "--index", str(index_dir), "--synthetic", SYNTHETIC, "--no-progress"]) == 0
    manifest = json.loads((index_dir / "manifest.json").read_text())
    assert manifest["calibration"] == "calibration.json"
    data = json.loads((index_dir / "calibration.json").read_text())
    assert data["scorer"] == "evidence:all-MiniLM-L6-v2" and data["embed_model"] == "all-MiniLM-L6-v2"
    assert "synthetic questions" in data["dataset"] and str(index_dir) in data["dataset"]

    engine = load_engine(load_index(index_dir, embed_model), llm=None)
    assert (engine.grader.upper, engine.grader.lower) == (data["thresholds"]["upper"], data["thresholds"]["lower"])
    assert engine.grader.scorer.weights.tolist() == pytest.approx(data["scorer_state"]["weights"])  # type: ignore[attr-defined]
    trace = engine.query("When was Harbor Analytics founded?").metadata["crag"]
    assert trace["scorer"] == data["scorer"]
    assert (trace["thresholds"]["upper"], trace["thresholds"]["lower"]) == (
        data["thresholds"]["upper"],
        data["thresholds"]["lower"],
    )


def test_reset_takes_the_index_back_to_the_shipped_thresholds_the_note_after_the_fit_names(
    index_dir: Path,
    ingested: Path,
    embed_model: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CRAG_CALIBRATION", raising=False)
    shipped = load_engine(load_index(ingested, embed_model), llm=None).grader
    assert main(["calibrate", "--index", str(index_dir), "--synthetic", SYNTHETIC, "--no-progress"]) == 0
    said = capsys.readouterr().out
    reset = f"llama-crag calibrate --index {index_dir} --reset"
    assert "ships with a calibration fitted on human-written questions" in said and reset in said
    fitted = load_engine(load_index(index_dir, embed_model), llm=None).grader
    assert (fitted.upper, fitted.lower) != (shipped.upper, shipped.lower)

    assert main(reset.split()[1:]) == 0
    assert "Removed calibration.json" in capsys.readouterr().out
    assert not (index_dir / "calibration.json").exists()
    assert json.loads((index_dir / "manifest.json").read_text())["calibration"] is None
    engine = load_engine(load_index(index_dir, embed_model), llm=None)
    assert (engine.grader.upper, engine.grader.lower) == (shipped.upper, shipped.lower)
    assert engine.grader.scorer.weights.tolist() == shipped.scorer.weights.tolist()  # type: ignore[attr-defined]
    assert "shipped for the bundled all-MiniLM-L6-v2" in check_calibration(str(index_dir)).detail  # doctor

    assert main(reset.split()[1:]) == 0  # again: nothing to forget, said so
    assert "holds no calibration" in capsys.readouterr().out
    assert main([*reset.split()[1:], "--synthetic", SYNTHETIC]) != 0
    assert "--reset fits nothing" in capsys.readouterr().err


def test_calibrate_index_with_out_writes_there_and_leaves_the_index_as_it_was(index_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "elsewhere.json"
    args = ["calibrate", "--index", str(index_dir), "--synthetic", SYNTHETIC, "--out", str(out), "--no-progress"]
    assert main(args) == 0
    assert json.loads(out.read_text())["scorer"] == "evidence:all-MiniLM-L6-v2"
    assert not (index_dir / "calibration.json").exists()
    assert json.loads((index_dir / "manifest.json").read_text())["calibration"] is None


def test_a_calibration_for_another_embedding_model_serves_that_model_and_is_refused_by_another(
    corpus_dir: Path, other_model_dir: Path, other_model: Any, embed_model: Any, tmp_path: Path
) -> None:
    out = tmp_path / "other.json"
    args = ["calibrate", "--dataset", str(corpus_dir), "--synthetic", SYNTHETIC, "--embed-model", str(other_model_dir)]
    assert main([*args, "--out", str(out), "--no-progress"]) == 0
    data = json.loads(out.read_text())
    assert data["embed_model"] == str(other_model_dir.resolve())
    assert data["scorer"] == f"evidence:{other_model_dir.resolve()}"

    engine = CorrectiveQueryEngine.from_defaults(
        nodes=_nodes(), llm=ScriptedLLM(), embed_model=other_model, calibration_path=str(out)
    )
    assert (engine.grader.upper, engine.grader.lower) == (data["thresholds"]["upper"], data["thresholds"]["lower"])
    with pytest.raises(ConfigError, match="calibrate again for this scorer") as refused:
        CorrectiveQueryEngine.from_defaults(
            nodes=_nodes(), llm=ScriptedLLM(), embed_model=embed_model, calibration_path=str(out)
        )
    assert "--embed-model all-MiniLM-L6-v2" in str(refused.value)  # the command that fits one for this engine


def test_another_embedding_model_without_a_calibration_is_told_the_command_that_fits_one(other_model: Any) -> None:
    with pytest.raises(ConfigError, match="no thresholds") as refused:
        CorrectiveQueryEngine.from_defaults(nodes=_nodes(), llm=ScriptedLLM(), embed_model=other_model)
    assert f"llama-crag calibrate --index INDEX_DIR --embed-model {other_model.model_name}" in str(refused.value)


def test_calibrate_index_refuses_a_model_the_index_was_not_embedded_with(
    index_dir: Path, other_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["calibrate", "--index", str(index_dir), "--synthetic", SYNTHETIC, "--embed-model", str(other_model_dir)]
    assert main([*args, "--no-progress"]) == 2
    assert "was embedded with" in capsys.readouterr().err
    assert not (index_dir / "calibration.json").exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--index", "{empty}", "--synthetic", "3"], "not an index folder"),
        (["--index", "{index}"], "add --synthetic N"),
        (["--index", "{index}", "--dataset", "{empty}", "--synthetic", "3"], "not both"),
        ([], "needs --dataset DIR"),
        (["--index", "{index}", "--synthetic", "3", "--embed-model", "{empty}/no-such-model"], "neither a model"),
        (["--index", "{index}", "--synthetic", "3", "--embed-model", "{empty}"], "holds no model"),
        (["--index", "{index}", "--synthetic", "3", "--scorer", "bi-encoder"], "drop --scorer"),
    ],
)
def test_bad_calibrate_input_is_refused_naming_the_fix(
    args: List[str], says: str, ingested: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    filled = [a.format(empty=tmp_path, index=ingested) for a in args]
    assert main(["calibrate", *filled, "--no-progress"]) == 2
    assert says in capsys.readouterr().err
    assert not (ingested / "calibration.json").exists()


@pytest.mark.parametrize("count", ["0", "-3"])
def test_synthetic_needs_at_least_one_question(count: str, ingested: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["calibrate", "--index", str(ingested), "--synthetic", count])
    assert "--synthetic" in capsys.readouterr().err


def test_doctor_names_the_calibration_in_force(index_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CRAG_CALIBRATION", raising=False)
    assert "shipped for the bundled all-MiniLM-L6-v2" in check_calibration(str(index_dir)).detail
    assert main(["calibrate", "--index", str(index_dir), "--synthetic", SYNTHETIC, "--no-progress"]) == 0
    check = check_calibration(str(index_dir))
    assert check.status == "ok"
    assert str(index_dir / "calibration.json") in check.detail and "stored in the index" in check.detail
    assert "scorer evidence:all-MiniLM-L6-v2" in check.detail
    monkeypatch.setenv("CRAG_CALIBRATION", str(index_dir / "calibration.json"))
    assert f"CRAG_CALIBRATION={index_dir / 'calibration.json'}" in check_calibration().detail


def test_an_index_embedded_with_another_model_is_updated_calibrated_and_asked_with_it(
    docs: Path, other_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    index_dir = tmp_path / "index"
    assert main(["ingest", str(docs), "--out", str(index_dir), "--embed-model", str(other_model_dir), "--no-warm"]) == 0
    manifest = json.loads((index_dir / "manifest.json").read_text())
    assert Path(manifest["embed_model"]).name == "other-minilm", manifest["embed_model"]
    assert Path(load_index(index_dir).embed_model.model_name).name == "other-minilm"  # read from the index

    # An update without --embed-model embeds as the index was embedded; nothing is embedded again.
    (docs / "harbor.txt").write_text(DOCUMENTS["harbor.txt"] + " It opened a second office in Porto in 2021.")
    try:
        assert main(["ingest", str(docs), "--out", str(index_dir), "--no-warm"]) == 0
        printed = capsys.readouterr().out
        assert "1 updated" in printed and "embedding model changed" not in printed, printed
        assert Path(json.loads((index_dir / "manifest.json").read_text())["embed_model"]).name == "other-minilm"

        assert main(["calibrate", "--index", str(index_dir), "--synthetic", SYNTHETIC, "--no-progress"]) == 0
        assert check_calibration(str(index_dir)).status == "ok"
        assert "ships with a calibration" not in capsys.readouterr().out  # no shipped one to go back to
        assert main(["ask", "--index", str(index_dir), "--json", "Who founded Harbor Analytics?"]) == 0
        answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert answer["question"] == "Who founded Harbor Analytics?" and "abstained" in answer, answer

        # The documents change after the calibration: ingest and doctor say it was fitted on what is gone.
        (docs / "harbor.txt").write_text(DOCUMENTS["harbor.txt"])
        assert main(["ingest", str(docs), "--out", str(index_dir), "--no-warm"]) == 0
        assert "calibration was fitted before 1 of its documents" in capsys.readouterr().out
        stale = check_calibration(str(index_dir))
        assert stale.status == "warn" and "fitted before 1 of the index's documents" in stale.detail, stale
        assert main(["calibrate", "--index", str(index_dir), "--synthetic", SYNTHETIC, "--no-progress"]) == 0
        assert check_calibration(str(index_dir)).status == "ok"

        # Another model given on an update embeds every document again with it, never mixing two models' vectors.
        assert (
            main(["ingest", str(docs), "--out", str(index_dir), "--embed-model", "all-MiniLM-L6-v2", "--no-warm"]) == 0
        )
        printed = capsys.readouterr().out
        assert "embedding model changed" in printed and f"{len(DOCUMENTS)} updated" in printed, printed
    finally:
        (docs / "harbor.txt").write_text(DOCUMENTS["harbor.txt"])
