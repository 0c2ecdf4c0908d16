"""The command line's names and help: one name for an option across commands, and every default shown."""

from __future__ import annotations

import pytest

from llama_index_crag.cli import build_parser, main
from llama_index_crag.local.models import DEFAULT_OLLAMA_MODEL


@pytest.mark.parametrize("command", [["serve", "--index", "x"], ["demo"], ["doctor"]])
def test_serve_demo_and_doctor_name_the_ollama_model_alike(command: list[str]) -> None:
    assert build_parser().parse_args([*command]).ollama_model == DEFAULT_OLLAMA_MODEL
    assert build_parser().parse_args([*command, "--ollama-model", "llama3.2:1b"]).ollama_model == "llama3.2:1b"


def test_serve_still_reads_the_former_model_option_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--index", "x", "--model", "llama3.2:1b"])
    assert args.ollama_model == "llama3.2:1b"
    assert "llama-crag serve: --model is deprecated: use --ollama-model" in capsys.readouterr().err


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_serve_help_shows_the_default_of_every_option_that_has_one(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help("serve", capsys)
    for option, default in [
        ("--port PORT", "8000"),
        ("--workers WORKERS", "1"),
        ("--query-timeout QUERY_TIMEOUT", "120.0"),
        ("--ollama-model OLLAMA_MODEL", DEFAULT_OLLAMA_MODEL),
        ("--host HOST", "127.0.0.1"),
        ("--llm {auto,ollama,llamacpp,none}", "auto"),
        ("--rate-window RATE_WINDOW", "300.0"),
    ]:
        described = text.split(f" {option} ", 1)[1].split(" --")[0]  # in the usage the option is bracketed
        assert described.endswith(f"(default: {default})"), described
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: [])" not in text
    assert "--model " not in text, "the former name is read, not offered"


def test_every_command_shows_its_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert f"(default: {DEFAULT_OLLAMA_MODEL})" in _help("doctor", capsys)
    assert "(default: calibration.json)" in _help("calibrate", capsys)
