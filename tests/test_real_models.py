"""The real generators and cross-encoders: llama.cpp in process, Ollama over HTTP, both cross-encoder libraries."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen, LLMMetadata
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.postprocessor import SentenceTransformerRerank
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.llms.ollama import Ollama

from llama_index_crag import CorrectiveQueryEngine, RewrittenQuery
from llama_index_crag.core.rewrite import DEFAULT_REWRITE_PROMPT
from llama_index_crag.deadline import running_until
from llama_index_crag.errors import CorrectiveTimeout
from llama_index_crag.local.bundled import bundled_embedding_path
from llama_index_crag.scorers import CrossEncoderScorer, UpstreamScoreScorer
from llama_index_crag.text.split import terms

from .conftest import ALPHA, BETA, GAMMA, FixedRetriever, ScriptedLLM
from .ollama_server import OllamaServer

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llama_cpp_llm() -> Any:
    from llama_index_crag.local.llamacpp import BundledLlamaCPP

    return BundledLlamaCPP()


def test_bundled_llama_cpp_returns_schema_valid_json_for_the_rewrite(llama_cpp_llm: Any) -> None:
    result = llama_cpp_llm.structured_predict(
        RewrittenQuery, DEFAULT_REWRITE_PROMPT, query="What was Harbor Pro churn in Q1 excl. trials?"
    )
    assert isinstance(result, RewrittenQuery) and result.query.strip()


def test_a_rewrite_cut_at_the_bundled_models_token_cap_still_parses() -> None:
    from llama_index_crag.local.llamacpp import BundledLlamaCPP

    short = BundledLlamaCPP(max_new_tokens=6)  # the cap falls inside the query string
    result = short.structured_predict(
        RewrittenQuery, DEFAULT_REWRITE_PROMPT, query="What was Harbor Pro churn in Q1 excl. trials?"
    )
    assert isinstance(result, RewrittenQuery) and result.query.strip()


def test_the_bundled_model_stops_at_its_steps_deadline_and_is_free_for_the_next_call(llama_cpp_llm: Any) -> None:
    from llama_index_crag.local.llamacpp import _stop_at

    story = "Tell me a long story about a lighthouse keeper."
    cut = llama_cpp_llm._model(prompt=story, max_tokens=48, temperature=0.0, stopping_criteria=_stop_at(0.0))
    assert cut["usage"]["completion_tokens"] <= 1  # a deadline already past stops it at its first token
    with running_until(time.monotonic()), pytest.raises(CorrectiveTimeout):  # a cut text is not an answer
        llama_cpp_llm.complete(story)
    with running_until(time.monotonic()), pytest.raises(CorrectiveTimeout):
        llama_cpp_llm.structured_predict(RewrittenQuery, DEFAULT_REWRITE_PROMPT, query="Harbor churn in Q1?")
    llama_cpp_llm._lock.acquire()  # another query's call holds the model
    try:
        with running_until(time.monotonic() + 0.2), pytest.raises(CorrectiveTimeout):
            llama_cpp_llm.structured_predict(RewrittenQuery, DEFAULT_REWRITE_PROMPT, query="Harbor churn in Q1?")
    finally:
        llama_cpp_llm._lock.release()
    assert "stopping_criteria" not in llama_cpp_llm.generate_kwargs
    assert str(llama_cpp_llm.complete("Name one colour.")).strip()  # the model is free, with no deadline


def test_the_bundled_model_runs_on_the_cores_the_process_may_use() -> None:
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from llama_index_crag.local.llamacpp import BundledLlamaCPP; "
        "print(BundledLlamaCPP().model_kwargs['n_threads'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-1] == "1"


CEO_QUESTION = "Who is the chief executive officer of Harbor Analytics?"
#: A sentence no passage of the sample corpus supports: its year and its share are invented.
INVENTED = "Harbor Analytics was founded in 1887 and grew 118% last year."


class Inventing(CustomLLM):
    """The real generator, with a sentence its sources do not support added to every answer it writes."""

    _llm: Any = PrivateAttr()

    def __init__(self, llm: Any) -> None:
        super().__init__()
        self._llm = llm

    @property
    def metadata(self) -> LLMMetadata:
        return self._llm.metadata.model_copy(update={"is_chat_model": False})

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return CompletionResponse(text=f"{self._llm.complete(prompt, **kwargs).text.strip()} {INVENTED}")

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        raise NotImplementedError("the check reads whole answers here")


def _generating(sample_index: VectorStoreIndex, llm: Any) -> CorrectiveQueryEngine:
    return CorrectiveQueryEngine.from_defaults(
        index=sample_index, llm=llm, fallback_sources=("bm25",), answer_mode="generate", on_ungrounded="flag"
    )


def test_the_bundled_generator_quotes_by_default_and_its_generated_answers_are_checked(
    sample_index: VectorStoreIndex, llama_cpp_llm: Any
) -> None:
    quoting = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=llama_cpp_llm, fallback_sources=("bm25",))
    assert quoting.answer_mode == "extract"
    response = _generating(sample_index, llama_cpp_llm).query(CEO_QUESTION)
    trace = response.metadata["crag"]
    assert trace["answered_by"] == "generate" and trace["timings_ms"]["generate"] > 0
    # SmolLM2 at temperature 0 names the CEO from the retrieved profile: an answer its sources support.
    assert "Miriam Okafor" in str(response), str(response)
    assert trace["answer_check"]["status"] == "checked" and trace["grounded"] is True, trace["answer_check"]


def test_a_real_generated_answer_with_an_invented_figure_fails_its_check(
    sample_index: VectorStoreIndex, llama_cpp_llm: Any
) -> None:
    response = _generating(sample_index, Inventing(llama_cpp_llm)).query(CEO_QUESTION)
    trace = response.metadata["crag"]
    assert str(response).endswith(INVENTED) and trace["answered_by"] == "generate"
    check = trace["answer_check"]
    assert check["status"] == "checked" and check["outcome"] == "flagged" and trace["grounded"] is False, check
    assert {"1887", "118%"} <= set(check["unsupported"])


def test_engine_generates_with_llama_cpp_and_abstains_off_topic(
    sample_index: VectorStoreIndex, llama_cpp_llm: Any
) -> None:
    engine = CorrectiveQueryEngine.from_defaults(
        index=sample_index, llm=llama_cpp_llm, fallback_sources=("bm25",), answer_mode="generate"
    )
    answered = engine.query("Who is the chief executive officer of Harbor Analytics?")
    assert not answered.metadata["crag"]["abstained"] and len(str(answered).strip()) > 3
    assert answered.metadata["crag"]["timings_ms"]["generate"] > 0
    off_topic = engine.query("Who won the 1998 FIFA World Cup?").metadata["crag"]
    assert off_topic["action"] == "incorrect" and off_topic["abstained"]


@pytest.fixture(scope="module")
def ollama() -> Iterator[OllamaServer]:
    with OllamaServer(model_name="smollm2") as server:
        yield server


def test_engine_through_the_ollama_client_answers_streams_and_rewrites(
    sample_index: VectorStoreIndex, ollama: OllamaServer
) -> None:
    llm = Ollama(model="smollm2", base_url=ollama.url, request_timeout=120, context_window=2048)
    # Limits lifted: on a loaded machine the rewrite would run past its limit and keywords be searched instead.
    engine = CorrectiveQueryEngine.from_defaults(
        index=sample_index, llm=llm, fallback_sources=("bm25",), correction_timeout_s=600, rewrite_timeout_s=300
    )
    answered = engine.query("Who is the chief executive officer of Harbor Analytics?")
    assert not answered.metadata["crag"]["abstained"] and str(answered).strip()

    streaming = CorrectiveQueryEngine.from_defaults(
        index=sample_index, llm=llm, streaming=True, fallback_sources=("bm25",)
    )
    tokens = list(streaming.query("Where are the headquarters of Harbor Analytics?").response_gen)
    assert len(tokens) > 1

    # No passage of the sample corpus is on this subject: the grade is incorrect and the query is rewritten.
    question = "Who won the 1998 FIFA World Cup?"
    before, replied = len(ollama.requests), len(ollama.replies)
    trace = engine.query(question).metadata["crag"]
    chat_requests = [body for path, body in ollama.requests[before:] if path == "/api/chat"]
    assert trace["action"] == "incorrect" and chat_requests, trace
    assert chat_requests[0]["format"]["properties"]["query"]["type"] == "string"
    # What the model wrote decides the path (llama.cpp's sampling differs between CPUs): a usable JSON rewrite
    # (a new query keeping a word of the question) is searched with; anything else is recorded and replaced by
    # the question's keywords.
    reply = next(text for path, text in ollama.replies[replied:] if path == "/api/chat")
    try:
        written = " ".join(str(json.loads(reply)["query"]).split())
    except (ValueError, KeyError, TypeError):
        written = ""
    usable = written and written.casefold() != question.casefold() and bool(set(terms(question)) & set(terms(written)))
    if usable:
        assert trace["rewrite_source"] == "llm" and trace["rewrite_error"] is None, (reply, trace["rewrite_error"])
        assert trace["rewritten_query"] == written
    else:
        assert trace["rewrite_source"] == "keyword" and trace["rewrite_error"], (reply, trace["rewrite_error"])
        assert trace["rewritten_query"] and "fifa" in trace["rewritten_query"].casefold()


def test_a_hung_ollama_server_fails_the_generation_within_its_timeout(sample_index: VectorStoreIndex) -> None:
    with OllamaServer(model_name="smollm2", mode="hang") as server:
        llm = Ollama(model="smollm2", base_url=server.url, request_timeout=2, context_window=2048)
        engine = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=llm, fallback_sources=("bm25",))
        from llama_index_crag import GenerationError

        with pytest.raises(GenerationError, match=f"smollm2 at {server.url}"):
            engine.query("Who is the chief executive officer of Harbor Analytics?")


def test_garbage_from_an_ollama_server_on_the_rewrite_path_falls_back_to_keywords(
    sample_index: VectorStoreIndex,
) -> None:
    with OllamaServer(model_name="smollm2", mode="garbage") as server:
        llm = Ollama(model="smollm2", base_url=server.url, request_timeout=10, context_window=2048)
        engine = CorrectiveQueryEngine.from_defaults(index=sample_index, llm=llm, fallback_sources=("bm25",))
        trace = engine.query("What is the boiling point of mercury?").metadata["crag"]
        assert trace["rewrite_error"] and trace["rewrite_source"] == "keyword"
        assert trace["abstained"] and "still below lower" in trace["abstain_reason"]


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cross-encoder built locally from the bundled MiniLM weights (untrained head: plumbing only)."""
    import torch
    from sentence_transformers import CrossEncoder

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("cross-encoder")
    CrossEncoder(str(bundled_embedding_path()), num_labels=1).save(str(path))
    return path


def test_both_cross_encoder_backends_load_a_local_path_and_agree(cross_encoder_dir: Path) -> None:
    texts = [ALPHA.text, BETA.text, GAMMA.text]
    st = CrossEncoderScorer(str(cross_encoder_dir), backend="sentence-transformers")
    flag = CrossEncoderScorer(str(cross_encoder_dir), backend="flagembedding")
    st_scores = st.score_texts("alpha project budget", texts)
    flag_scores = flag.score_texts("alpha project budget", texts)
    assert all(0.0 < s < 1.0 for s in st_scores)
    assert st_scores == pytest.approx(flag_scores, abs=1e-3)
    assert st.name != flag.name


@pytest.mark.parametrize("backend", ["sentence-transformers", "flagembedding"])
def test_a_folder_without_a_model_is_a_one_line_grader_load_error(tmp_path: Path, backend: str) -> None:
    from llama_index_crag.errors import GraderLoadError

    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(GraderLoadError, match=f"cannot load the cross-encoder '{tmp_path}'") as raised:
        CrossEncoderScorer(str(tmp_path), backend=backend)  # type: ignore[arg-type]
    assert "\n" not in str(raised.value)


def test_an_unknown_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown cross-encoder backend 'onnx'"):
        CrossEncoderScorer("x", backend="onnx")  # type: ignore[arg-type]


def test_grading_reuses_an_upstream_cross_encoder_rerank(cross_encoder_dir: Path) -> None:
    reranker = SentenceTransformerRerank(model=str(cross_encoder_dir), top_n=3, device="cpu")
    scorer = UpstreamScoreScorer.from_reranker(reranker)
    reranked = reranker.postprocess_nodes([NodeWithScore(node=n) for n in (ALPHA, BETA)], query_str="alpha budget")
    direct = CrossEncoderScorer(str(cross_encoder_dir)).score_texts("alpha budget", [n.node.text for n in reranked])
    assert scorer.score_nodes(QueryBundle("alpha budget"), reranked) == pytest.approx(direct, abs=1e-4)
    narrow = UpstreamScoreScorer.from_reranker(SentenceTransformerRerank(model=str(cross_encoder_dir), top_n=1))
    strips = [ALPHA.text, BETA.text, GAMMA.text]
    expected = CrossEncoderScorer(str(cross_encoder_dir)).score_texts("alpha budget", strips)
    assert narrow.score_texts("alpha budget", strips) == pytest.approx(expected, abs=1e-4), "no strip cut by top_n"
    engine = CorrectiveQueryEngine.from_defaults(
        retriever=FixedRetriever([ALPHA, BETA]),
        llm=ScriptedLLM(),
        scorer=scorer,
        node_postprocessors=[reranker],
        upper=0.99,
        lower=0.0,
        nodes=[ALPHA, BETA],
    )
    trace = engine.query("alpha budget").metadata["crag"]
    assert sorted(n["score"] for n in trace["nodes"]) == pytest.approx(sorted(direct), abs=1e-3)


def test_flag_embedding_reranker_scores_are_read_as_logits(cross_encoder_dir: Path) -> None:
    from llama_index.postprocessor.flag_embedding_reranker import FlagEmbeddingReranker

    reranker = FlagEmbeddingReranker(model=str(cross_encoder_dir), top_n=2, use_fp16=False)
    scorer = UpstreamScoreScorer.from_reranker(reranker)
    assert "sigmoid" in scorer.normalization
    reranked = reranker.postprocess_nodes([NodeWithScore(node=n) for n in (ALPHA, BETA)], query_str="alpha budget")
    scores = scorer.score_nodes(QueryBundle("alpha budget"), reranked)
    direct = CrossEncoderScorer(str(cross_encoder_dir), backend="flagembedding").score_texts(
        "alpha budget", [n.node.text for n in reranked]
    )
    assert scores == pytest.approx(direct, abs=1e-3)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", ["quickstart.py", "chat_engine.py", "span_tree.py"])
def test_examples_run_offline(script: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "action" in result.stdout


@pytest.mark.timeout(900)
def test_flag_reranker_example_runs_with_a_local_model(cross_encoder_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "flag_reranker_grader.py"), "--model", str(cross_encoder_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.timeout(900)
def test_the_demo_command_answers_and_abstains(tmp_path: Path) -> None:
    import json
    import shutil

    from llama_index_crag.datasets import SAMPLE_DIR

    shutil.copy(SAMPLE_DIR / "corpus.jsonl", tmp_path / "corpus.jsonl")
    questions = [
        {
            "qid": "a",
            "question": "Who is the chief executive officer of Harbor Analytics?",
            "answers": ["Miriam Okafor"],
            "answerable": True,
            "relevant_doc_ids": ["harbor-001"],
        },
        {
            "qid": "b",
            "question": "Who won the 1998 FIFA World Cup?",
            "answers": [],
            "answerable": False,
            "relevant_doc_ids": [],
        },
    ]
    (tmp_path / "questions.jsonl").write_text("\n".join(json.dumps(q) for q in questions))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_index_crag.cli",
            "demo",
            "--dataset",
            str(tmp_path),
            "--ollama-url",
            "http://127.0.0.1:9",
            "--explain",
            "--generate",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "using in-process llama.cpp" in result.stdout
    # --explain names the best candidate and what it lacks: the CEO's profile lacks none of the question's words.
    assert "best candidate harbor-001 (" in result.stdout and "lacks: nothing" in result.stdout
    assert result.stdout.count("action: ") == 2 and "abstained on 1;" in result.stdout
    assert "answer (generated, " in result.stdout or "the generated answer's check:" in result.stdout
