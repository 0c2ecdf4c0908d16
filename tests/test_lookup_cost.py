"""Corrections at the cost of a lookup: what ingest embedded is read, not embedded again, and grades the same."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle
from llama_index.retrievers.bm25 import BM25Retriever

from llama_index_crag import CorrectiveQueryEngine, FallbackRetriever
from llama_index_crag.datasets import load_documents
from llama_index_crag.scorers import EvidenceScorer
from llama_index_crag.scorers.base import node_text
from llama_index_crag.stores.chunking import chunk
from llama_index_crag.stores.memory import SentenceWindowRetriever
from llama_index_crag.text.strips import decompose
from tests.conftest import ScriptedLLM

QUESTIONS = (
    "Who is the chief executive officer of Harbor Analytics?",
    "What is the alpha project budget?",
    "How long is the Kestrel bridge?",
    "Which river does the office cafeteria look over?",
)
#: Thresholds that send every query down one correction path.
AMBIGUOUS = {"upper": 0.999, "lower": 0.0, "strip_threshold": 0.3}
INCORRECT = {"upper": 0.999, "lower": 0.998}


class CountingEmbedding(BaseEmbedding):
    """The bundled model (under another name when ``name`` is given), recording every passage and every query it
    is asked to embed."""

    _inner: BaseEmbedding = PrivateAttr()
    _texts: List[str] = PrivateAttr(default_factory=list)
    _queries: List[str] = PrivateAttr(default_factory=list)

    def __init__(self, inner: BaseEmbedding, name: str = "") -> None:
        super().__init__(model_name=name or inner.model_name, embed_batch_size=inner.embed_batch_size)
        self._inner = inner

    @property
    def texts(self) -> List[str]:
        return self._texts

    @property
    def queries(self) -> List[str]:
        return self._queries

    def _get_query_embedding(self, query: str) -> Embedding:
        self._queries.append(query)
        return self._inner.get_query_embedding(query)

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> Embedding:
        return self.get_text_embedding_batch([text])[0]

    def get_text_embedding_batch(self, texts: List[str], show_progress: bool = False, **kwargs: Any) -> List[Embedding]:
        self._texts.extend(texts)
        return self._inner.get_text_embedding_batch(texts)


@pytest.fixture(scope="module")
def nodes() -> List[BaseNode]:
    return chunk(load_documents())


@pytest.fixture(scope="module")
def counting(embed_model: Any) -> CountingEmbedding:
    return CountingEmbedding(embed_model)


@pytest.fixture(scope="module")
def index(nodes: List[BaseNode], counting: CountingEmbedding) -> VectorStoreIndex:
    return VectorStoreIndex(nodes, embed_model=counting)


@pytest.fixture(scope="module")
def fallback(nodes: List[BaseNode], counting: CountingEmbedding) -> FallbackRetriever:
    built = FallbackRetriever.from_nodes(nodes, similarity_top_k=4, embed_model=counting)
    built.warm()  # built with the index, before any question
    return built


def engine(
    index: VectorStoreIndex, fallback: FallbackRetriever, counting: CountingEmbedding, reuse: bool, **settings: Any
) -> Tuple[CorrectiveQueryEngine, EvidenceScorer]:
    scorer = EvidenceScorer(
        counting, corpus=[n.get_content(metadata_mode=MetadataMode.EMBED) for n in index.docstore.docs.values()]
    )
    scorer.bi_encoder.reuse_index_vectors = reuse
    built = CorrectiveQueryEngine.from_defaults(
        index=index, llm=ScriptedLLM(), scorer=scorer, fallback=fallback, embed_model=counting, **settings
    )
    return built, scorer


def decisions(built: CorrectiveQueryEngine, question: str) -> Dict[str, Any]:
    trace = built.query(question).metadata["crag"]
    return {
        "action": trace["action"],
        "abstained": trace["abstained"],
        # A widened window is a new node each time (a new id): its document, source, score and label are compared.
        "nodes": [(n["doc_id"], n["source"], n["score"], n["label"]) for n in trace["nodes"]],
        "strips": [(s["text"], s["score"], s["kept"]) for s in trace["strips"]],
    }


@pytest.mark.parametrize("path", [AMBIGUOUS, INCORRECT, {}], ids=["ambiguous", "incorrect", "shipped thresholds"])
def test_the_same_queries_grade_and_act_the_same_with_and_without_the_index_vectors(
    index: VectorStoreIndex, fallback: FallbackRetriever, counting: CountingEmbedding, path: Dict[str, float]
) -> None:
    reusing, _ = engine(index, fallback, counting, True, **path)
    embedding, _ = engine(index, fallback, counting, False, **path)
    for question in QUESTIONS:
        assert decisions(reusing, question) == decisions(embedding, question), question


def test_strips_and_fallback_chunks_score_the_same_from_the_index_vectors_as_from_the_model(
    index: VectorStoreIndex, fallback: FallbackRetriever, counting: CountingEmbedding, nodes: List[BaseNode]
) -> None:
    _, reusing = engine(index, fallback, counting, True)
    _, embedding = engine(index, fallback, counting, False)
    for question in QUESTIONS:
        hits = fallback.retrieve(QueryBundle(question))
        texts = [node_text(h) for h in hits]
        texts += [
            s.graded_text for n in nodes for s in decompose(n.get_content(), 8, str(n.metadata.get("title") or ""))
        ]
        assert reusing.score_texts(question, texts) == pytest.approx(embedding.score_texts(question, texts), abs=1e-6)


@pytest.mark.parametrize("reuse", [True, False], ids=["index vectors read", "index vectors ignored"])
def test_a_correction_embeds_only_the_windows_it_widened_at_query_time(
    index: VectorStoreIndex,
    fallback: FallbackRetriever,
    counting: CountingEmbedding,
    nodes: List[BaseNode],
    reuse: bool,
) -> None:
    chunks = {n.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes}
    strips = {s.graded_text for n in nodes for s in decompose(n.get_content(), 8, str(n.metadata.get("title") or ""))}
    graded_again: List[str] = []
    for path in (AMBIGUOUS, INCORRECT):
        built, _ = engine(index, fallback, counting, reuse, **path)
        for question in QUESTIONS:
            counting.texts.clear()
            trace = built.query(question).metadata["crag"]
            assert trace["action"] == ("ambiguous" if path is AMBIGUOUS else "incorrect")
            graded_again += [t for t in counting.texts if t in chunks or t in strips]
    if reuse:
        assert graded_again == [], "chunks and strips embedded with the index were embedded again"
    else:
        assert graded_again, "without the index's vectors, grading embeds the strips and the fallback's chunks"


@pytest.mark.parametrize("widen", ["chunk", "window"])
def test_the_default_engine_corrects_an_incorrect_query_with_no_passage_embedded_again(
    nodes: List[BaseNode], counting: CountingEmbedding, widen: str
) -> None:
    """The engine as from_defaults builds it (no warm-up): the fallback's BM25 chunks and the chunks its sentence
    search found are graded with the vectors the index stored; only the strips the answer quotes are embedded.
    Widened to windows instead, the windows are embedded when they are graded."""
    index = VectorStoreIndex(nodes, embed_model=counting)
    chunks = {n.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes}
    strips = {s.graded_text for n in nodes for s in decompose(n.get_content(), 8, str(n.metadata.get("title") or ""))}
    built = CorrectiveQueryEngine.from_defaults(
        index=index, llm=None, embed_model=counting, fallback_widen=widen, **INCORRECT
    )
    built.query(QUESTIONS[0])  # the first query builds the sentence index (every sentence embedded once)
    embedded: List[str] = []
    for question in QUESTIONS[1:]:
        counting.texts.clear()
        trace = built.query(question).metadata["crag"]
        assert trace["action"] == "incorrect" and "sentence_window" in trace["fallback_sources"], trace
        embedded += counting.texts
    assert not [t for t in embedded if t in chunks], "a chunk the index embedded was embedded again"
    passages = [t for t in embedded if t not in strips]
    if widen == "chunk":
        assert passages == [], passages
    else:
        assert passages, "a widened window is a new text: it is embedded when it is graded"
    with pytest.raises(ValueError, match="widen_to='sentence'"):
        FallbackRetriever.from_nodes(nodes, embed_model=counting, widen_to="sentence")


class Recording(BaseRetriever):
    """A retriever passing each query to ``inner`` and keeping what it was asked: the words and the texts a dense
    source would embed."""

    def __init__(self, inner: BaseRetriever) -> None:
        self._inner = inner
        self.asked: List[Tuple[str, List[str]]] = []
        super().__init__()

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        self.asked.append((query_bundle.query_str, list(query_bundle.embedding_strs)))
        return self._inner.retrieve(query_bundle)


def test_an_incorrect_correction_embeds_the_question_once_and_searches_words_with_the_rewrite(
    nodes: List[BaseNode], embed_model: Any
) -> None:
    """The primary search embeds the question; the fallback's sentence search reads that vector (one model) and
    BM25 searches the rewrite: a correction calls the model for no query of its own."""
    counting = CountingEmbedding(embed_model)
    index = VectorStoreIndex(nodes, embed_model=counting)
    built = CorrectiveQueryEngine.from_defaults(index=index, llm=None, embed_model=counting, **INCORRECT)
    built.query(QUESTIONS[0])  # builds the sentence index
    for question in QUESTIONS[1:]:
        counting.queries.clear()
        trace = built.query(question).metadata["crag"]
        assert trace["action"] == "incorrect" and trace["rewrite_source"] == "keyword", trace
        assert trace["rewritten_query"] != question and "sentence_window" in trace["fallback_sources"], trace
        assert counting.queries == [question]


def test_a_dense_source_of_another_model_embeds_the_question_with_its_own_model(
    nodes: List[BaseNode], embed_model: Any
) -> None:
    counting, other = CountingEmbedding(embed_model), CountingEmbedding(embed_model, name="another-model")
    words = Recording(BM25Retriever.from_defaults(nodes=list(nodes), similarity_top_k=4))
    fallback = FallbackRetriever({"bm25": words, "sentence_window": SentenceWindowRetriever(nodes, other)})
    built = CorrectiveQueryEngine.from_defaults(
        index=VectorStoreIndex(nodes, embed_model=counting), llm=None, fallback=fallback, **INCORRECT
    )
    for question in QUESTIONS:
        other.queries.clear()
        trace = built.query(question).metadata["crag"]
        assert words.asked[-1] == (trace["rewritten_query"], [question]), trace
        # Not the primary's vector (another model's space), and not the rewrite: the question, by its own model.
        assert other.queries == [question]


def test_a_fallback_back_through_the_primary_searches_with_the_rewrite(nodes: List[BaseNode], embed_model: Any) -> None:
    index = VectorStoreIndex(nodes, embed_model=embed_model)
    primary = Recording(index.as_retriever(similarity_top_k=4))
    built = CorrectiveQueryEngine.from_defaults(
        retriever=primary, llm=None, fallback=FallbackRetriever({"primary": primary}), **INCORRECT
    )
    trace = built.query(QUESTIONS[1]).metadata["crag"]
    rewrite = trace["rewritten_query"]
    assert rewrite != QUESTIONS[1] and primary.asked == [(QUESTIONS[1], [QUESTIONS[1]]), (rewrite, [rewrite])]


def test_the_default_fallback_embeds_its_sentences_with_the_index_s_own_model(
    nodes: List[BaseNode], embed_model: Any
) -> None:
    """An index embedded with a model of its own (another name than the bundled one), no embed_model given and none
    set in Settings: the sentence index is embedded with the index's model, so the question's vector serves both
    searches."""
    own = CountingEmbedding(embed_model, name="the-index-model")
    built = CorrectiveQueryEngine.from_defaults(index=VectorStoreIndex(nodes, embed_model=own), llm=None, **INCORRECT)
    chunks = {n.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes}
    own.texts.clear()
    built.query(QUESTIONS[0])  # builds the sentence index
    assert [t for t in own.texts if t not in chunks], "the sentences were embedded by another model"
    for question in QUESTIONS[1:]:
        own.queries.clear()
        trace = built.query(question).metadata["crag"]
        assert "sentence_window" in trace["fallback_sources"] and own.queries == [question], trace
