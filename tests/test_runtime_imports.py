"""What an app imports to answer questions is the runtime: the tooling (calibration and its training, pair-making,
the grade report, evaluation, the command line, the server) stays importable but is not imported with it."""

from __future__ import annotations

import json
import subprocess
import sys

TOOLING = (
    "llama_index_crag.calibration",
    "llama_index_crag.evaluation",
    "llama_index_crag.cli",
    "llama_index_crag.server",
)


def _imported_after(statement: str) -> list[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return [m for m in json.loads(out.splitlines()[-1]) if m.startswith("llama_index_crag")]


def test_building_and_asking_an_engine_imports_no_tooling() -> None:
    modules = _imported_after(
        "from llama_index.core import VectorStoreIndex\n"
        "from llama_index_crag import CorrectiveQueryEngine, CorrectiveRetriever, load_engine, load_index\n"
        "from llama_index_crag.core.chat import CorrectiveChatEngine\n"
        "from llama_index_crag.datasets import load_documents\n"
        "from llama_index_crag.local.models import default_embed_model\n"
        "index = VectorStoreIndex.from_documents(load_documents(), embed_model=default_embed_model())\n"
        "engine = CorrectiveQueryEngine.from_defaults(index=index)\n"
        "assert engine.query('Who is the CEO of Harbor Analytics?').metadata['crag']['action']"
    )
    assert "llama_index_crag.core.engine" in modules
    assert [m for m in modules if m.startswith(TOOLING)] == []


def test_the_tooling_is_still_importable_on_its_own() -> None:
    modules = _imported_after("import llama_index_crag.calibration.calibrate, llama_index_crag.evaluation.harness")
    assert "llama_index_crag.calibration.calibrate" in modules and "llama_index_crag.evaluation.harness" in modules
