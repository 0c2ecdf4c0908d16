"""``pip install .`` with no extras gives a package that imports and answers, without the server's or the
PostgreSQL store's dependencies.

A new virtualenv (no system site-packages, so nothing of the development environment shows through) gets the
CPU torch the README installs first, then this checkout with no extras. FastAPI and uvicorn belong to the
``[server]`` extra and psycopg to ``[postgres]``: none of them may come with the bare install, and the README's
ten-line example must run without them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .doc_blocks import REPO, blocks

MOCK_LLM_EXAMPLE = """
from llama_index.core import VectorStoreIndex
from llama_index.core.llms import MockLLM
from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.datasets import load_documents
from llama_index_crag.local.models import default_embed_model

index = VectorStoreIndex.from_documents(load_documents(), embed_model=default_embed_model())
engine = CorrectiveQueryEngine.from_defaults(index=index, llm=MockLLM(max_tokens=16))
response = engine.query("Who is the CEO of Harbor Analytics?")
assert response.metadata["crag"]["action"] in ("correct", "ambiguous"), response.metadata["crag"]
print("answered:", response.metadata["crag"]["answered_by"])
"""


def _readme_example() -> str:
    """The README's ten lines that run (the first Python block)."""
    return next(b.code for b in blocks(REPO / "README.md") if b.lang == "python")


def _run(command: list, **kwargs: object) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


@pytest.mark.slow
@pytest.mark.install
@pytest.mark.timeout(3600)
def test_a_bare_install_imports_and_answers_without_the_server_or_postgres_dependencies(tmp_path: Path) -> None:
    started = time.monotonic()
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    _run([python, "-m", "pip", "install", "-q", "torch==2.13.0"], env=env)
    torch_s = time.monotonic() - started
    _run([python, "-m", "pip", "install", "-q", str(REPO)], env=env)
    installed = time.monotonic() - started
    print(f"torch installed in {torch_s:.0f} s, the package and its dependencies in {installed - torch_s:.0f} s")

    outside = tmp_path / "elsewhere"  # not the checkout, so the import is the installed package
    outside.mkdir()
    where = _run([python, "-c", "import llama_index_crag; print(llama_index_crag.__file__)"], cwd=outside, env=env)
    assert str(venv) in where.stdout, where.stdout
    for module in ("fastapi", "uvicorn", "psycopg"):
        found = subprocess.run([python, "-c", f"import {module}"], cwd=outside, env=env, capture_output=True, text=True)
        assert found.returncode != 0, f"`pip install .` brought {module}: it belongs to an extra"
        assert "ModuleNotFoundError" in found.stderr, found.stderr

    readme = _run([python, "-c", _readme_example()], cwd=outside, env=env)
    assert "Quoted from the documents" in readme.stdout and "I don't know" in readme.stdout, readme.stdout
    mock = _run([python, "-c", MOCK_LLM_EXAMPLE], cwd=outside, env=env)
    assert "answered:" in mock.stdout, mock.stdout
    print(f"installed in {installed:.0f} s, whole test {time.monotonic() - started:.0f} s")
