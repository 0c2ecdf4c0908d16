"""The server's keys carry a scope: two tenants over one index, each key reading only its own documents and history.

A real server (uvicorn on a loopback port) over a real engine (the bundled embedding, BM25 and sentence
windows) whose one index holds both tenants' documents. What globex's documents alone say (``GLOBEX_ONLY``)
must never reach acme's key: not in the answer, the sources, the trace, the stream, ``/recent`` or
``/queries/{id}``, whatever the request's own filters ask for.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, Iterator, List

import httpx
import pytest
from llama_index.core.schema import TextNode

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.server.app import create_app
from llama_index_crag.server.keys import KeysFileError, load_api_keys, parse_api_keys
from llama_index_crag.server.service import ServerConfig
from tests.conftest import ScriptedLLM
from tests.live_server import LiveServer

ACME_KEY = "k-acme-7Qv1c0mXW2pLr8sTq"
GLOBEX_KEY = "k-globex-Zr4nY9bKe6uHq3dA"
OPS_KEY = "k-ops-Hw2JvP0sLx7cNb5eRt"  # no filters: reads both tenants
KEYS = {
    ACME_KEY: {"name": "acme", "filters": {"tenant": "acme"}},
    # The same scope in MetadataFilters JSON, as LlamaIndex writes it.
    GLOBEX_KEY: {"name": "globex", "filters": {"filters": [{"key": "tenant", "value": "globex", "operator": "=="}]}},
    OPS_KEY: {"name": "ops"},
}
ACME_DOCS = [
    "Acme Corporation's chief executive officer is Marta Olsen, appointed in 2019.",
    "Acme Corporation has its headquarters in Rotterdam, beside the old harbour.",
    "Acme Corporation sells anvils, rocket skates and portable holes to desert customers.",
]
GLOBEX_DOCS = [
    "Globex Corporation's chief executive officer is Hank Scorpio, appointed in 1996.",
    "Globex Corporation has its headquarters in Cypress Creek, beside the hammock district.",
    "The Globex Corporation vault opens with the passphrase violet harrier seventeen.",
]
#: Words that only globex's documents hold: none may reach acme's key.
GLOBEX_ONLY = ("Scorpio", "Cypress", "harrier", "hammock", "globex-")
GLOBEX_QUESTION = "Who is the chief executive officer of Globex Corporation?"
ACME_QUESTION = "Who is the chief executive officer of Acme Corporation?"


def _nodes() -> List[TextNode]:
    nodes = []
    for tenant, texts in (("acme", ACME_DOCS), ("globex", GLOBEX_DOCS)):
        for i, text in enumerate(texts):
            doc_id = f"{tenant}-{i}"
            nodes.append(TextNode(id_=doc_id, text=text, metadata={"tenant": tenant, "doc_id": doc_id}))
    return nodes


@pytest.fixture(scope="module")
def engine(embed_model: Any) -> CorrectiveQueryEngine:
    return CorrectiveQueryEngine.from_defaults(nodes=_nodes(), llm=ScriptedLLM(), embed_model=embed_model)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    return path


@pytest.fixture(scope="module")
def server(engine: CorrectiveQueryEngine, keys_file: Path) -> Iterator[LiveServer]:
    with LiveServer(create_app(engine, ServerConfig(api_keys=load_api_keys(keys_file)))) as live:
        yield live


def _as(key: str) -> Dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _ask(server: LiveServer, key: str, question: str, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/query", json={"query": question, **body}, headers=_as(key), timeout=120)


def _leaks(text: str) -> List[str]:
    return [word for word in GLOBEX_ONLY if word.lower() in text.lower()]


def _stream(server: LiveServer, key: str, question: str, **body: Any) -> str:
    payload = {"query": question, "stream": True, **body}
    with httpx.stream("POST", server.url + "/query", json=payload, headers=_as(key), timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        return "".join(reply.iter_text())


# --- what a key reads ---------------------------------------------------------------------------------------------


def test_globex_reads_its_own_facts_and_an_unscoped_key_reads_both(server: LiveServer) -> None:
    """The facts are there to be found: a scope that did nothing would fail the tests below."""
    globex = _ask(server, GLOBEX_KEY, GLOBEX_QUESTION).json()
    assert not globex["abstained"] and "Scorpio" in json.dumps(globex)
    assert {s["doc_id"].split("-")[0] for s in globex["sources"]} == {"globex"}
    assert globex["crag"]["caller"] == "globex"
    ops = _ask(server, OPS_KEY, GLOBEX_QUESTION).json()
    assert "Scorpio" in json.dumps(ops)
    ops_acme = _ask(server, OPS_KEY, ACME_QUESTION).json()
    assert "Olsen" in json.dumps(ops_acme)


def test_acme_asking_globexs_facts_never_sees_globexs_text(server: LiveServer) -> None:
    for question in (GLOBEX_QUESTION, "Where are the Globex Corporation headquarters?", "What opens the Globex vault?"):
        reply = _ask(server, ACME_KEY, question, explain=True)
        assert reply.status_code == 200
        body = reply.json()
        assert _leaks(reply.text) == [], (question, body["answer"], body["sources"])
        assert all(s["doc_id"].startswith("acme-") for s in body["sources"])
        assert all(n["doc_id"].startswith("acme-") for n in body["crag"]["nodes"])
        assert body["crag"]["caller"] == "acme"
        streamed = _stream(server, ACME_KEY, question)
        assert "event: result" in streamed and _leaks(streamed) == []
    # What acme may read, it reads.
    own = _ask(server, ACME_KEY, ACME_QUESTION).json()
    assert not own["abstained"] and "Olsen" in json.dumps(own)


def test_a_split_questions_part_traces_hold_nothing_of_the_other_tenant(server: LiveServer) -> None:
    # The console draws each part's own trace from the stored query: every part's candidates, strips and sources
    # must stay in the key's scope, the part about the other tenant's facts included.
    question = (
        "Who is the chief executive officer of Acme Corporation, and where are the Globex Corporation headquarters?"
    )
    reply = _ask(server, ACME_KEY, question, explain=True)
    assert reply.status_code == 200
    body = reply.json()
    parts = body["crag"]["parts"]
    assert body["crag"]["split"]["parts"] == 2 and all(part["trace"]["nodes"] for part in parts)
    assert "Olsen" in parts[0]["answer"], "the part acme may read is answered"
    stored = httpx.get(f"{server.url}/queries/{body['id']}", headers=_as(ACME_KEY))
    streamed = _stream(server, ACME_KEY, question)
    assert [_leaks(reply.text), _leaks(stored.text), _leaks(streamed)] == [[], [], []]
    doc_ids = {n["doc_id"] for part in stored.json()["crag"]["parts"] for n in part["trace"]["nodes"]}
    assert doc_ids and all(d.startswith("acme-") for d in doc_ids)
    # Asked by the unscoped key, the same question's second part does read globex's page: the test can tell.
    assert "Cypress" in json.dumps(_ask(server, OPS_KEY, question).json()["crag"]["parts"][1])


def test_a_request_filter_narrows_the_keys_scope_and_never_widens_it(server: LiveServer) -> None:
    # acme's key asking for globex's tenant: the intersection admits nothing, so the engine abstains.
    for filters in (
        {"tenant": "globex"},
        {"tenant": ["acme", "globex"]},
        {"filters": [{"key": "tenant", "value": "globex"}]},
    ):
        reply = _ask(server, ACME_KEY, GLOBEX_QUESTION, filters=filters)
        assert reply.status_code == 200, reply.text
        assert _leaks(reply.text) == [], filters
        assert all(s["doc_id"].startswith("acme-") for s in reply.json()["sources"])
        assert _leaks(_stream(server, ACME_KEY, GLOBEX_QUESTION, filters=filters)) == []
    widened = _ask(server, ACME_KEY, GLOBEX_QUESTION, filters={"tenant": "globex"}).json()
    assert widened["abstained"] and widened["sources"] == []
    # A filter inside the scope narrows it: the unscoped key asks for acme alone.
    narrowed = _ask(server, OPS_KEY, GLOBEX_QUESTION, filters={"tenant": "acme"})
    assert _leaks(narrowed.text) == [] and all(s["doc_id"].startswith("acme-") for s in narrowed.json()["sources"])
    kept = _ask(server, GLOBEX_KEY, GLOBEX_QUESTION, filters={"tenant": "globex"}).json()
    assert "Scorpio" in json.dumps(kept)


@pytest.mark.parametrize(
    "filters",
    [
        {},  # narrows nothing: leave it out
        {"tenant": {"$eq": "acme"}},  # not a value
        {"tenant": []},
        {"filters": [{"key": "tenant", "value": "acme", "operator": "is about"}]},
        "tenant=acme",
        ["tenant", "acme"],
    ],
)
def test_malformed_request_filters_are_422_naming_the_field(server: LiveServer, filters: Any) -> None:
    reply = _ask(server, ACME_KEY, ACME_QUESTION, filters=filters)
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["message"].startswith("filters"), reply.json()
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": ACME_QUESTION}], "filters": filters},
        headers=_as(ACME_KEY),
        timeout=120,
    )
    assert chat.status_code == 422 and chat.json()["error"]["message"].startswith("filters"), chat.text


def test_the_chat_route_answers_within_the_scope_with_its_filters_at_the_top_level(server: LiveServer) -> None:
    from openai import OpenAI
    from openai.types.chat import ChatCompletionMessageParam

    acme = OpenAI(base_url=server.url + "/v1", api_key=ACME_KEY, max_retries=0)
    messages: List[ChatCompletionMessageParam] = [{"role": "user", "content": GLOBEX_QUESTION}]
    completion = acme.chat.completions.create(model="llama-index-crag", messages=messages)
    assert _leaks(completion.model_dump_json()) == []
    widened = acme.chat.completions.create(
        model="llama-index-crag", messages=messages, extra_body={"filters": {"tenant": "globex"}}
    )
    assert (widened.model_extra or {})["crag"]["abstained"] and _leaks(widened.model_dump_json()) == []
    chunks = list(acme.chat.completions.create(model="llama-index-crag", messages=messages, stream=True))
    assert _leaks("".join(c.model_dump_json() for c in chunks)) == []
    globex = OpenAI(base_url=server.url + "/v1", api_key=GLOBEX_KEY, max_retries=0)
    answered = globex.chat.completions.create(model="llama-index-crag", messages=messages)
    assert "Scorpio" in answered.model_dump_json()
    # OpenAI's metadata is a map of strings: filters there are refused, not ignored.
    refused = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": messages, "metadata": {"filters": {"tenant": "acme"}}},
        headers=_as(GLOBEX_KEY),
    )
    assert refused.status_code == 422 and "top level" in refused.json()["error"]["message"]


# --- whose history ------------------------------------------------------------------------------------------------


def test_each_key_sees_only_its_own_recent_queries(server: LiveServer) -> None:
    asked = _ask(server, GLOBEX_KEY, "Where are the Globex Corporation headquarters?").json()
    assert "Cypress" in json.dumps(asked)
    mine = _ask(server, ACME_KEY, "Where are the Acme Corporation headquarters?").json()

    acme_recent = httpx.get(server.url + "/recent", headers=_as(ACME_KEY))
    assert acme_recent.status_code == 200 and _leaks(acme_recent.text) == []
    acme_ids = [q["id"] for q in acme_recent.json()["queries"]]
    assert acme_ids[0] == mine["id"] and asked["id"] not in acme_ids
    assert httpx.get(f"{server.url}/queries/{mine['id']}", headers=_as(ACME_KEY)).json()["id"] == mine["id"]
    # Another key's query is not found, as an unknown id is not: its existence is not told either.
    foreign = httpx.get(f"{server.url}/queries/{asked['id']}", headers=_as(ACME_KEY))
    assert foreign.status_code == 404 and _leaks(foreign.text) == []

    globex_recent = httpx.get(server.url + "/recent", headers=_as(GLOBEX_KEY)).json()["queries"]
    globex_ids = [q["id"] for q in globex_recent]
    assert asked["id"] in globex_ids and not set(acme_ids) & set(globex_ids)
    assert httpx.get(f"{server.url}/queries/{mine['id']}", headers=_as(GLOBEX_KEY)).status_code == 404
    # The unscoped key is one more caller, with its own history: not everyone's.
    ops_ids = {q["id"] for q in httpx.get(server.url + "/recent", headers=_as(OPS_KEY)).json()["queries"]}
    assert not ops_ids & (set(acme_ids) | set(globex_ids))


def test_the_callers_name_is_logged_and_never_the_key_nor_in_the_metrics(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="llama_index_crag.server"):
        answered = _ask(server, ACME_KEY, ACME_QUESTION).json()
    said = [r.getMessage() for r in caplog.records if r.name == "llama_index_crag.server"]
    assert any(answered["id"] in line and "by acme" in line for line in said), said
    assert not any(key in line for line in said for key in KEYS)
    metrics = httpx.get(server.url + "/metrics", headers=_as(OPS_KEY)).text
    assert "acme" not in metrics and "globex" not in metrics


def test_keys_are_required_and_a_wrong_key_reads_nothing(server: LiveServer) -> None:
    for headers in ({}, _as("k-acme-7Qv1c0mXW2pLr8sT"), _as(ACME_KEY + "x"), {"X-API-Key": "nope"}):
        assert httpx.get(server.url + "/recent", headers=headers).status_code == 401
        assert httpx.post(server.url + "/query", json={"query": ACME_QUESTION}, headers=headers).status_code == 401
    assert httpx.get(server.url + "/recent", headers={"X-API-Key": GLOBEX_KEY}).status_code == 200


# --- the keys file ------------------------------------------------------------------------------------------------

GOOD = "k-aaaaaaaaaaaaaaaa"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("{", "is not valid JSON"),
        ("[]", "holds a JSON list, not an object"),
        ("{}", "holds no key"),
        (f'{{"{GOOD}": {{"name": "a"}}, "{GOOD}": {{"name": "b"}}}}', "one key appears twice"),
        ('{"s3cret": {"name": "a"}}', "is 6 characters; a key needs at least 16"),
        (f'{{"{GOOD} x": {{"name": "a"}}}}', "printable ASCII without spaces"),
        (f'{{"{GOOD}": {{"filters": {{"tenant": "acme"}}}}}}', 'has no "name"'),
        (f'{{"{GOOD}": {{"name": "  "}}}}', 'has no "name"'),
        (f'{{"{GOOD}": "acme"}}', "is a JSON str, not an object"),
        (f'{{"{GOOD}": {{"name": "a", "filter": {{"tenant": "acme"}}}}}}', "unknown field 'filter'"),
        (f'{{"{GOOD}": {{"name": "a", "filters": {{"tenant": {{"$eq": "acme"}}}}}}}}', "filters.tenant"),
        (f'{{"{GOOD}": {{"name": "a", "filters": {{}}}}}}', "narrows nothing"),
        (f'{{"{GOOD}": {{"name": "a", "filters": null}}}}', "leave filters out"),
        (
            f'{{"{GOOD}": {{"name": "a", "filters": {{"filters": [{{"key": "t", "operator": "~~"}}]}}}}}}',
            "MetadataFilters",
        ),
        (f'{{"{GOOD}": {{"name": "a", "filters": {{"tenant": "acme", "tenant": "globex"}}}}}}', "'tenant' twice"),
        (f'{{"{GOOD}": {{"name": "a", "name": "b"}}}}', "'name' twice"),
        (
            f'{{"{GOOD}": {{"name": "a", "filters": {{"t": 1}}}}, "{GOOD}b": {{"name": "a", "filters": {{"t": 2}}}}}}',
            "named 'a' with different filters",
        ),
    ],
)
def test_a_keys_file_that_cannot_be_used_is_refused_saying_why(text: str, said: str) -> None:
    with pytest.raises(KeysFileError) as refused:
        parse_api_keys(text)
    assert said in str(refused.value)
    assert GOOD not in str(refused.value) and "s3cret" not in str(refused.value)  # a message never quotes a key


def test_a_keys_file_reads_both_forms_of_filters_and_matches_keys() -> None:
    keys = parse_api_keys(json.dumps(KEYS))
    acme, globex, ops = (keys.caller(k) for k in (ACME_KEY, GLOBEX_KEY, OPS_KEY))
    assert acme and globex and ops and (acme.name, globex.name, ops.name) == ("acme", "globex", "ops")
    assert acme.scope.admits({"tenant": "acme"}) and not acme.scope.admits({"tenant": "globex"})
    assert globex.scope.admits({"tenant": "globex"}) and not globex.scope.admits({"tenant": "acme"})
    assert not ops.scope.bounded
    assert keys.caller(ACME_KEY[:-1]) is None and keys.caller("") is None
    # Two keys of one caller (a key being rotated) share its scope and its history.
    rotated = {GOOD: {"name": "a", "filters": {"t": 1}}, GOOD + "b": {"name": "a", "filters": {"t": 1}}}
    assert len(parse_api_keys(json.dumps(rotated)).callers) == 2


def test_serve_refuses_a_bad_keys_file_before_loading_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from llama_index_crag.cli import main

    monkeypatch.delenv("CRAG_API_KEY", raising=False)
    monkeypatch.delenv("CRAG_API_KEYS_FILE", raising=False)
    bad = tmp_path / "keys.json"
    bad.write_text('{"short": {"name": "a"}}')
    missing_index = str(tmp_path / "no-index")
    assert main(["serve", "--index", missing_index, "--api-keys", str(bad)]) == 2
    assert "keys.json" in (err := capsys.readouterr().err) and "needs at least 16" in err and "short" not in err
    monkeypatch.setenv("CRAG_API_KEYS_FILE", str(bad))  # the environment names it alike
    assert main(["serve", "--index", missing_index]) == 2
    assert "needs at least 16" in capsys.readouterr().err
    assert main(["serve", "--index", missing_index, "--api-keys", str(tmp_path / "absent.json")]) == 2
    assert "absent.json' cannot be read" in capsys.readouterr().err
    # A keys file and CRAG_API_KEY at once: which one holds would be a guess.
    good = tmp_path / "good.json"
    good.write_text(json.dumps(KEYS))
    monkeypatch.setenv("CRAG_API_KEY", "s3cret")
    assert main(["serve", "--index", missing_index, "--api-keys", str(good)]) == 2
    assert "CRAG_API_KEY" in (err := capsys.readouterr().err) and "s3cret" not in err


def test_a_key_scope_the_engine_cannot_apply_is_refused_when_the_app_is_built(engine: CorrectiveQueryEngine) -> None:
    from llama_index.core.base.base_retriever import BaseRetriever

    class Opaque(BaseRetriever):  # a retriever that takes no filters
        def _retrieve(self, query_bundle: Any) -> List[Any]:
            return []

    opaque = CorrectiveQueryEngine.from_defaults(retriever=Opaque(), nodes=_nodes(), llm=ScriptedLLM())
    keys = parse_api_keys(json.dumps({ACME_KEY: KEYS[ACME_KEY]}))
    with pytest.raises(KeysFileError, match="the key named 'acme' cannot be used"):
        create_app(opaque, ServerConfig(api_keys=keys))
