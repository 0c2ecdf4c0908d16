"""The query server over a real persisted index, on a real socket: API, OpenAI SDK, errors, metrics, workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import httpx
import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import CompletionResponse
from llama_index.core.llms import MockLLM
from llama_index.core.response_synthesizers.no_text import NoText
from llama_index.core.schema import NodeWithScore, QueryBundle

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.core.persisted import load_engine
from llama_index_crag.datasets import SAMPLE_DIR, load_documents, load_questions
from llama_index_crag.errors import ConfigError, GraderLoadError
from llama_index_crag.local.cores import usable_cores
from llama_index_crag.server.app import create_app
from llama_index_crag.server.service import ServerConfig
from llama_index_crag.stores.chunking import splitter
from llama_index_crag.stores.folder import IndexFolderError, ingest, load_index
from tests.conftest import ScriptedLLM, write_hostile_documents
from tests.live_server import LiveServer
from tests.loadtest import ServerProcess, free_port, run_load
from tests.ollama_server import OllamaServer

ANSWERED = "Who is the CEO of Harbor Analytics?"
OUT_OF_CORPUS = "Who wrote the novel Moby-Dick?"


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("index")
    ingest(SAMPLE_DIR, out)
    return out


@pytest.fixture(scope="module")
def loaded(index_dir: Path) -> Any:
    return load_index(index_dir)


@pytest.fixture(scope="module")
def server(loaded: Any) -> Iterator[LiveServer]:
    engine = load_engine(loaded, ScriptedLLM())
    with LiveServer(create_app(engine, index_info=loaded.describe())) as live:
        yield live


def _post(server: LiveServer, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(server.url + path, timeout=60, **kwargs)


# --- the persisted index --------------------------------------------------------------------------------------


def test_a_loaded_index_grades_and_decides_as_the_engine_built_in_memory(loaded: Any, embed_model: Any) -> None:
    documents = load_documents()
    # The same chunks as ingest cuts (chunks to the embedding model's window), so the same word statistics.
    in_memory = CorrectiveQueryEngine.from_defaults(
        index=VectorStoreIndex.from_documents(documents, embed_model=embed_model, transformations=[splitter()]),
        llm=MockLLM(),
        response_synthesizer=NoText(llm=MockLLM()),
        max_rewrites=0,
    )
    served = load_engine(loaded, MockLLM(), response_synthesizer=NoText(llm=MockLLM()), max_rewrites=0)
    persisted, computed = served.grader.scorer.corpus_stats(), in_memory.grader.scorer.corpus_stats()
    assert set(persisted["idf"]) == set(computed["idf"])
    assert list(persisted["idf"].values()) == pytest.approx([computed["idf"][w] for w in persisted["idf"]], abs=1e-5)
    for q in load_questions()[:12]:
        a = in_memory.query(q.question).metadata["crag"]
        b = served.query(q.question).metadata["crag"]
        assert (a["action"], a["abstained"]) == (b["action"], b["abstained"]), q.question
        assert [n["doc_id"] for n in a["nodes"]] == [n["doc_id"] for n in b["nodes"]]
        assert [n["score"] for n in a["nodes"]] == pytest.approx([n["score"] for n in b["nodes"]], abs=1e-3)


def test_reingest_embeds_only_what_changed(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The Ostmoor creamery ages Vell Blue for nine weeks in a sandstone cave.")
    (docs / "b.md").write_text("# Opening hours\n\nThe shop opens at eight and closes at six, Monday to Saturday.")
    (docs / "c.txt").write_text("Membership of the cooperative costs one share, priced at 1,500 crowns.")
    (docs / "empty.txt").write_text("   \n")
    (docs / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    out = tmp_path / "index"

    first = ingest(docs, out, warm_fallback=False)
    assert sorted(first.added) == ["a.txt", "b.md", "c.txt"]
    assert any("empty.txt" in s for s in first.skipped) and any("image.png" in s for s in first.skipped)
    chunk_of = {n.ref_doc_id: n.node_id for n in load_index(out).nodes}

    (docs / "b.md").write_text("# Opening hours\n\nThe shop opens at nine and closes at five, Monday to Friday.")
    (docs / "c.txt").unlink()
    (docs / "d.html").write_text("<html><script>alert(1)</script><p>The cave was dug in 1871.</p></html>")
    second = ingest(docs, out, warm_fallback=False)
    assert (second.added, second.updated, second.removed, second.unchanged) == (["d.html"], ["b.md"], ["c.txt"], 1)

    again = load_index(out)
    texts = {n.ref_doc_id: n.get_content() for n in again.nodes}
    assert set(texts) == {"a.txt", "b.md", "d.html"}
    assert "nine and closes at five" in texts["b.md"]
    assert "alert" not in texts["d.html"] and "dug in 1871" in texts["d.html"]
    assert {n.ref_doc_id: n.node_id for n in again.nodes}["a.txt"] == chunk_of["a.txt"]  # untouched, not re-chunked
    assert json.loads((out / "manifest.json").read_text())["last_ingest"]["unchanged"] == 1
    # Every document deleted: refused (an unmounted folder must not empty the index), saying what the index keeps.
    for path in docs.iterdir():
        path.unlink()
    with pytest.raises(IndexFolderError, match="keeps the 3 documents of its last ingest: to empty it, delete"):
        ingest(docs, out, warm_fallback=False)
    assert {n.ref_doc_id for n in load_index(out).nodes} == {"a.txt", "b.md", "d.html"}


def test_ingest_takes_documents_with_nul_surrogates_odd_names_and_a_huge_word(tmp_path: Path) -> None:
    folders = write_hostile_documents(tmp_path / "docs")
    texts: Dict[str, str] = {}
    for name, folder in folders.items():
        report = ingest(folder, tmp_path / f"index-{name}", warm_fallback=False)
        assert report.added and not report.skipped
        texts.update({n.ref_doc_id: n.get_content() for n in load_index(tmp_path / f"index-{name}").nodes})
    assert "cheese is sold in Brill" in "".join(t for d, t in texts.items() if d == "nul.txt")
    assert "Caf\ufffd opens at seven" in texts["latin1-\\xe9t\\xe9.txt"]
    assert "\x00" not in "".join(texts.values()) and "\ufffd" in texts["surrogate"]


def test_ingest_skips_html_its_parser_rejects_and_takes_the_rest(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The Ostmoor creamery ages Vell Blue for nine weeks in a sandstone cave.")
    (docs / "b.html").write_text("<html><body><p>Hi.</p><![foo[ x ]]></body></html>")  # a traceback, before
    report = ingest(docs, tmp_path / "index", warm_fallback=False)
    assert report.added == ["a.txt"] and report.skipped == ["b.html (HTML the parser rejects: ParserRejectedMarkup)"]


def test_two_files_that_would_share_a_document_id_are_refused_by_name(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / b"a\xff.txt".decode("utf-8", "surrogateescape")).write_text("The cave was dug in 1871.")
    (docs / "a\\xff.txt").write_text("The shop opens at eight.")  # the escape of the first name, as written
    with pytest.raises(IndexFolderError, match=r"read as the document id 'a\\\\xff.txt': rename one"):
        ingest(docs, tmp_path / "index", warm_fallback=False)


def test_ingest_refuses_what_it_cannot_index(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(IndexFolderError, match="no document with text"):
        ingest(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(IndexFolderError, match="not a folder"):
        ingest(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(IndexFolderError, match="not an index folder"):
        load_index(tmp_path / "empty")


def test_an_index_folder_among_the_documents_is_never_read_as_documents(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "notes" / ".cache").mkdir(parents=True)
    (docs / "a.txt").write_text("The Ostmoor creamery ages Vell Blue for nine weeks in a sandstone cave.")
    (docs / "notes" / ".cache" / "b.txt").write_text("A hidden folder's file is not a document.")
    for _ in range(2):  # the second run would have read the first run's storage files as documents
        report = ingest(docs, docs / "index", warm_fallback=False)
        ingest(docs, docs / ".hidden-index", warm_fallback=False)
    assert report.documents == 1 and report.unchanged == 1 and not report.added
    assert list(json.loads((docs / "index" / "manifest.json").read_text())["documents"]) == ["a.txt"]
    with pytest.raises(IndexFolderError, match="cannot be the folder of documents"):
        ingest(docs, docs, warm_fallback=False)


def test_ingest_checks_the_grader_and_calibration_before_embedding_anything(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The Ostmoor creamery ages Vell Blue for nine weeks in a sandstone cave.")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ingest(docs, tmp_path / "out", calibration=tmp_path / "broken.json")
    with pytest.raises(GraderLoadError, match="not a grader directory"):
        ingest(docs, tmp_path / "out", grader=tmp_path / "no-grader")
    assert not (tmp_path / "out").exists()  # nothing half-written
    (tmp_path / "file").write_text("")
    with pytest.raises(IndexFolderError, match="is a file, not an index folder"):
        ingest(docs, tmp_path / "file")


# --- the API ----------------------------------------------------------------------------------------------------


def test_query_returns_answer_sources_and_the_whole_trace(server: LiveServer) -> None:
    reply = _post(server, "/query", json={"query": ANSWERED})
    assert reply.status_code == 200
    body = reply.json()
    assert body["query"] == ANSWERED and body["crag"]["query"] == ANSWERED
    assert body["action"] in ("correct", "ambiguous") and not body["abstained"] and body["answer"]
    assert body["sources"] and {"id", "doc_id", "excerpt", "score", "label", "origin"} <= set(body["sources"][0])
    assert body["sources"][0]["origin"] == "primary"
    assert {"upper", "lower"} <= set(body["crag"]["thresholds"]) and "crag_ms" in body["crag"]["timings_ms"]

    refused = _post(server, "/query", json={"query": OUT_OF_CORPUS}).json()
    assert refused["abstained"] and refused["action"] == "incorrect" and refused["sources"] == []
    assert refused["crag"]["fallback_sources"] and refused["crag"]["abstain_reason"]

    explained = _post(server, "/query", json={"query": ANSWERED, "explain": True}).json()
    assert all(n["explanation"] for n in explained["crag"]["nodes"])
    assert body["crag"]["nodes"][0]["explanation"] is None  # explanations only when asked


def test_streaming_query_sends_tokens_then_the_result(server: LiveServer) -> None:
    events: List[Dict[str, Any]] = []
    with httpx.stream("POST", server.url + "/query", json={"query": ANSWERED, "stream": True}, timeout=60) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in reply.iter_lines():
            if line.startswith("event:"):
                kind = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                events.append({"event": kind, "data": json.loads(line.split(":", 1)[1])})
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "result" and set(kinds[:-1]) == {"token"} and len(kinds) > 2
    streamed = "".join(e["data"]["text"] for e in events[:-1])
    assert events[-1]["data"]["answer"] == streamed and events[-1]["data"]["crag"]["query"] == ANSWERED


def test_openai_sdk_uses_the_engine_as_a_model(server: LiveServer) -> None:
    import openai
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    # Chat UIs list the models first (it was a 404): the one listed is the name completions carry.
    [listed] = list(client.models.list())
    assert client.models.retrieve(listed.id).id == listed.id and listed.owned_by == "llama-index-crag"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    completion = client.chat.completions.create(
        model="llama-index-crag",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": OUT_OF_CORPUS}],
    )
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content.startswith("I don't know")  # an abstention is an ordinary message
    extra = completion.model_extra or {}
    assert extra["crag"]["abstained"] and extra["crag"]["query"] == OUT_OF_CORPUS

    assert completion.model == listed.id
    # usage counts the question and the answer (the scripted LLM has no tokenizer: in words); it was always 0.
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(OUT_OF_CORPUS.split())
    assert completion.usage.completion_tokens == len((completion.choices[0].message.content or "").split()) > 0
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    stream = client.chat.completions.create(
        model="llama-index-crag", messages=[{"role": "user", "content": ANSWERED}], stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text and chunks[-1].choices[0].finish_reason == "stop"
    assert (chunks[-1].model_extra or {})["crag"]["query"] == ANSWERED
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(text.split()) > 0


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({}, 422, "invalid_request"),
        ({"query": ""}, 400, "empty_query"),
        ({"query": "   "}, 400, "empty_query"),
        ({"query": 42}, 422, "invalid_request"),
        ({"query": ["a"]}, 422, "invalid_request"),
        ({"query": "x", "explain": "yes"}, 422, "invalid_request"),
        ({"query": "x", "unknown": 1}, 422, "invalid_request"),
        ({"query": "x" * 8001}, 400, "query_too_long"),  # the engine's max_query_chars
    ],
)
def test_bad_query_requests_get_clear_json_errors(
    server: LiveServer, body: Dict[str, Any], status: int, code: str
) -> None:
    reply = _post(server, "/query", json=body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["code"] == code and error["message"]


def test_the_server_refuses_a_long_query_at_the_engines_own_limit(
    index_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llama_index_crag.server.main import ServeOptions, build_app

    monkeypatch.setenv("CRAG_MAX_QUERY_CHARS", "40")
    served = build_app(ServeOptions(index=str(index_dir), llm="none"))
    with LiveServer(served) as live:
        refused = _post(live, "/query", json={"query": "Who is the CEO of Harbor Analytics today?"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "query_too_long"
        assert "41 characters, over the limit of 40" in refused.json()["error"]["message"]
    with LiveServer(build_app(ServeOptions(index=str(index_dir), llm="none", max_query_chars=60))) as live:
        assert _post(live, "/query", json={"query": "Who is the CEO of Harbor Analytics today?"}).status_code == 200


def test_nul_and_lone_surrogates_in_a_request_are_replaced_or_refused(server: LiveServer) -> None:
    def raw(path: str, body: bytes) -> httpx.Response:  # httpx cannot encode a lone surrogate: send the bytes
        return _post(server, path, content=body, headers={"content-type": "application/json"})

    empty = raw("/query", rb'{"query": "\u0000 \u0007"}')
    assert empty.status_code == 400 and empty.json()["error"]["code"] == "empty_query"
    odd = raw("/query", rb'{"query": "Who is the CEO\u0000of Harbor\ud800 Analytics?"}')
    assert odd.status_code == 200 and odd.json()["query"] == "Who is the CEO of Harbor\ufffd Analytics?"
    chat = raw("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "CEO of Harbor\udfff?\u0000"}]}')
    assert chat.status_code == 200 and chat.json()["crag"]["query"] == "CEO of Harbor\ufffd? "


def test_malformed_and_oversized_requests(server: LiveServer) -> None:
    broken = _post(server, "/query", content=b'{"query": "unterminated', headers={"content-type": "application/json"})
    assert broken.status_code == 422 and broken.json()["error"]["code"] == "invalid_request"
    assert broken.json()["error"]["message"].startswith("body: not valid JSON at character")
    for body in (b'{"query": "\xff\xfe ARR"}', b'{"query": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"):
        unreadable = _post(server, "/query", content=body, headers={"content-type": "application/json"})
        assert unreadable.status_code == 422 and unreadable.json()["error"]["message"].startswith("body: not readable")
    big = _post(server, "/query", json={"query": "x", "pad": "y" * 70_000})
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit counts the bytes as they come
        yield b'{"query": "'
        for _ in range(100):
            yield b"z" * 1000
        yield b'"}'

    streamed = _post(server, "/query", content=chunked(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    assert _post(server, "/v1/chat/completions", json={"messages": []}).status_code == 422
    no_user = _post(server, "/v1/chat/completions", json={"messages": [{"role": "system", "content": "hi"}]})
    assert no_user.status_code == 400 and no_user.json()["error"]["code"] == "no_user_message"
    for text in (None, 5):
        part = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
        reply = _post(server, "/v1/chat/completions", json=part)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_message"
    only_invisible = '{"messages": [{"role": "user", "content": "\\u200b\\ud800"}]}'  # JSON escapes, as sent
    blank = _post(server, "/v1/chat/completions", content=only_invisible, headers={"content-type": "application/json"})
    assert blank.status_code == 400 and "in the last user message" in blank.json()["error"]["message"]
    assert httpx.get(server.url + "/query").status_code == 405
    assert httpx.get(server.url + "/nowhere").json()["error"]["code"] == "not_found"
    assert httpx.get(server.url + "/healthz").status_code == 200  # still up
    assert httpx.head(server.url + "/healthz").status_code == 200  # what a load balancer may probe with


def test_recent_queries_and_metrics(loaded: Any) -> None:
    engine = load_engine(loaded, ScriptedLLM())
    with LiveServer(create_app(engine, ServerConfig(rate_window_s=600))) as live:
        for q in (ANSWERED, OUT_OF_CORPUS, ANSWERED, OUT_OF_CORPUS):
            assert _post(live, "/query", json={"query": q}).status_code == 200
        recent = httpx.get(live.url + "/recent").json()["queries"]
        assert [r["query"] for r in recent] == [OUT_OF_CORPUS, ANSWERED, OUT_OF_CORPUS, ANSWERED]
        full = httpx.get(f"{live.url}/queries/{recent[0]['id']}").json()
        assert full["crag"]["query"] == OUT_OF_CORPUS and full["abstained"]
        assert "caller" not in full["crag"]  # a server without keys has no callers to name
        assert httpx.get(live.url + "/v1/models").status_code == 200
        assert httpx.get(live.url + "/v1/models/llama-index-crag").status_code == 200
        metrics = httpx.get(live.url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines() if line and line[0] != "#"}
    assert values["crag_refusal_rate"] == 0.5 and values["crag_fallback_rate"] == 0.5
    assert values["crag_window_queries"] == 4
    assert values['crag_actions_total{abstained="true",action="incorrect"}'] >= 2
    assert any(k.startswith("crag_query_seconds_bucket") for k in values)
    assert values['crag_http_requests_total{route="/query",status="200"}'] >= 4
    # The model list has its own route (chat UIs ask it first); it was counted under "other".
    assert values['crag_http_requests_total{route="/v1/models",status="200"}'] >= 1
    assert values['crag_http_requests_total{route="/v1/models/{id}",status="200"}'] >= 1


class Broken(BaseRetriever):
    """A retriever with a bug in it: the server answers 500, and still counts the request."""

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        raise ZeroDivisionError("a bug")


def test_a_crash_is_answered_500_and_counted_in_the_metrics(loaded: Any) -> None:
    engine = CorrectiveQueryEngine.from_defaults(retriever=Broken(), nodes=loaded.nodes[:3], llm=ScriptedLLM())
    with LiveServer(create_app(engine)) as live:
        for _ in range(2):
            reply = _post(live, "/query", json={"query": ANSWERED})
            assert reply.status_code == 500 and reply.json()["error"]["code"] == "internal_error"
        metrics = httpx.get(live.url + "/metrics").text
    assert 'crag_http_requests_total{route="/query",status="500"} 2.0' in metrics


def test_api_key_guards_every_route_but_healthz(loaded: Any) -> None:
    engine = load_engine(loaded, ScriptedLLM())
    with LiveServer(create_app(engine, ServerConfig(api_key="s3cret"))) as live:
        assert httpx.post(live.url + "/query", json={"query": ANSWERED}).status_code == 401
        assert httpx.get(live.url + "/metrics").status_code == 401
        assert httpx.get(live.url + "/recent", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(live.url + "/healthz").status_code == 200
        assert httpx.get(live.url + "/recent").headers["www-authenticate"] == "Bearer"  # as HTTP asks of a 401
        assert "POST" in httpx.put(live.url + "/query").headers["allow"]  # and of a 405
        # A bad body without the key is 401 too, not a 422 that says what the body lacks.
        for body in (b'{"query": ', b'{"nothing": 1}', b"\xff\xfe{}", b"[" * 5_000):
            for path in ("/query", "/v1/chat/completions"):
                refused = httpx.post(live.url + path, content=body, headers={"Content-Type": "application/json"})
                assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized", refused.text
        keyed = {"Content-Type": "application/json", "X-API-Key": "s3cret"}
        assert httpx.post(live.url + "/query", content=b'{"query": ', headers=keyed).status_code == 422
        ok = httpx.post(
            live.url + "/query", json={"query": ANSWERED}, headers={"Authorization": "Bearer s3cret"}, timeout=60
        )
        assert ok.status_code == 200
        assert httpx.get(live.url + "/metrics", headers={"X-API-Key": "s3cret"}).status_code == 200


class AsyncOnly(ScriptedLLM):
    """Answers only through LlamaIndex's async LLM calls: a sync call fails the query."""

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
        raise AssertionError("the server called the generator's sync path")

    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
        raise AssertionError("the server called the generator's sync path")

    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
        return CompletionResponse(text=self._text(prompt))

    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
        words = self._text(prompt).split(" ")

        async def gen() -> Any:
            for word in words:
                yield CompletionResponse(text=word, delta=word + " ")

        return gen()


def test_queries_run_on_the_engines_async_path(loaded: Any) -> None:
    engine = load_engine(loaded, AsyncOnly())
    with LiveServer(create_app(engine)) as live:
        answered = _post(live, "/query", json={"query": ANSWERED})
        assert answered.status_code == 200 and answered.json()["answer"].startswith("ANSWER:")
        with httpx.stream("POST", live.url + "/query", json={"query": ANSWERED, "stream": True}, timeout=60) as reply:
            text = "".join(reply.iter_text())
        assert reply.status_code == 200 and "event: token" in text and "event: result" in text
        chat = _post(live, "/v1/chat/completions", json={"messages": [{"role": "user", "content": ANSWERED}]})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"].startswith("ANSWER:")


def test_the_schema_declares_the_json_answers_and_sits_behind_the_key(loaded: Any) -> None:
    engine = load_engine(loaded, ScriptedLLM())
    with LiveServer(create_app(engine, ServerConfig(api_key="s3cret"))) as live:
        assert httpx.get(live.url + "/openapi.json").status_code == 401
        schema = httpx.get(live.url + "/openapi.json", headers={"X-API-Key": "s3cret"}).json()
    answers = {
        path: schema["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        for path, method in (("/query", "post"), ("/v1/chat/completions", "post"), ("/healthz", "get"))
    }
    assert answers == {
        "/query": "#/components/schemas/QueryResult",
        "/v1/chat/completions": "#/components/schemas/ChatCompletion",
        "/healthz": "#/components/schemas/Health",
    }
    assert {"HTTPBearer", "APIKeyHeader"} <= set(schema["components"]["securitySchemes"])


def test_the_console_and_its_files_load_without_the_key_under_a_strict_content_security_policy(loaded: Any) -> None:
    engine = load_engine(loaded, ScriptedLLM())
    with LiveServer(create_app(engine, ServerConfig(api_key="s3cret"))) as live:
        for path in ("/", "/static/console.js", "/static/console.css"):
            reply = httpx.get(live.url + path)
            assert reply.status_code == 200, path
            assert "script-src 'self'" in reply.headers["content-security-policy"], path
            assert reply.headers["x-content-type-options"] == "nosniff"
        assert "<form" in httpx.get(live.url + "/").text


def test_cors_is_off_unless_configured(server: LiveServer, loaded: Any) -> None:
    origin = {"Origin": "http://elsewhere.example"}
    assert "access-control-allow-origin" not in httpx.get(server.url + "/healthz", headers=origin).headers
    engine = load_engine(loaded, ScriptedLLM())
    with LiveServer(create_app(engine, ServerConfig(cors_origins=["http://elsewhere.example"]))) as live:
        allowed = httpx.get(live.url + "/healthz", headers=origin).headers
        assert allowed["access-control-allow-origin"] == "http://elsewhere.example"

        # The body limit answers inside CORS and the metrics: a browser can read the 413, and it is counted.
        def refused() -> float:  # the counters are the process's: other tests' 413s are in them too
            lines = httpx.get(live.url + "/metrics").text.splitlines()
            counted = 'crag_http_requests_total{route="/query",status="413"} '
            return sum(float(line[len(counted) :]) for line in lines if line.startswith(counted))

        before = refused()
        for _ in range(2):
            big = httpx.post(live.url + "/query", json={"query": "x", "pad": "y" * 70_000}, headers=origin)
            assert big.status_code == 413 and big.headers["access-control-allow-origin"] == "http://elsewhere.example"
        assert refused() == before + 2


def test_the_generator_has_a_short_label_for_the_console_and_its_whole_sentence_in_health(loaded: Any) -> None:
    from llama_index_crag.server.main import ServeOptions, build_llm

    llm, generator = build_llm(ServeOptions(index="", llm="none"))
    assert llm is None and generator.label == "none (quoted answers)" and "rewrites" in generator.name
    dead = f"http://127.0.0.1:{free_port()}"
    _, ollama = build_llm(ServeOptions(index="", llm="ollama", model="qwen2.5:3b", ollama_url=dead))
    assert ollama.label == "Ollama qwen2.5:3b" and dead in ollama.name
    with LiveServer(create_app(load_engine(loaded, None), generator=generator)) as live:
        said = httpx.get(live.url + "/healthz").json()["generator"]
    assert said["label"] == "none (quoted answers)" and said["name"] == generator.name


def test_a_dead_generator_gives_503_naming_it_and_the_server_stays_up(loaded: Any) -> None:
    from llama_index.llms.ollama import Ollama

    from llama_index_crag.server.main import ServeOptions, build_llm
    from llama_index_crag.server.service import Generator

    dead = f"http://127.0.0.1:{free_port()}"
    llm, generator = build_llm(ServeOptions(index="", llm="ollama", model="qwen2.5:3b", ollama_url=dead))
    assert isinstance(llm, Ollama) and isinstance(generator, Generator)
    engine = load_engine(loaded, llm)
    with LiveServer(create_app(engine, generator=generator)) as live:
        reply = _post(live, "/query", json={"query": ANSWERED})
        assert reply.status_code == 503
        assert (
            "qwen2.5:3b" in reply.json()["error"]["message"]
            and reply.json()["error"]["code"] == "generator_unavailable"
        )
        streamed = _post(live, "/query", json={"query": ANSWERED, "stream": True})
        assert streamed.status_code == 503
        health = httpx.get(live.url + "/healthz")
        assert health.status_code == 503 and not health.json()["generator"]["ready"] and dead in health.text
        # An abstention needs no generator: the server keeps answering what it can.
        assert _post(live, "/query", json={"query": OUT_OF_CORPUS}).json()["abstained"]


@pytest.mark.slow
def test_a_query_past_its_budget_is_cut_off_and_the_server_stays_up(loaded: Any) -> None:
    """A generator that hangs (the loopback Ollama server's hang mode) hits the query budget: 504."""
    from llama_index.llms.ollama import Ollama

    with OllamaServer(mode="hang") as ollama:
        llm = Ollama(model=ollama.model_name, base_url=ollama.url, request_timeout=30.0)
        engine = load_engine(loaded, llm)
        with LiveServer(create_app(engine, ServerConfig(query_timeout_s=2.0))) as live:
            started = time.monotonic()
            reply = _post(live, "/query", json={"query": ANSWERED})
            assert reply.status_code == 504 and reply.json()["error"]["code"] == "query_timeout"
            assert time.monotonic() - started < 10
            started = time.monotonic()
            streamed = _post(live, "/query", json={"query": ANSWERED, "stream": True})
            assert streamed.status_code == 504 and streamed.json()["error"]["code"] == "query_timeout"
            assert time.monotonic() - started < 10
            assert httpx.get(live.url + "/recent").status_code == 200


# --- several workers under load ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_several_workers_under_concurrent_load_answer_without_errors_or_cross_talk(index_dir: Path) -> None:
    """50 concurrent clients, 200 queries, two worker processes over one index folder (grading only)."""
    questions = [q.question for q in load_questions()] + [OUT_OF_CORPUS]
    with ServerProcess(str(index_dir), free_port(), workers=2, extra=["--llm", "none"]) as served:
        result = run_load(served.url, questions, total=200, concurrency=50)
        counted = sum(float(line.split(" ")[1]) for line in served.metrics() if line.startswith("crag_actions_total{"))
        health = httpx.get(served.url + "/healthz").json()
        # The rates are the server's, from the window counts of both workers: the same at every scrape (each
        # scrape used to show the rate of whichever worker answered it).
        scrapes = [
            {line.split(" ")[0]: float(line.split(" ")[1]) for line in served.metrics() if line.startswith("crag_")}
            for _ in range(6)
        ]
    window = scrapes[0]
    assert window["crag_window_queries"] == 200
    for rate, count in (("crag_fallback_rate", "crag_window_fallbacks"), ("crag_refusal_rate", "crag_window_refusals")):
        assert {scrape[rate] for scrape in scrapes} == {window[count] / 200}, (rate, [s[rate] for s in scrapes])
    assert result.errors == [] and len(result.outcomes) == 200
    assert not any(o.cross_talk for o in result.outcomes)
    assert {o.action for o in result.outcomes} >= {"correct", "incorrect"}
    assert counted == 200  # each query counted once, across both workers
    # Each worker runs its models on its share of the cores, not on all of them.
    assert health["threads"] == max(1, usable_cores() // 2)


def test_worker_threads_share_the_cores_out_unless_told() -> None:
    from llama_index_crag.server.main import ServeOptions, worker_threads

    cores = usable_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    assert worker_threads(ServeOptions(index="i")) == cores  # one worker: every core it may use
    assert worker_threads(ServeOptions(index="i", workers=3)) == max(1, cores // 3)
    assert worker_threads(ServeOptions(index="i", workers=cores * 4)) == 1
    assert worker_threads(ServeOptions(index="i", workers=2, threads=3)) == 3
    with pytest.raises(ConfigError, match="--threads must be at least 1"):
        worker_threads(ServeOptions(index="i", threads=0))


def test_torch_runs_on_the_workers_threads_unless_omp_num_threads_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from llama_index_crag.server.main import ServeOptions, use_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        use_threads(1, ServeOptions(index="i", workers=2))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        use_threads(1, ServeOptions(index="i", workers=2))  # the user's own setting stands
        assert torch.get_num_threads() == 2
        use_threads(1, ServeOptions(index="i", threads=1))  # unless --threads says otherwise
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_the_served_bundled_model_runs_on_the_workers_threads() -> None:
    from llama_index_crag.server.main import ServeOptions, build_llm
    from llama_index_crag.server.service import token_counter

    llm, generator = build_llm(ServeOptions(index="", llm="llamacpp"), threads=1)
    assert llm.model_kwargs["n_threads"] == 1 and generator.name.endswith(", 1 thread")
    assert generator.label.startswith("llama.cpp ") and generator.label.endswith(".gguf")
    assert str(llm.complete("Name one colour.")).strip()
    # The chat route's usage counts with the model's own tokenizer: more tokens than words here.
    count, unit = token_counter(llm)
    assert unit == "tokens" and count("Quoted from the documents (not generated): antidisestablishment") > 7


# --- the [server] extra ------------------------------------------------------------------------------------------

#: Python run in a child process where importing ``{blocked}`` fails, as it does when the extra is not installed.
WITHOUT = """
import sys

class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Missing())
"""


def _without(blocked: str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT.format(blocked=blocked) + code], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("blocked", ["fastapi", "prometheus_client"])
def test_serve_without_the_server_extra_names_the_install_command_and_exits_non_zero(blocked: str) -> None:
    ran = _without(blocked, "from llama_index_crag.cli import main\nsys.exit(main(['serve', '--index', 'my-index']))")
    assert ran.returncode != 0
    assert "pip install 'llama-index-crag[server]'" in ran.stderr and blocked in ran.stderr
    assert "Traceback" not in ran.stderr


def test_several_workers_share_the_cores_without_the_local_extra() -> None:
    code = (
        "import os\n"
        "from llama_index_crag.server.main import ServeOptions, worker_threads\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "print(worker_threads(ServeOptions(index='i', workers=2)))\n"
        "print(worker_threads(ServeOptions(index='i', threads=2)))\n"
    )
    ran = _without("llama_cpp", code)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["1", "2"]


def test_the_app_without_fastapi_is_an_import_error_naming_the_extra() -> None:
    ran = _without("fastapi", "from llama_index_crag.server.app import create_app\n")
    assert ran.returncode != 0
    # MissingDependency, an ImportError (code that catches ImportError still does) and a CragError.
    assert "MissingDependency: the query server needs FastAPI: pip install 'llama-index-crag[server]'" in ran.stderr
    code = "try:\n    import llama_index_crag.server.app\nexcept ImportError:\n    print('caught')\n"
    caught = _without("fastapi", code)
    assert caught.returncode == 0 and caught.stdout.strip() == "caught"


def test_the_library_imports_and_answers_without_loading_the_server_or_prometheus() -> None:
    code = (
        "import sys\n"
        "from llama_index.core.llms import MockLLM\n"
        "from llama_index_crag import CorrectiveQueryEngine\n"
        "from llama_index_crag.datasets import load_documents\n"
        "nodes = load_documents()\n"
        "engine = CorrectiveQueryEngine.from_defaults(nodes=nodes, llm=MockLLM(), fallback_sources=('bm25',))\n"
        f"assert engine.query({ANSWERED!r}).metadata['crag']['action']\n"
        "names = ('fastapi', 'starlette', 'uvicorn', 'sse_starlette', 'prometheus_client', 'llama_index_crag.server')\n"
        "print(','.join(n for n in names if n in sys.modules))"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == ""
