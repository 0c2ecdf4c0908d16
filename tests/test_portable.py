"""The local generator on any x86-64 CPU: a portable llama.cpp build, a child-process check, and the doctor."""

from __future__ import annotations

import importlib
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from llama_index_crag.cli import main
from llama_index_crag.local.cores import torch_on_usable_cores, usable_cores
from llama_index_crag.local.models import default_llm
from llama_index_crag.local.portable import (
    FAIL,
    NON_PORTABLE_FEATURES,
    OK,
    PORTABLE_CMAKE_ARGS,
    WARN,
    GeneratorUnavailable,
    check_generation,
    llama_cpp_features,
)

ROOT = Path(__file__).resolve().parent.parent


class Note(BaseModel):
    """A free-text field: where a small model is most tempted to write a raw newline."""

    title: str
    body: str


def test_the_makefile_builds_llama_cpp_portably_and_bypasses_the_wheel_cache() -> None:
    plan = subprocess.run(
        ["make", "-n", "portable-llama-cpp", "WHEELHOUSE=/nonexistent/wheelhouse"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f'CMAKE_ARGS="{PORTABLE_CMAKE_ARGS}"' in plan
    assert "-DGGML_NATIVE=OFF" in PORTABLE_CMAKE_ARGS and "-DGGML_AVX2=ON" in PORTABLE_CMAKE_ARGS
    assert all(f"-DGGML_{flag}=OFF" in PORTABLE_CMAKE_ARGS for flag in ("AVX512", "AMX_TILE", "AMX_INT8"))
    assert re.search(r"pip wheel .*--no-cache-dir --no-binary llama-cpp-python", plan)


def test_the_installed_llama_cpp_has_no_cpu_specific_kernels_compiled_in() -> None:
    features = llama_cpp_features()
    assert "AVX2" in features and "FMA" in features
    assert not [f for f in features if f.startswith(NON_PORTABLE_FEATURES)], features


def _fake_python(tmp_path: Path, body: str) -> str:
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_a_generator_that_dies_with_sigill_is_named_with_the_portable_rebuild(tmp_path: Path) -> None:
    check = check_generation(python=_fake_python(tmp_path, "kill -ILL $$"))
    assert check.status == FAIL
    assert "Illegal instruction" in check.detail
    assert "make portable-llama-cpp" in check.fix and PORTABLE_CMAKE_ARGS in check.fix


def test_a_generator_that_hangs_fails_within_its_timeout(tmp_path: Path) -> None:
    check = check_generation(python=_fake_python(tmp_path, "sleep 30"), timeout_s=1)
    assert check.status == FAIL and "within 1 s" in check.detail


@pytest.mark.parametrize(("generate_s", "status"), [(32.0, WARN), (0.5, OK)])
def test_a_generator_slower_than_a_person_reads_is_a_warning(tmp_path: Path, generate_s: float, status: str) -> None:
    figures = json.dumps({"load_s": 0.5, "generate_s": generate_s, "tokens": 32})
    check = check_generation(tmp_path / "model.gguf", python=_fake_python(tmp_path, f"echo '{figures}'"))
    assert check.status == status, check
    assert f"generates {32 / generate_s:.0f} tokens/s" in check.detail
    assert ("slower than a person reads" in check.detail) is (status == WARN)
    assert check.ok, "a slow generator still works: a warning, not a failure"


def test_a_file_that_is_not_a_model_fails_the_check_and_default_llm(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file" * 100)
    check = check_generation(bogus)
    assert check.status == FAIL and "bogus.gguf failed to load" in check.detail
    with pytest.raises(GeneratorUnavailable, match="bogus.gguf"):
        default_llm(ollama_url="http://127.0.0.1:9", gguf=str(bogus))


def test_the_demo_asked_to_generate_without_a_working_generator_quotes_instead(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"\0" * 64)
    demo = ["demo", "--limit", "3", "--generate", "--gguf", str(bogus), "--ollama-url", "http://127.0.0.1:9"]
    assert main(demo) == 0
    out = capsys.readouterr().out
    assert "Generator: none." in out and "bogus.gguf failed to load" in out
    assert out.count("action: ") == 3 and "Answers: quoted from the graded passages" in out
    answered = [line for line in out.splitlines() if line.strip().startswith("answer")]
    assert len(answered) == 3
    assert all("answer (quoted):" in line or "I don't know" in line for line in answered)


@pytest.mark.slow
def test_the_bundled_generator_runs_in_a_child_process() -> None:
    check = check_generation()
    # Under load the verdict may be the reading-speed warning (its own tests set the speed); it still generated.
    assert check.status == OK or "slower than a person reads" in check.detail, check
    assert re.search(r"generates \d+ tokens/s", check.detail)
    cores = usable_cores()
    assert f" on {cores} thread{'' if cores == 1 else 's'}" in check.detail  # the threads the model runs on
    assert " on 1 thread" in check_generation(n_threads=1).detail


@pytest.mark.slow
def test_doctor_checks_every_part_and_says_what_to_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json", "--ollama-url", "http://127.0.0.1:9"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert set(checks) == {
        "torch",
        "embedding model",
        "grader",
        "calibration",
        "Ollama",
        "llama.cpp build",
        "generator (llama.cpp)",
        "spaCy pipeline",
    }
    assert checks["calibration"]["status"] == OK and "all-MiniLM-L6-v2" in checks["calibration"]["detail"]
    assert checks["embedding model"]["status"] == OK and "384 dimensions" in checks["embedding model"]["detail"]
    from llama_index_crag.scorers.registry import default_scorer

    assert checks["grader"]["status"] == OK and checks["grader"]["detail"].startswith(default_scorer().name)
    assert checks["Ollama"]["status"] == "warn" and "ollama pull" in checks["Ollama"]["fix"]
    assert checks["llama.cpp build"]["status"] == OK and "(portable)" in checks["llama.cpp build"]["detail"]
    generator = checks["generator (llama.cpp)"]
    assert generator["status"] == OK or "slower than a person reads" in generator["detail"]
    assert all(c["seconds"] >= 0 for c in checks.values())


#: The doctor's checks in a fresh process that may use one core (as a 1-CPU container's quota would say).
ONE_CORE_DOCTOR = """
import llama_index_crag.local.cores as cores
cores.usable_cores = lambda: 1
from llama_index_crag.cli import main
main(["doctor", "--json", "--ollama-url", "http://127.0.0.1:9"])
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("told", "torch_line", "generator_line"), [(None, "1 thread)", "on 1 thread"), ("2", "2 threads)", "on 1 thread")]
)
def test_the_command_line_runs_torch_on_the_usable_cores_unless_told(
    told: str | None, torch_line: str, generator_line: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | ({"OMP_NUM_THREADS": told} if told else {})
    run = subprocess.run([sys.executable, "-c", ONE_CORE_DOCTOR], env=env, capture_output=True, text=True, timeout=300)
    checks = {c["name"]: c["detail"] for c in json.loads(run.stdout)}
    assert checks["torch"].endswith(torch_line), checks["torch"]  # torch's default here is every core the machine has
    assert generator_line in checks["generator (llama.cpp)"]


def test_the_usable_cores_are_told_to_torch_only_while_a_command_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as if torch had not loaded yet in this process
    with torch_on_usable_cores():
        assert os.environ["OMP_NUM_THREADS"] == str(usable_cores())
    assert "OMP_NUM_THREADS" not in os.environ
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with torch_on_usable_cores():
        assert os.environ["OMP_NUM_THREADS"] == "3"  # what the user said wins
    assert os.environ["OMP_NUM_THREADS"] == "3"


def test_a_torch_already_loaded_keeps_the_threads_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    importlib.import_module("torch")  # as an application that uses torch has it loaded before the command runs
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with torch_on_usable_cores():
        assert "OMP_NUM_THREADS" not in os.environ and "torch" in sys.modules


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_schema_bound_json_from_the_bundled_model_always_parses(seed: int) -> None:
    from llama_cpp import Llama

    from llama_index_crag.local.bundled import bundled_gguf_path
    from llama_index_crag.local.llamacpp import chatml_completion_to_prompt, json_grammar

    llm = _model(Llama, str(bundled_gguf_path()))
    out = llm(
        chatml_completion_to_prompt("Write a note with a title and a body of three short paragraphs as JSON."),
        grammar=json_grammar(Note.model_json_schema()),
        max_tokens=160,
        temperature=1.2,
        seed=seed,
    )["choices"][0]["text"]
    # Raw control characters may only stand between tokens, never inside a string (escaped ones are fine).
    inside = re.findall(r'"((?:[^"\\]|\\.)*)"', out)
    assert inside and not [s for s in inside if re.search(r"[\x00-\x1f]", s)], out
    if out.rstrip().endswith("}"):  # a complete object (max_tokens may cut it): pydantic must accept it
        Note.model_validate_json(out)


_MODELS: dict = {}


def _model(cls: type, path: str) -> object:
    if path not in _MODELS:
        _MODELS[path] = cls(model_path=path, n_ctx=512, n_threads=2, verbose=False)
    return _MODELS[path]


def test_the_json_grammar_keeps_raw_control_characters_out_of_strings() -> None:
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    from llama_index_crag.local.llamacpp import _GRAMMAR_CHAR, _JSON_CHAR, json_grammar

    # llama.cpp's plain JSON grammar already keeps them out; its schema grammars do not.
    assert _JSON_CHAR in JSON_GBNF and not _GRAMMAR_CHAR.search(JSON_GBNF)
    schema_rules = json_schema_to_gbnf(json.dumps(Note.model_json_schema()))
    assert _GRAMMAR_CHAR.search(schema_rules), "llama.cpp's string rule changed: re-check json_grammar"
    fixed = _GRAMMAR_CHAR.sub(lambda _: _JSON_CHAR, schema_rules)
    assert not _GRAMMAR_CHAR.search(fixed) and _JSON_CHAR in fixed
    json_grammar(Note.model_json_schema())  # both compile in llama.cpp
    json_grammar()


@pytest.mark.parametrize(
    "cut, closed",
    [
        ('{"query": "harbor analytics chief exec', '{"query": "harbor analytics chief exec"}'),
        ('{"query": "a \\"quoted', '{"query": "a \\"quoted"}'),
        ('{"query": "ends in an escape \\', '{"query": "ends in an escape "}'),
        ('{"items": [{"a": "x"}, {"b": "y', '{"items": [{"a": "x"}, {"b": "y"}]}'),
        ('{"items": ["x", ', '{"items": ["x"]}'),
        ('{"done": "yes"}', '{"done": "yes"}'),
    ],
)
def test_a_json_prefix_cut_at_the_token_cap_is_closed(cut: str, closed: str) -> None:
    from llama_index_crag.local.llamacpp import close_json_prefix

    assert close_json_prefix(cut) == closed
    json.loads(closed)
