"""A caller's scope holds on every path of the loop: two tenants in one index, and random filters over random corpora.

Every check reads everything a caller or an LLM could read (the answer, ``source_nodes`` and their metadata,
the trace, the retriever's nodes, a chat LLM's prompt) and looks for text of documents outside the scope.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any, Dict, List, Optional, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_index.core import VectorStoreIndex
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.chat_engine import CondensePlusContextChatEngine, ContextChatEngine
from llama_index.core.schema import Document, NodeWithScore, QueryBundle
from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters

from llama_index_crag import CorrectiveQueryEngine, CorrectiveRetriever, FallbackRetriever
from llama_index_crag.errors import ConfigError, ScopeError
from llama_index_crag.scope import Scope
from llama_index_crag.scorers.base import RelevanceScorer
from tests.conftest import ENTRY_SETTINGS, REWRITE_MARKER, EntryScorer, ScriptedLLM

ACME = [
    "Acme's remote access policy: employees connect through the Kestrel VPN with a hardware key issued by IT.",
    "Acme was founded in 1998 in Portland by Jane Roe, and it sells industrial anvils to builders.",
    "Acme's travel policy reimburses economy train tickets; flights need the approval of a director.",
]
GLOBEX = [
    "Globex remote access policy: staff sign in to the Zephyrine portal with one-time codes sent by text message.",
    "Globex was founded in 1989 in Springfield by Hank Scorpio, and it sells weather machines to governments.",
    "Globex's travel policy reimburses business-class flights for trips longer than six hours.",
]
#: Words of globex's documents that no acme document, no question below and no answer prompt's template holds.
GLOBEX_ONLY = ["Zephyrine", "Scorpio", "Springfield", "weather machines", "business-class", "one-time codes"]
QUESTIONS_ABOUT_GLOBEX = [
    "Who founded Globex, and in which city?",
    "How do Globex staff sign in remotely?",
    "Which flights does the travel policy reimburse for long trips?",
    "What does Globex sell to governments?",
    "Which company was founded first, Acme or Globex?",  # a comparison: one part a side, Globex's part too
]
ACME_QUESTIONS = {
    "Who founded Acme?": "Jane Roe",
    "How do Acme employees connect for remote access?": "Kestrel VPN",
}


class GreedyRewrite(ScriptedLLM):
    """An LLM whose every rewrite asks for the other tenant's text, and whose answers repeat their whole prompt."""

    rewrite: Any = '{"query": "Zephyrine portal Hank Scorpio Springfield weather machines business-class"}'

    def _text(self, prompt: str) -> str:
        if REWRITE_MARKER in prompt:
            return super()._text(prompt)
        self.calls["answer"] += 1
        return "ANSWER FROM: " + prompt


class Credulous(RelevanceScorer):
    """Grades every passage that holds the question's own code word, or any globex passage, as relevant (0.95),
    so that whatever a leaky path found would be answered from; other passages are ambiguous (0.5) when the
    question is about a policy, else irrelevant (0.1). With upper 0.7 and lower 0.3 every branch runs."""

    name = "credulous"

    def score_texts(self, query: str, texts: Sequence[str]) -> List[float]:
        codes = re.findall(r"qx\w+", query)
        return [
            0.95 if "globex" in t.lower() or any(c in t for c in codes) else 0.5 if "policy" in query.lower() else 0.1
            for t in texts
        ]


CREDULOUS = {"scorer": Credulous(), "upper": 0.7, "lower": 0.3}


def _documents() -> List[Document]:
    return [Document(text=t, metadata={"tenant": "acme", "year": 2023}) for t in ACME] + [
        Document(text=t, metadata={"tenant": "globex", "year": 2024}) for t in GLOBEX
    ]


@pytest.fixture(scope="module")
def tenants_index(embed_model: Any) -> VectorStoreIndex:
    return VectorStoreIndex.from_documents(_documents(), embed_model=embed_model)


#: Trace fields that hold what the caller asked (or its rewrite), not what the documents say.
ASKED = ("query", "rewritten_query", "rewrite_error")


def _dump(metadata: Any) -> str:
    """``metadata`` as JSON, less the trace's copies of the question and of its rewrite (the caller's own words)."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ASKED}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return json.dumps(strip(metadata), default=str)


def _readable(response: Any) -> str:
    """Everything a caller of a query engine can read of one response."""
    parts = [str(response), _dump(response.metadata or {})]
    for n in response.source_nodes:
        parts += [n.node.get_content(), _dump(n.node.metadata)]
    return "\n".join(parts)


def _nodes_text(nodes: Sequence[NodeWithScore]) -> str:
    return "\n".join(n.node.get_content() + _dump(n.node.metadata) for n in nodes)


def _leaks(text: str) -> List[str]:
    return [word for word in GLOBEX_ONLY if word.lower() in text.lower()]


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"hybrid": True},
        {"max_rewrites": 2},
        {"on_no_strips": "incorrect", "hybrid": True, "max_rewrites": 2},
        {"enabled": False},
    ],
    ids=["default", "hybrid", "two-rewrites", "strict-hybrid", "crag-off"],
)
def test_acme_engine_never_shows_globex_text_on_any_path(tenants_index: VectorStoreIndex, settings: Dict) -> None:
    engine = CorrectiveQueryEngine.from_defaults(
        index=tenants_index,
        llm=GreedyRewrite(),
        filters={"tenant": "acme"},
        answer_mode="generate",
        **CREDULOUS,
        **settings,
    )
    for question in QUESTIONS_ABOUT_GLOBEX:
        response = engine.query(question)
        assert _leaks(_readable(response)) == [], question
        assert _leaks(_nodes_text(engine.retrieve(QueryBundle(question)))) == [], question


def test_async_and_streamed_answers_stay_inside_the_scope(tenants_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(
        index=tenants_index,
        llm=GreedyRewrite(),
        filters={"tenant": "acme"},
        answer_mode="generate",
        hybrid=True,
        **CREDULOUS,
    )
    streamed = engine.variant(streaming=True)

    async def ask_all() -> List[str]:
        seen = []
        for question in QUESTIONS_ABOUT_GLOBEX:
            seen.append(_readable(await engine.aquery(question)))
            response = await streamed.aquery(question)
            text = "".join([token async for token in response.async_response_gen()])
            seen.append(text + _readable(response))
        return seen

    for text in asyncio.run(ask_all()):
        assert _leaks(text) == []
    for question in QUESTIONS_ABOUT_GLOBEX:
        response = streamed.query(question)
        assert _leaks("".join(response.response_gen) + _readable(response)) == []


def test_the_scoped_tenant_is_still_answered(tenants_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(index=tenants_index, filters={"tenant": "acme"})
    for question, answer in ACME_QUESTIONS.items():
        response = engine.query(question)
        assert not response.metadata["crag"]["abstained"], question
        assert answer in str(response)


def test_a_given_retrievers_filters_are_read_and_bound_the_fallback(tenants_index: VectorStoreIndex) -> None:
    acme_only = MetadataFilters(filters=[MetadataFilter(key="tenant", value="acme")])
    engine = CorrectiveQueryEngine.from_defaults(
        index=tenants_index,
        retriever=tenants_index.as_retriever(filters=acme_only),
        llm=GreedyRewrite(),
        hybrid=True,
        **CREDULOUS,
    )
    assert engine.scope.admits({"tenant": "acme"}) and not engine.scope.admits({"tenant": "globex"})
    assert isinstance(engine.fallback, FallbackRetriever)
    for question in QUESTIONS_ABOUT_GLOBEX:
        assert _leaks(_readable(engine.query(question))) == []
        assert _leaks(_nodes_text(engine.fallback.retrieve(question))) == []


class Wrapping(BaseRetriever):
    """A custom retriever around a filtered one: the loop cannot read its scope."""

    def __init__(self, inner: BaseRetriever) -> None:
        self._inner = inner
        super().__init__()

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return self._inner.retrieve(query_bundle)


def test_a_custom_retriever_is_searched_back_through_never_around(tenants_index: VectorStoreIndex) -> None:
    inner = tenants_index.as_retriever(filters=MetadataFilters(filters=[MetadataFilter(key="tenant", value="acme")]))
    engine = CorrectiveQueryEngine.from_defaults(
        index=tenants_index, retriever=Wrapping(inner), llm=GreedyRewrite(), **CREDULOUS
    )
    assert isinstance(engine.fallback, FallbackRetriever)
    assert list(engine.fallback.retrievers) == ["primary"]
    for question in QUESTIONS_ABOUT_GLOBEX:
        assert _leaks(_readable(engine.query(question))) == []


def test_a_custom_retriever_with_filters_is_checked_against_them(tenants_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(
        index=tenants_index, retriever=Wrapping(tenants_index.as_retriever()), filters={"tenant": "acme"}, **CREDULOUS
    )
    for question in QUESTIONS_ABOUT_GLOBEX:
        assert _leaks(_readable(engine.query(question))) == []
    assert "Kestrel" in _nodes_text(engine.retrieve(QueryBundle("What is the remote access policy?")))


def test_scoped_narrows_and_never_widens(tenants_index: VectorStoreIndex) -> None:
    acme = CorrectiveQueryEngine.from_defaults(index=tenants_index, filters={"tenant": "acme"})
    widened = acme.scoped({"tenant": "globex"})  # acme AND globex: nothing
    response = widened.query("Who founded Globex, and in which city?")
    assert response.metadata["crag"]["abstained"] and response.metadata["crag"]["action"] == "incorrect"
    assert "scope" in response.metadata["crag"]["abstain_reason"]
    assert _leaks(_readable(response)) == []


def test_one_engine_serves_each_caller_its_own_scope_concurrently(tenants_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(
        index=tenants_index, llm=GreedyRewrite(), answer_mode="generate", **CREDULOUS
    )
    acme, globex = engine.scoped({"tenant": "acme"}), engine.scoped({"tenant": "globex"})
    assert acme is engine.scoped({"tenant": "acme"})  # built once per scope
    assert acme.grader is engine.grader and acme.synthesizer is engine.synthesizer

    async def both() -> List[Any]:
        asks = [acme.aquery(q) for q in QUESTIONS_ABOUT_GLOBEX] + [globex.aquery(q) for q in ACME_QUESTIONS]
        return await asyncio.gather(*asks)

    responses = asyncio.run(both())
    for response in responses[: len(QUESTIONS_ABOUT_GLOBEX)]:
        assert _leaks(_readable(response)) == []
    for response in responses[len(QUESTIONS_ABOUT_GLOBEX) :]:
        assert not any(fact in _readable(response) for fact in ("Jane Roe", "Kestrel", "anvils"))


def test_a_filter_on_a_key_no_document_has_abstains_with_that_reason(tenants_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(index=tenants_index, filters={"team": "nobody"})
    response = engine.query("Who founded Acme?")
    assert response.metadata["crag"]["abstained"]
    assert "scope" in response.metadata["crag"]["abstain_reason"]
    assert response.source_nodes == []


def test_the_corrective_retriever_takes_filters_too(tenants_index: VectorStoreIndex) -> None:
    retriever = CorrectiveRetriever.from_defaults(
        index=tenants_index, filters={"tenant": "acme"}, hybrid=True, llm=GreedyRewrite(), **CREDULOUS
    )
    for question in QUESTIONS_ABOUT_GLOBEX:
        assert _leaks(_nodes_text(retriever.retrieve(question))) == []


class RecordingLLM(ScriptedLLM):
    """A chat LLM that records every prompt it is given (a chat's messages arrive as one prompt)."""

    seen: List[str] = []

    def _text(self, prompt: str) -> str:
        self.seen.append(prompt)
        return super()._text(prompt) if REWRITE_MARKER in prompt else "Noted."


@pytest.mark.parametrize("chat_engine", [ContextChatEngine, CondensePlusContextChatEngine])
def test_a_chat_llm_never_reads_another_tenants_text(tenants_index: VectorStoreIndex, chat_engine: Any) -> None:
    llm = RecordingLLM(rewrite=GreedyRewrite.model_fields["rewrite"].default)
    llm.seen = []
    retriever = CorrectiveRetriever.from_defaults(index=tenants_index, llm=llm, filters={"tenant": "acme"}, **CREDULOUS)
    chat = chat_engine.from_defaults(retriever=retriever, llm=llm)
    for question in QUESTIONS_ABOUT_GLOBEX[:3]:
        chat.chat(question)
    assert llm.seen, "the chat LLM was never asked"
    assert _leaks("\n".join(llm.seen)) == []


def test_malformed_filters_are_refused_with_the_field_named(tenants_index: VectorStoreIndex) -> None:
    for bad in ({"tenant": {"nested": "object"}}, {"filters": "not a list"}, {}, "tenant=acme"):
        with pytest.raises(ScopeError, match="filters"):
            CorrectiveQueryEngine.from_defaults(index=tenants_index, filters=bad)


def test_a_source_that_cannot_be_narrowed_stops_the_build(tenants_index: VectorStoreIndex) -> None:
    custom = FallbackRetriever({"custom": Wrapping(tenants_index.as_retriever())})
    with pytest.raises(ScopeError, match="Wrapping"):
        CorrectiveQueryEngine.from_defaults(index=tenants_index, fallback=custom, filters={"tenant": "acme"})
    engine = CorrectiveQueryEngine.from_defaults(retriever=Wrapping(tenants_index.as_retriever()))
    with pytest.raises(ScopeError, match="Wrapping"):
        engine.scoped({"tenant": "acme"})


# Random scopes over random corpora --------------------------------------------------------------------------------

TOPICS = ["budget", "office", "policy", "travel", "laptop", "holiday", "audit", "backup", "contract", "training"]
TENANTS = ["acme", "globex", "initech"]
TAGS = ["hr", "it", "legal", "finance"]


def _marker(i: int) -> str:
    return f"qx{i:03d}zv"


def _random_corpus(seed: int, size: int = 18) -> List[Document]:
    rng = random.Random(seed)
    documents = []
    for i in range(size):
        metadata: Dict[str, Any] = {"tenant": rng.choice(TENANTS), "year": rng.randint(2019, 2024)}
        if rng.random() < 0.7:
            metadata["tags"] = rng.sample(TAGS, rng.randint(1, 3))
        if rng.random() < 0.5:
            metadata["region"] = rng.choice(["north", "south"])
        topics = rng.sample(TOPICS, 3)
        text = (
            f"The {topics[0]} record {_marker(i)} of {metadata['tenant']} says the {topics[1]} review happens in "
            f"{metadata['year']}. Reference {_marker(i)} also covers the {topics[2]} plan and its owner."
        )
        documents.append(Document(text=text, metadata=metadata, id_=f"doc-{i}"))
    return documents


def _reference_leaf(op: FilterOperator, wanted: Any, value: Any) -> bool:
    """One filter's meaning in LlamaIndex, written out independently of the package."""
    if op == FilterOperator.IS_EMPTY:
        return value in (None, "", [])
    if value is None:
        return op in (FilterOperator.NE, FilterOperator.NIN)
    ordered = (FilterOperator.GT, FilterOperator.LT, FilterOperator.GTE, FilterOperator.LTE)
    if op in ordered and (isinstance(value, str) != isinstance(wanted, str) or isinstance(value, list)):
        return False  # a number against a string: not comparable, admits nothing
    if op == FilterOperator.EQ:
        return bool(value == wanted)
    if op == FilterOperator.NE:
        return bool(value != wanted)
    if op == FilterOperator.GT:
        return bool(value > wanted)
    if op == FilterOperator.GTE:
        return bool(value >= wanted)
    if op == FilterOperator.LT:
        return bool(value < wanted)
    if op == FilterOperator.LTE:
        return bool(value <= wanted)
    if op == FilterOperator.IN:
        return value in wanted
    if op == FilterOperator.NIN:
        return value not in wanted
    if op == FilterOperator.CONTAINS:
        return isinstance(value, list) and wanted in value
    if op == FilterOperator.ANY:
        return isinstance(value, list) and any(v in value for v in wanted)
    assert op == FilterOperator.ALL
    return isinstance(value, list) and all(v in value for v in wanted)


def _reference(filters: MetadataFilters, metadata: Dict[str, Any]) -> bool:
    results = [
        _reference(f, metadata)
        if isinstance(f, MetadataFilters)
        else _reference_leaf(f.operator, f.value, metadata.get(f.key))
        for f in filters.filters
    ]
    condition = filters.condition or FilterCondition.AND
    if condition == FilterCondition.AND:
        return all(results)
    if condition == FilterCondition.OR:
        return any(results)
    return not any(results)


_leaf = st.one_of(
    st.builds(
        lambda op, v: MetadataFilter(key="tenant", operator=op, value=v),
        st.sampled_from([FilterOperator.EQ, FilterOperator.NE]),
        st.sampled_from(TENANTS),
    ),
    st.builds(
        lambda op, v: MetadataFilter(key="tenant", operator=op, value=v),
        st.sampled_from([FilterOperator.IN, FilterOperator.NIN]),
        st.lists(st.sampled_from(TENANTS), min_size=1, max_size=2, unique=True),
    ),
    st.builds(
        lambda op, v: MetadataFilter(key="year", operator=op, value=v),
        st.sampled_from([FilterOperator.GT, FilterOperator.GTE, FilterOperator.LT, FilterOperator.LTE]),
        st.integers(2018, 2025),
    ),
    st.builds(lambda v: MetadataFilter(key="tags", operator=FilterOperator.CONTAINS, value=v), st.sampled_from(TAGS)),
    st.builds(
        lambda op, v: MetadataFilter(key="tags", operator=op, value=v),
        st.sampled_from([FilterOperator.ANY, FilterOperator.ALL]),
        st.lists(st.sampled_from(TAGS), min_size=1, max_size=2, unique=True),
    ),
    st.builds(
        lambda key: MetadataFilter(key=key, operator=FilterOperator.IS_EMPTY, value=None),
        st.sampled_from(["region", "tags"]),
    ),
    st.builds(lambda v: MetadataFilter(key="region", value=v), st.sampled_from(["north", "south"])),
    st.just(MetadataFilter(key="year", operator=FilterOperator.GT, value="2020")),  # a string against numbers
)
_conditions = st.sampled_from([FilterCondition.AND, FilterCondition.OR, FilterCondition.NOT])
_filters = st.recursive(
    st.builds(
        lambda fs, c: MetadataFilters(filters=fs, condition=c), st.lists(_leaf, min_size=1, max_size=3), _conditions
    ),
    lambda inner: st.builds(
        lambda fs, c: MetadataFilters(filters=fs, condition=c),
        st.lists(st.one_of(_leaf, inner), min_size=1, max_size=3),
        _conditions,
    ),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(filters=_filters, seed=st.integers(0, 10_000))
def test_a_scope_admits_what_the_filters_mean(filters: MetadataFilters, seed: int) -> None:
    for document in _random_corpus(seed, size=30):
        assert Scope(filters).admits(document.metadata) == _reference(filters, document.metadata)


@pytest.fixture(scope="module")
def random_engines(embed_model: Any) -> Dict[str, Any]:
    documents = _random_corpus(7)
    index = VectorStoreIndex.from_documents(documents, embed_model=embed_model)
    llm = ScriptedLLM(rewrite=json.dumps({"query": "review plan owner budget office policy travel audit"}))
    return {
        "documents": documents,
        "quoting": CorrectiveQueryEngine.from_defaults(index=index, hybrid=True, **CREDULOUS),
        "generating": CorrectiveQueryEngine.from_defaults(
            index=index, llm=llm, answer_mode="generate", max_rewrites=2, on_no_strips="incorrect", **CREDULOUS
        ),
    }


def _outside(documents: Sequence[Document], filters: Optional[MetadataFilters]) -> List[str]:
    return [_marker(i) for i, d in enumerate(documents) if filters is not None and not _reference(filters, d.metadata)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(filters=_filters, asked=st.lists(st.integers(0, 17), min_size=1, max_size=2), which=st.booleans())
def test_nothing_outside_a_random_scope_reaches_any_output(
    random_engines: Dict[str, Any], filters: MetadataFilters, asked: List[int], which: bool
) -> None:
    documents = random_engines["documents"]
    engine = random_engines["generating" if which else "quoting"].scoped(filters)
    outside = _outside(documents, filters)
    for i in asked:  # a question whose words come from one document, whatever its tenant
        topic = "policy" if i % 2 else "plan"  # half the questions ambiguous, half incorrect where the code is outside
        question = f"What does record {_marker(i)} say about the review and the {topic}?"
        text = _readable(engine.query(question)) + _nodes_text(engine.retrieve(QueryBundle(question)))
        assert [m for m in outside if m in text] == []


# The opt-in broadening fallback ----------------------------------------------------------------------------------

GARAGE = "qx900zv"


@pytest.fixture(scope="module")
def years_index(embed_model: Any) -> VectorStoreIndex:
    documents = [
        Document(
            text="Acme's 2024 holiday calendar lists eleven public holidays.", metadata={"tenant": "acme", "year": 2024}
        ),
        Document(
            text=f"Acme garage rule {GARAGE}: the parking garage closes at ten in the evening.",
            metadata={"tenant": "acme", "year": 2023},
        ),
        Document(
            text=f"Globex garage rule {GARAGE}: the Springfield garage never closes for Hank Scorpio.",
            metadata={"tenant": "globex", "year": 2023},
        ),
    ]
    return VectorStoreIndex.from_documents(documents, embed_model=embed_model)


def _broadening_engine(index: VectorStoreIndex) -> CorrectiveQueryEngine:
    return CorrectiveQueryEngine.from_defaults(
        index=index,
        llm=ScriptedLLM(rewrite=json.dumps({"query": f"{GARAGE} garage closes"})),
        answer_mode="generate",
        filters={"tenant": "acme", "year": 2024},
        broaden=["year"],
        **CREDULOUS,
    )


def test_broadening_drops_only_the_named_key_and_says_so(years_index: VectorStoreIndex) -> None:
    response = _broadening_engine(years_index).query(f"When does the garage close ({GARAGE})?")
    crag = response.metadata["crag"]
    assert crag["broadened"] == ["year"] and not crag["abstained"]
    assert str(response).startswith("(From a broadened search: the filter on year was relaxed.)")
    assert "ten in the evening" in _readable(response)
    assert _leaks(_readable(response)) == []


def test_a_key_the_caller_is_scoped_to_is_never_relaxed(years_index: VectorStoreIndex) -> None:
    engine = _broadening_engine(years_index).scoped({"year": 2024})
    response = engine.query(f"When does the garage close ({GARAGE})?")
    assert response.metadata["crag"]["abstained"] and response.metadata["crag"]["broadened"] == []
    assert "ten in the evening" not in _readable(response)


def test_without_broaden_the_filters_hold(years_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(
        index=years_index,
        llm=ScriptedLLM(rewrite=json.dumps({"query": f"{GARAGE} garage closes"})),
        answer_mode="generate",
        filters={"tenant": "acme", "year": 2024},
        **CREDULOUS,
    )
    response = engine.query(f"When does the garage close ({GARAGE})?")
    assert response.metadata["crag"]["abstained"]
    assert "ten in the evening" not in _readable(response)


def test_broaden_names_only_keys_the_filters_narrow_on(years_index: VectorStoreIndex) -> None:
    with pytest.raises(ConfigError, match="region"):
        CorrectiveQueryEngine.from_defaults(index=years_index, filters={"tenant": "acme"}, broaden=["region"])


def test_each_part_of_a_compound_question_stays_inside_the_scope(tenants_index: VectorStoreIndex) -> None:
    engine = CorrectiveQueryEngine.from_defaults(
        index=tenants_index, llm=GreedyRewrite(), filters={"tenant": "acme"}, answer_mode="generate", **CREDULOUS
    )
    question = "What is the remote access policy of Acme, and what does the travel policy of Globex reimburse?"
    for response in (engine.query(question), engine.scoped({"year": 2023}).query(question)):
        parts = response.metadata["crag"]["parts"]
        assert len(parts) == 2 and not parts[0]["abstained"]
        assert _leaks(_readable(response)) == []
        assert "Kestrel VPN" in parts[0]["answer"]


def test_the_search_for_the_asked_entry_by_name_stays_inside_the_scope(embed_model: Any) -> None:
    # Acme's page holds a neighbour's entry that names the asked setting; only Globex's page holds the setting's own.
    neighbour = (
        "#### vat_min_age (integer)\n\nThe youngest age at which a cheese leaves the vat. The default is 50 days, at "
        "most half the value of vat_max_age."
    )
    own = (
        "#### vat_max_age (integer)\n\nThe oldest age a cheese may reach in the vat. The default is 200 days at "
        "Zephyrine."
    )
    index = VectorStoreIndex.from_documents(
        [Document(text=neighbour, metadata={"tenant": "acme"}), Document(text=own, metadata={"tenant": "globex"})],
        embed_model=embed_model,
    )
    settings: Dict[str, Any] = {"scorer": EntryScorer(), **ENTRY_SETTINGS}
    question = "What is the default value of vat_max_age?"
    unscoped = CorrectiveQueryEngine.from_defaults(index=index, **settings).query(question)
    # Unbounded, the search by name finds Globex's entry: the path this test holds to the scope.
    assert unscoped.metadata["crag"]["entry_search"] == "vat_max_age" and "Zephyrine" in str(unscoped)
    for engine in (
        CorrectiveQueryEngine.from_defaults(index=index, filters={"tenant": "acme"}, **settings),
        CorrectiveQueryEngine.from_defaults(index=index, **settings).scoped({"tenant": "acme"}),
    ):
        response = engine.query(question)
        trace = response.metadata["crag"]
        assert trace["entry_search"] == "vat_max_age" and trace["abstained"], trace["abstain_reason"]
        assert _leaks(_readable(response)) == []


def test_parts_found_by_the_llm_rewrite_stay_inside_the_scope(tenants_index: VectorStoreIndex) -> None:
    # The rules leave this question whole; asked whole it grades INCORRECT, and the rewrite finds its two parts.
    parts = ["What is the remote access policy of Acme?", "What does the travel policy of Globex reimburse?"]
    rewrite = json.dumps({"query": "Acme remote access Globex travel rules", "parts": parts})
    question = "What do Acme's remote access rules and Globex's travel rules say?"
    unscoped = CorrectiveQueryEngine.from_defaults(
        index=tenants_index, llm=ScriptedLLM(rewrite=rewrite), answer_mode="generate", **CREDULOUS
    ).query(parts[1])
    # Unbounded, Globex's part is answered from Globex's policy: what this test holds the part to the scope against.
    assert _leaks(_readable(unscoped))
    engine = CorrectiveQueryEngine.from_defaults(
        index=tenants_index,
        llm=GreedyRewrite(rewrite=rewrite),  # its answers repeat their whole prompt: what the LLM read is seen
        filters={"tenant": "acme"},
        answer_mode="generate",
        **CREDULOUS,
    )
    for response in (engine.query(question), asyncio.run(engine.aquery(question))):
        crag = response.metadata["crag"]
        assert crag["split"]["by"] == "rewrite" and len(crag["parts"]) == 2
        assert _leaks(_readable(response)) == []
        assert "Kestrel VPN" in crag["parts"][0]["answer"]


class FileMaps(RelevanceScorer):
    """Grades globex's text relevant (0.95, so that a leaky path would quote it), a strip or passage that says
    "ledger name map" ambiguous (0.5), everything else irrelevant: the refiner keeps acme's strips that name no
    file and drops the one that does."""

    name = "file-maps"

    def score_texts(self, query: str, texts: Sequence[str]) -> List[float]:
        return [0.95 if "globex" in t.lower() else 0.5 if "ledger name map" in t.lower() else 0.05 for t in texts]


def test_a_file_question_read_past_the_refiner_reads_only_the_callers_passages(embed_model: Any) -> None:
    documents = [
        Document(
            text=(
                "Acme lets a cellar use an outside ledger. A ledger name map can be applied to map a ledger name to "
                "an Acme cheesemaker. The maps are kept in the cellar map file, which is named acme_ident.conf."
            ),
            metadata={"tenant": "acme"},
        ),
        Document(
            text="Globex keeps every ledger name map of the Zephyrine portal in the file named zephyrine_maps.conf.",
            metadata={"tenant": "globex"},
        ),
    ]
    index = VectorStoreIndex.from_documents(documents, embed_model=embed_model)
    question = "Which file holds the ledger name maps?"
    settings: Dict[str, Any] = {"scorer": FileMaps(), "upper": 0.7, "lower": 0.3, "strip_min_tokens": 4}
    settings.update(answer_mode="extract", quote_threshold=0.0, llm=GreedyRewrite())
    scoped = CorrectiveQueryEngine.from_defaults(index=index, filters={"tenant": "acme"}, **settings)
    for response in (scoped.query(question), asyncio.run(scoped.aquery(question))):
        trace = response.metadata["crag"]
        assert trace["action"] == "ambiguous" and trace["quote_check"]["whole_passages"] is True, trace
        assert "acme_ident.conf" in str(response) and _leaks(_readable(response)) == [], _readable(response)
    # Unbounded, the same question reads globex's page: the check above can tell.
    unbounded = CorrectiveQueryEngine.from_defaults(index=index, **settings).query(question)
    assert _leaks(_readable(unbounded)) != []
