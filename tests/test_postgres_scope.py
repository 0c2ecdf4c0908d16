"""Scopes (metadata filters) over the PostgreSQL store: the SQL admits exactly what ``Scope.admits`` admits, every
store retriever searches inside its scope, and an engine scoped to one tenant never shows another tenant's text."""

from __future__ import annotations

import hashlib
import json
import random
import sys
from typing import Any, Dict, Iterator, List, Mapping, Set, Tuple

import numpy as np
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.schema import Document, NodeWithScore, QueryBundle, TextNode
from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters
from llama_index.core.vector_stores.utils import node_to_metadata_dict
from psycopg import sql
from psycopg.types.json import Jsonb

from llama_index_crag.core.persisted import engine_from_store
from llama_index_crag.core.store_parts import store_parts
from llama_index_crag.errors import ScopeError
from llama_index_crag.scope import Scope
from llama_index_crag.stores.postgres import (
    PostgresFullTextRetriever,
    PostgresSentenceWindowRetriever,
    PostgresStore,
    PostgresVectorRetriever,
    ingest,
)
from llama_index_crag.stores.postgres.filters import ASCII_FOLDS, LAYOUT_KEYS, MAX_EXACT_NUMBER, scope_sql
from llama_index_crag.stores.postgres.store import row_node
from tests.conftest import ENTRY_SETTINGS, EntryScorer, ScriptedLLM
from tests.pg_server import pg_url  # noqa: F401  (the session fixture)

# --- the translation: SQL against Scope.admits --------------------------------------------------------------------

KEYS = ["tenant", "year", "tags", "score", "flag", "doc_id", "missing"]
STRINGS = ["acme", "globex", "Acme", "ACME corp", "", "a", "b", "ab", "é", "É", "\u0130", "\u0130b", "ib", "i", "k"]
STRINGS += ["\u212a", "2023"]
NUMBERS: List[Any] = [0, 1, -1, 2, 3, 2023, 2024, 0.5, 1.0, 2023.0, -2.5, 1e-7, 0.1]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.choice(["str", "str", "num", "num", "bool", "none", "list", "list", "empty", "dict", "big"])
    if kind == "str":
        return rng.choice(STRINGS)
    if kind == "num":
        return rng.choice(NUMBERS)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "empty":
        return rng.choice(["", []])
    if kind == "big":
        return rng.choice([2**60, -(2**60), 2**53 + 1, 1e20, 1.2345678901234567e20])
    if kind == "dict":
        return {rng.choice(["acme", "a", "b", "1"]): rng.choice([1, "x"])}
    if depth > 0:
        return rng.choice(STRINGS)
    pool = rng.choice(["str", "num", "mixed"])
    items = []
    for _ in range(rng.randint(0, 3)):
        if pool == "str":
            items.append(rng.choice(STRINGS))
        elif pool == "num":
            items.append(rng.choice(NUMBERS))
        else:
            items.append(_random_value(rng, depth + 1))
    return items


def _random_rows(count: int, seed: int = 55) -> List[Dict[str, Any]]:
    rng = random.Random(seed)
    rows: List[Dict[str, Any]] = [{}, {"tenant": "acme"}, {"tenant": "globex", "year": 2024}, {"flag": True}]
    rows.append({"tags": ["a", "b"]})
    while len(rows) < count:
        rows.append({k: _random_value(rng) for k in KEYS[:-1] if rng.random() < 0.55})
    return rows


@pytest.fixture(scope="module")
def metadata_tables(pg_url: str) -> Iterator[Tuple[psycopg.Connection[Any], Dict[str, List[Mapping[str, Any]]]]]:  # noqa: F811
    """Two tables of the same random metadata, one in the chunks' layout and one in the windows', and the metadata
    each row's node carries when a retriever returns it (what the engine's ``Scope.keep`` reads)."""
    rows = _random_rows(300)
    conn = psycopg.connect(pg_url, autocommit=True)
    read: Dict[str, List[Mapping[str, Any]]] = {}
    for table in ("chunks", "windows"):
        conn.execute(f"DROP TABLE IF EXISTS scope_{table}")
        conn.execute(f"CREATE TABLE scope_{table} (id INTEGER PRIMARY KEY, metadata_ JSONB)")
        stored = [
            node_to_metadata_dict(TextNode(id_=f"n{i}", text="", metadata=m), remove_text=True)
            if table == "chunks"
            else m
            for i, m in enumerate(rows)
        ]
        conn.cursor().executemany(
            f"INSERT INTO scope_{table} (id, metadata_) VALUES (%s, %s)", [(i, Jsonb(m)) for i, m in enumerate(stored)]
        )
        back = conn.execute(f"SELECT metadata_ FROM scope_{table} ORDER BY id").fetchall()
        read[table] = [row_node("", m).metadata if table == "chunks" else dict(m) for (m,) in back]
    yield conn, read
    conn.close()


def _admitted(conn: psycopg.Connection[Any], table: str, scope: Scope) -> Set[int]:
    compiled = scope_sql(scope, table)
    query = sql.SQL("SELECT id FROM {} WHERE {}").format(sql.Identifier(f"scope_{table}"), compiled.clause)
    return {row[0] for row in conn.execute(query, compiled.params)}


def _leaves(filters: MetadataFilters) -> Iterator[MetadataFilter]:
    for f in filters.filters:
        if isinstance(f, MetadataFilters):
            yield from _leaves(f)
        else:
            yield f


def _untranslatable(filters: MetadataFilters) -> bool:
    """Whether a filter is one the translation must refuse (``ScopeError``) rather than approximate."""
    for f in _leaves(filters):
        ordering = f.operator in (FilterOperator.GT, FilterOperator.GTE, FilterOperator.LT, FilterOperator.LTE)
        if ordering and isinstance(f.value, list):
            return True
        if f.operator == FilterOperator.TEXT_MATCH_INSENSITIVE and isinstance(f.value, str) and not f.value.isascii():
            return True
    return False


_numbers = st.one_of(
    st.sampled_from(NUMBERS),
    st.integers(-5, 2030),
    st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: abs(x) < MAX_EXACT_NUMBER),
)
_strings = st.one_of(st.sampled_from(STRINGS), st.text(alphabet="abAB é\u0130", max_size=3))
_values = st.one_of(
    st.none(),
    _strings,
    _numbers,
    st.lists(_strings, max_size=3),
    st.lists(st.sampled_from(NUMBERS), max_size=3),
    st.lists(st.integers(-2, 3), max_size=3),
)


@st.composite
def _leaf(draw: st.DrawFn) -> MetadataFilter:
    return MetadataFilter.model_construct(
        key=draw(st.sampled_from(KEYS)), value=draw(_values), operator=draw(st.sampled_from(list(FilterOperator)))
    )


_conditions = st.sampled_from([FilterCondition.AND, FilterCondition.OR, FilterCondition.NOT])
_filters = st.recursive(
    st.builds(lambda f: MetadataFilters(filters=[f]), _leaf()),
    lambda children: st.builds(
        lambda parts, condition: MetadataFilters(filters=parts, condition=condition),
        st.lists(st.one_of(children, _leaf()), min_size=0, max_size=3),
        _conditions,
    ),
    max_leaves=6,
)


@settings(
    max_examples=300,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(filters=_filters)
def test_the_sql_admits_exactly_the_rows_the_scope_admits(
    metadata_tables: Tuple[psycopg.Connection[Any], Dict[str, List[Mapping[str, Any]]]], filters: MetadataFilters
) -> None:
    conn, read = metadata_tables
    scope = Scope(filters)
    for table in ("chunks", "windows"):
        if _untranslatable(filters):
            with pytest.raises(ScopeError):
                scope_sql(scope, table)
            return
        wanted = {i for i, metadata in enumerate(read[table]) if scope.admits(metadata)}
        assert _admitted(conn, table, scope) == wanted, (table, filters.model_dump_json())


def _uniform_leaf(rng: random.Random) -> MetadataFilter:
    """A filter with every operator and every kind of value equally likely (hypothesis favours some)."""
    operator = rng.choice(list(FilterOperator))
    kind = rng.choice(["none", "str", "num", "strs", "nums", "empty", "emptystr"])
    value: Any = {
        "none": None,
        "str": rng.choice(STRINGS),
        "num": rng.choice(NUMBERS),
        "strs": rng.sample(STRINGS, rng.randint(1, 3)),
        "nums": rng.sample(NUMBERS, rng.randint(1, 3)),
        "empty": [],
        "emptystr": "",
    }[kind]
    return MetadataFilter.model_construct(key=rng.choice(KEYS), value=value, operator=operator)


def _uniform_filters(rng: random.Random, depth: int = 0) -> MetadataFilters:
    parts: List[Any] = []
    for _ in range(rng.randint(1 if depth == 0 else 0, 3)):
        parts.append(_uniform_filters(rng, depth + 1) if depth < 2 and rng.random() < 0.3 else _uniform_leaf(rng))
    return MetadataFilters(filters=parts, condition=rng.choice(list(FilterCondition)))


def test_the_sql_admits_what_the_scope_admits_for_every_operator_and_kind_of_value(
    metadata_tables: Tuple[psycopg.Connection[Any], Dict[str, List[Mapping[str, Any]]]],
) -> None:
    conn, read = metadata_tables
    rng = random.Random(2055)
    checked = 0
    while checked < 600:
        filters = _uniform_filters(rng)
        if _untranslatable(filters):
            continue
        scope = Scope(filters)
        for table in ("chunks", "windows"):
            wanted = {i for i, metadata in enumerate(read[table]) if scope.admits(metadata)}
            assert _admitted(conn, table, scope) == wanted, (table, filters.model_dump_json())
        checked += 1


@pytest.mark.parametrize(
    ("leaf", "admits", "refuses"),
    [
        # True == 1 in Python, and a JSON boolean is compared as such
        (MetadataFilter(key="v", value=1), [{"v": True}, {"v": 1.0}], [{"v": "1"}, {"v": [1]}, {}]),
        # a missing key or null admits only NE / NIN / IS_EMPTY
        (MetadataFilter(key="v", value="a", operator="!="), [{}, {"v": None}, {"v": "b"}, {"v": 3}], [{"v": "a"}]),
        (MetadataFilter(key="v", value=["a"], operator="nin"), [{}, {"v": "b"}, {"v": ["a"]}], [{"v": "a"}]),
        (MetadataFilter(key="v", value=None, operator="is_empty"), [{}, {"v": ""}, {"v": []}], [{"v": 0}]),
        # a comparison that cannot be made admits nothing
        (MetadataFilter(key="v", value=5, operator=">"), [{"v": 6}, {"v": 5.5}], [{"v": "9"}, {}, {"v": True}]),
        (MetadataFilter(key="v", value="b", operator="<"), [{"v": "B"}, {"v": "a"}], [{"v": 1}, {"v": "é"}]),
        # substrings, elements and keys
        (MetadataFilter(key="v", value="cm", operator="in"), [{"v": "c"}, {"v": ""}], [{"v": "x"}, {"v": 1}]),
        (
            MetadataFilter(key="v", value="a", operator="contains"),
            [{"v": "ab"}, {"v": ["a"]}, {"v": {"a": 1}}],
            [{"v": 1}, {"v": ["ab"]}],
        ),
        (MetadataFilter(key="v", value=["x", "y"], operator="all"), [{"v": "yx"}, {"v": ["y", "x", 1]}], [{"v": 1}]),
        (MetadataFilter(key="v", value=[], operator="all"), [{"v": 1}, {"v": "x"}], [{}, {"v": None}]),
        (MetadataFilter(key="v", value=[2], operator="any"), [{"v": [2.0]}, {"v": [True, 2]}], [{"v": "2"}]),
        # Python's lower(): U+0130 becomes "i" and a combining dot, the Kelvin sign "k"
        (
            MetadataFilter(key="v", value="KI", operator="text_match_insensitive"),
            [{"v": "\u212a\u0130"}, {"v": "xkiy"}],
            [{"v": "k\u0307i"}, {"v": "\u0130\u212a"}],
        ),
        (MetadataFilter(key="v", value="IX", operator="text_match_insensitive"), [{"v": "aIxa"}], [{"v": "\u0130x"}]),
        # integers past 2**53 are ordered right against the numbers a filter may hold
        (MetadataFilter(key="v", value=2**52, operator=">"), [{"v": 2**60}, {"v": 2**53 + 1}], [{"v": -(2**60)}]),
        # the layout's doc_id is not the node's: the node's own is read
        (MetadataFilter(key="doc_id", value="mine"), [{"doc_id": "mine"}], [{"other": 1}]),
    ],
)
def test_each_operator_keeps_pythons_meaning_at_its_edges(
    pg_url: str,  # noqa: F811
    leaf: MetadataFilter,
    admits: List[Dict[str, Any]],
    refuses: List[Dict[str, Any]],
) -> None:
    scope = Scope(MetadataFilters(filters=[leaf]))
    rows = admits + refuses
    assert [scope.admits(r) for r in rows] == [True] * len(admits) + [False] * len(refuses)  # the reference
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for table in ("chunks", "windows"):
            stored = [
                node_to_metadata_dict(TextNode(text="", metadata=m), remove_text=True) if table == "chunks" else m
                for m in rows
            ]
            compiled = scope_sql(scope, table)
            query = sql.SQL("SELECT {} FROM (SELECT %(row)s::jsonb AS metadata_) r")
            got = [
                conn.execute(query.format(compiled.clause), {**compiled.params, "row": Jsonb(m)}).fetchone()[0]  # type: ignore[index]
                for m in stored
            ]
            assert got == [True] * len(admits) + [False] * len(refuses), table


def test_the_non_ascii_letters_python_lowers_to_ascii_are_all_folded() -> None:
    found = {}
    for code in range(0x80, sys.maxunicode + 1):
        lowered = chr(code).lower()
        if any(ord(c) < 0x80 for c in lowered):
            found[chr(code)] = lowered
    assert found == ASCII_FOLDS


_DICT_VALUE = MetadataFilter.model_construct(key="when", value={"after": 1}, operator=FilterOperator.EQ)  # type: ignore[arg-type]
_UNKNOWN_OPERATOR = MetadataFilter.model_construct(key="x", value=1, operator="between")  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore::UserWarning")  # pydantic, on dumping the malformed filters built here
@pytest.mark.parametrize(
    ("leaf", "words"),
    [
        (MetadataFilter(key="year", value=[2023, 2024], operator=">"), "compares lists"),
        (MetadataFilter(key="tenant", value="Ärger", operator="text_match_insensitive"), "case-insensitive"),
        (MetadataFilter(key="id", value=2**53, operator="=="), "exactly"),
        (_DICT_VALUE, "type dict"),
        (MetadataFilter.model_construct(key="flag", value=True, operator=FilterOperator.EQ), "type bool"),
        (_UNKNOWN_OPERATOR, "unknown operator"),
    ],
)
def test_a_filter_postgresql_cannot_apply_exactly_is_refused_when_the_retriever_is_built(
    leaf: MetadataFilter, words: str
) -> None:
    scope = Scope(MetadataFilters(filters=[MetadataFilter(key="tenant", value="acme"), leaf]))
    store = PostgresStore("postgresql://crag@127.0.0.1:1/none")  # never connected: the build refuses first
    for build in (
        lambda: PostgresVectorRetriever(store, _HashEmbedding(), 5, scope=scope),
        lambda: PostgresSentenceWindowRetriever(store, _HashEmbedding(), 5, scope=scope),
        lambda: PostgresFullTextRetriever(store, 5, scope=scope),
        lambda: PostgresFullTextRetriever(store, 5).scoped(scope),
    ):
        with pytest.raises(ScopeError, match=words):
            build()


def test_values_travel_as_parameters_never_as_sql_text() -> None:
    hostile = "acme'); DROP TABLE data_crag; --"
    compiled = scope_sql(Scope.of({"tenant": hostile, "year": [2023, 2024]}), "chunks")
    text = compiled.clause.as_string(None)
    assert hostile not in text and "DROP" not in text and "2023" not in text
    assert hostile in compiled.params.values()
    assert not LAYOUT_KEYS & {"tenant", "year"}


# --- the retrievers and the engine, two tenants in one store ------------------------------------------------------


ACME = [
    (
        "acme/leadership.txt",
        "Acme Rockets is led by chief executive Wilhelmina Quarterfield. She founded the company in Tucson in 1998. "
        "Acme Rockets builds reusable launch vehicles for small satellites. The company employs four hundred people. "
        "Its board meets in Tucson every spring to review the launch schedule.",
    ),
    (
        "acme/fuel.txt",
        "Acme Rockets fuels its engines with a kerosene blend called Tumbleweed-9. The blend is refined in Phoenix. "
        "Each launch burns about forty tonnes of Tumbleweed-9. Engineers test every batch before it is loaded.",
    ),
    (
        "acme/launches.txt",
        "The first Acme Rockets launch took place in March 2003 from a pad near Tucson. The rocket carried a weather "
        "satellite. Since then Acme Rockets has flown sixty missions. Two of them failed during the second stage burn.",
    ),
    (
        "acme/offices.txt",
        "Acme Rockets has offices in Tucson, Phoenix and Denver. The Denver office designs guidance software. "
        "The Phoenix office runs the fuel refinery. Visitors to the Tucson office can tour the assembly hall.",
    ),
]
GLOBEX = [
    (
        "globex/leadership.txt",
        "Globex Corporation is led by chief executive Hank Scorpiozzi. He moved the headquarters to Marrowfield "
        "in 2011. Globex Corporation builds fusion reactors for cities. Scorpiozzi chairs the board of directors.",
    ),
    (
        "globex/coolant.txt",
        "Globex reactors are cooled with a liquid salt called Quenchwater. Quenchwater is mixed at the Marrowfield "
        "plant. Each Globex reactor holds twelve tonnes of Quenchwater. The recipe is a trade secret.",
    ),
    (
        "globex/projects.txt",
        "The Globex reactor project code-named GX-7741 will power the city of Marrowfield from 2027. The GX-7741 "
        "reactor cost nine billion dollars. Construction of GX-7741 began in the autumn of 2021.",
    ),
]
#: Words that appear only in globex's documents and in none of the questions or rewrites asked below.
GLOBEX_SECRETS = ["Scorpiozzi", "Quenchwater", "GX-7741", "Marrowfield", "Hank"]
ACME_ONLY = {"tenant": "acme"}


def _documents() -> List[Document]:
    documents = []
    for tenant, items in (("acme", ACME), ("globex", GLOBEX)):
        for i, (doc_id, text) in enumerate(items):
            metadata = {"tenant": tenant, "year": 2020 + i, "tags": [tenant, "handbook"], "updated": "2024-05-01"}
            documents.append(
                Document(
                    id_=doc_id,
                    text=text,
                    metadata=metadata,
                    excluded_embed_metadata_keys=list(metadata),
                    excluded_llm_metadata_keys=list(metadata),
                )
            )
    return documents


@pytest.fixture(scope="module")
def tenant_store(pg_url: str, embed_model: Any) -> Iterator[PostgresStore]:  # noqa: F811
    store = PostgresStore(pg_url, table="tenants")
    ingest(_documents(), store, embed_model)
    yield store
    store.close()


def _leaks(*things: Any) -> List[str]:
    """The globex secrets found in the JSON of ``things`` (answers, nodes, traces)."""
    text = json.dumps([_plain(t) for t in things], default=str, ensure_ascii=False)
    return [s for s in GLOBEX_SECRETS if s.lower() in text.lower()]


def _plain(thing: Any) -> Any:
    if isinstance(thing, NodeWithScore):
        return {"text": thing.node.get_content(), "metadata": thing.node.metadata, "score": thing.score}
    if isinstance(thing, list):
        return [_plain(t) for t in thing]
    if hasattr(thing, "source_nodes"):
        return {"answer": str(thing), "sources": _plain(list(thing.source_nodes)), "metadata": thing.metadata}
    return thing


def test_ingest_stores_each_documents_metadata_on_its_chunks_and_windows(tenant_store: PostgresStore) -> None:
    with tenant_store.connection() as conn:
        for part in ("chunks", "windows"):
            rows = conn.execute(
                f"SELECT metadata_->>'tenant', metadata_->'year', metadata_->'tags', metadata_->>'updated' "
                f"FROM {tenant_store.name(part)}"
            ).fetchall()
            assert rows and {r[0] for r in rows} == {"acme", "globex"}, part
            assert all(isinstance(r[1], int) and r[2][1] == "handbook" and r[3] == "2024-05-01" for r in rows), part
        indexes = {r[0] for r in conn.execute("SELECT indexdef FROM pg_indexes WHERE indexdef LIKE '%jsonb_path_ops%'")}
    assert {any(tenant_store.name(p).split(".")[1] in i for i in indexes) for p in ("chunks", "windows")} == {True}


@pytest.mark.parametrize("kind", ["vector", "windows", "fulltext"])
def test_each_store_retriever_searches_inside_its_scope_and_finds_k_there(
    tenant_store: PostgresStore, embed_model: Any, kind: str
) -> None:
    def build(scope: Any = None) -> BaseRetriever:
        if kind == "vector":
            return PostgresVectorRetriever(tenant_store, embed_model, 3, scope=scope)
        if kind == "windows":
            return PostgresSentenceWindowRetriever(tenant_store, embed_model, 3, scope=scope)
        return PostgresFullTextRetriever(tenant_store, 3, scope=scope)

    question = "Globex Corporation chief executive reactor coolant Marrowfield plant Tucson launch"
    unscoped = build().retrieve(question)
    assert _leaks(unscoped), "the question should reach globex's passages without a scope"
    scoped = build(Scope.of(ACME_ONLY)).retrieve(question)
    assert len(scoped) == len(unscoped) and not _leaks(scoped)
    assert {h.node.metadata["tenant"] for h in scoped} == {"acme"}
    narrowed = build().scoped(Scope.of(ACME_ONLY))  # type: ignore[attr-defined]
    assert narrowed.scope.bounded and not _leaks(narrowed.retrieve(question))
    assert narrowed.scoped(ACME_ONLY) is narrowed  # the same scope again narrows nothing
    twice = narrowed.scoped({"year": 2021})
    assert {(h.node.metadata["tenant"], h.node.metadata["year"]) for h in twice.retrieve(question)} == {("acme", 2021)}


QUESTIONS_ABOUT_GLOBEX = [
    "Who is the chief executive of Globex Corporation?",
    "What liquid cools the Globex reactors?",
    "Which city will the Globex reactor project power from 2027?",
]


@pytest.mark.parametrize("sources", [("fulltext", "sentence_window"), ("fulltext",), ("sentence_window",)])
def test_an_engine_scoped_to_acme_never_shows_globex_text_on_any_branch(
    tenant_store: PostgresStore, embed_model: Any, sources: Tuple[str, ...]
) -> None:
    # The rewrite names globex's words, so the INCORRECT branch's searches would find its passages unscoped.
    llm = ScriptedLLM(rewrite='{"query": "Globex Corporation reactor coolant salt plant city power"}')
    open_engine = engine_from_store(tenant_store, llm, embed_model=embed_model, fallback_sources=sources)
    acme = engine_from_store(tenant_store, llm, embed_model=embed_model, fallback_sources=sources, filters=ACME_ONLY)
    actions = []
    for question in QUESTIONS_ABOUT_GLOBEX:
        assert _leaks(open_engine.query(question)), "unscoped, the engine should answer from globex's passages"
        response = acme.query(question)
        trace = response.metadata["crag"]  # type: ignore[index]
        actions.append(trace["action"])
        assert not _leaks(response), (question, trace)
        assert all(n.node.metadata.get("tenant") == "acme" for n in response.source_nodes)
    assert "incorrect" in actions, actions  # the fallback's searches ran, inside the scope
    own = acme.query("Who is the chief executive of Acme Rockets?")
    assert not own.metadata["crag"]["abstained"]  # type: ignore[index]
    assert "Quarterfield" in json.dumps(_plain(own), default=str) and not _leaks(own)


def test_the_search_for_the_asked_entry_by_name_keeps_to_the_scope_in_postgresql(
    pg_url: str,  # noqa: F811
    embed_model: Any,
) -> None:
    # Acme's page holds a neighbour's entry that names the asked setting; only Globex's holds the setting's own.
    pages = [
        (
            "acme/vat.html",
            "acme",
            "#### vat_min_age (integer)\n\nThe youngest age at which a cheese leaves the vat. The default is 50 days, "
            "at most half the value of vat_max_age.",
        ),
        (
            "globex/vat.html",
            "globex",
            "#### vat_max_age (integer)\n\nThe oldest age a cheese may reach in the vat. The default is 200 days at "
            "Marrowfield.",
        ),
    ]
    store = PostgresStore(pg_url, table="entries")
    try:
        ingest([Document(id_=d, text=t, metadata={"tenant": tenant}) for d, tenant, t in pages], store, embed_model)
        settings: Dict[str, Any] = {"scorer": EntryScorer(), **ENTRY_SETTINGS}
        question = "What is the default value of vat_max_age?"
        unscoped = engine_from_store(store, None, embed_model=embed_model, **settings).query(question)
        searched = unscoped.metadata["crag"]  # type: ignore[index]
        assert searched["entry_search"] == "vat_max_age" and _leaks(unscoped), searched  # the path, unbounded
        acme = engine_from_store(store, None, embed_model=embed_model, filters=ACME_ONLY, **settings)
        response = acme.query(question)
        trace = response.metadata["crag"]  # type: ignore[index]
        assert trace["entry_search"] == "vat_max_age" and trace["abstained"], trace["abstain_reason"]
        assert not _leaks(response), trace
    finally:
        store.close()


async def test_the_async_engine_keeps_the_scope_too(tenant_store: PostgresStore, embed_model: Any) -> None:
    llm = ScriptedLLM(rewrite='{"query": "Globex Corporation reactor coolant salt plant"}')
    acme = engine_from_store(tenant_store, llm, embed_model=embed_model, filters=ACME_ONLY)
    for question in QUESTIONS_ABOUT_GLOBEX:
        assert not _leaks(await acme.aquery(question)), question


def test_a_filter_the_store_cannot_apply_stops_the_engine_being_built(
    tenant_store: PostgresStore, embed_model: Any
) -> None:
    refused = MetadataFilters(filters=[MetadataFilter(key="year", value=[2021, 2022], operator=FilterOperator.GT)])
    with pytest.raises(ScopeError, match="year"):
        engine_from_store(tenant_store, ScriptedLLM(), embed_model=embed_model, filters=refused)


class _Custom(BaseRetriever):
    """A retriever whose scope cannot be read: returns acme's fuel passage for every query."""

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text=ACME[1][1], metadata={"tenant": "acme"}), score=0.9)]


def test_a_given_retriever_is_used_never_replaced_and_the_fallback_keeps_to_what_is_known(
    tenant_store: PostgresStore, embed_model: Any
) -> None:
    acme = Scope.of(ACME_ONLY)
    parts = store_parts(tenant_store, embed_model, scope=acme)  # no retriever given: every one built is scoped
    built = [parts.retriever, *parts.fallback.retrievers.values()]  # type: ignore[attr-defined]
    assert len(built) == 3 and all(r.scope.key == acme.key for r in built)

    custom = _Custom()
    parts = store_parts(tenant_store, embed_model, retriever=custom)
    assert parts.retriever is custom
    assert dict(parts.fallback.retrievers) == {"primary": custom}  # type: ignore[attr-defined]

    parts = store_parts(tenant_store, embed_model, retriever=custom, scope=acme)
    assert parts.retriever is custom
    fallback = dict(parts.fallback.retrievers)  # type: ignore[attr-defined]
    assert set(fallback) == {"fulltext", "sentence_window"}
    assert all(r.scope.key == acme.key for r in fallback.values())

    own = PostgresVectorRetriever(tenant_store, embed_model, 3, scope=acme)
    parts = store_parts(tenant_store, embed_model, retriever=own, scope=Scope.of({"year": 2021}))
    assert parts.retriever is own
    for retriever in parts.fallback.retrievers.values():  # type: ignore[attr-defined]
        hits = retriever.retrieve("Globex Corporation reactor coolant Tucson launch offices")
        assert hits and {(h.node.metadata["tenant"], h.node.metadata["year"]) for h in hits} == {("acme", 2021)}

    engine = engine_from_store(tenant_store, ScriptedLLM(), embed_model=embed_model, retriever=custom)
    response = engine.query("What fuel do Acme Rockets burn?")
    assert "Tumbleweed-9" in json.dumps(_plain(response), default=str)


# --- k inside a narrow scope, whichever way the search goes ---------------------------------------------------------


class _HashEmbedding(BaseEmbedding):
    """Deterministic unit vectors from a text's hash (a store of hundreds of chunks in a second)."""

    def __init__(self) -> None:
        super().__init__(model_name="hash-embedding", embed_batch_size=256)

    @staticmethod
    def _vector(text: str) -> Embedding:
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        v = np.random.default_rng(seed).standard_normal(384)
        return [float(x) for x in v / np.linalg.norm(v)]

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return self._vector(query)

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._vector(text)


class _IndexOnly(PostgresStore):
    """A store whose connections never scan a table whole, and (``iterative=False``) stop an HNSW scan at
    ``ef_search`` candidates as pgvector before 0.8 does."""

    def __init__(self, *args: Any, iterative: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._iterative = iterative

    def _configure(self, conn: Any) -> None:
        super()._configure(conn)
        conn.execute("SET enable_seqscan = off")
        conn.execute("SET enable_bitmapscan = off")  # nor reads the scope's rows through the metadata index
        if not self._iterative:
            conn.execute("SET hnsw.iterative_scan = off")


@pytest.fixture(scope="module")
def crowded_store(pg_url: str) -> Iterator[str]:  # noqa: F811
    """400 documents of tenant "crowd", 6 of tenant "few"; only the crowd's hold the rare word "zyzzyva", a quarter
    of the crowd's and all of the few's the word "harbor"."""
    documents = [
        Document(
            id_=f"crowd/{i}",
            text=f"Note {i} of the crowd{' about the harbor' * (i % 4 == 0)}{' and a zyzzyva' * (i < 3)}.",
            metadata={"tenant": "crowd"},
        )
        for i in range(400)
    ] + [
        Document(id_=f"few/{i}", text=f"Harbor report {i} from the few. It is short.", metadata={"tenant": "few"})
        for i in range(6)
    ]
    store = PostgresStore(pg_url, table="crowded")
    ingest(documents, store, _HashEmbedding())
    store.close()
    yield pg_url


@pytest.mark.parametrize("iterative", [True, False])
def test_a_narrow_scope_still_gets_k_nearest_through_the_hnsw_index(crowded_store: str, iterative: bool) -> None:
    store = _IndexOnly(crowded_store, table="crowded", iterative=iterative)
    try:
        few = Scope.of({"tenant": "few"})
        for retriever, wanted in (
            (PostgresVectorRetriever(store, _HashEmbedding(), 5, scope=few), 5),
            (PostgresSentenceWindowRetriever(store, _HashEmbedding(), 5, scope=few), 5),  # chunks of 6 documents
            (PostgresSentenceWindowRetriever(store, _HashEmbedding(), 5, scope=few, widen_to="window"), 10),
        ):
            hits = retriever.retrieve("harbor report")
            assert len(hits) == wanted and {h.node.metadata["tenant"] for h in hits} == {"few"}
            assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    finally:
        store.close()


def test_a_scoped_search_is_planned_for_its_values_never_from_a_prepared_generic_plan(crowded_store: str) -> None:
    store = PostgresStore(crowded_store, table="crowded", pool_size=1)  # one connection: its prepared statements
    try:
        scope = Scope.of({"tenant": "few"})
        retrievers = [
            PostgresVectorRetriever(store, _HashEmbedding(), 5, scope=scope),
            PostgresSentenceWindowRetriever(store, _HashEmbedding(), 5, scope=scope),
            PostgresFullTextRetriever(store, 5, scope=scope),
        ]
        for _ in range(8):  # psycopg prepares a statement from its fifth execution on
            for retriever in retrievers:
                assert retriever.retrieve("harbor report")
        with store.connection() as conn:
            prepared = [row[0] for row in conn.execute("SELECT statement FROM pg_prepared_statements")]
        assert not [s for s in prepared if "metadata_" in s and "jsonb_typeof" in s], prepared
    finally:
        store.close()


def test_the_full_text_budget_still_finds_k_inside_the_scope(crowded_store: str) -> None:
    store = PostgresStore(crowded_store, table="crowded", fulltext_candidates=5)  # "zyzzyva" (3) fills the budget
    try:
        query = QueryBundle("zyzzyva harbor")
        unscoped = PostgresFullTextRetriever(store, 4).retrieve(query)
        assert {h.node.metadata["tenant"] for h in unscoped} == {"crowd"}
        scoped = PostgresFullTextRetriever(store, 4, scope=Scope.of({"tenant": "few"})).retrieve(query)
        assert len(scoped) == 4 and {h.node.metadata["tenant"] for h in scoped} == {"few"}
    finally:
        store.close()
