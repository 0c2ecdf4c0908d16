"""In-memory search: exact dense search over one contiguous matrix, and sentence windows over it (with the vectors
grading reads: each chunk's and each of its knowledge strips')."""

from __future__ import annotations

import asyncio
import copy
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.node_parser import SentenceWindowNodeParser
from llama_index.core.schema import BaseNode, Document, MetadataMode, NodeWithScore, QueryBundle, TextNode

from llama_index_crag.scope import UNBOUNDED, Scope, ScopeCache
from llama_index_crag.scorers.bi_encoder import IndexVectors, publish
from llama_index_crag.text.strips import decompose


def top_k(
    matrix: np.ndarray, query: np.ndarray, k: int, mask: Optional[np.ndarray] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """Row indices and cosines of the ``k`` rows of ``matrix`` (unit rows) most similar to ``query``, best first;
    with ``mask``, among the rows it marks only."""
    norm = float(np.linalg.norm(query))
    sims = matrix @ (query / norm if norm > 0 else query)
    if mask is not None:
        sims = np.where(mask, sims, -np.inf)
        k = min(k, int(mask.sum()))
    k = min(k, len(sims))
    if k <= 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32)
    best = np.argpartition(-sims, k - 1)[:k] if k < len(sims) else np.arange(len(sims))
    best = best[np.argsort(-sims[best], kind="stable")]
    return best, sims[best]


class MatrixRetriever(BaseRetriever):
    """Dense retrieval over in-memory nodes: their embeddings as one normalised float32 matrix, searched exactly.

    LlamaIndex's default in-memory vector store scores every node in a Python loop; a
    single matrix product over a contiguous array does the same exact search tens of
    times faster (about 50,000 sentence windows of 384 dimensions: a few milliseconds).
    The nodes are embedded once, when the retriever is built. The query's embedding is
    put on the query bundle, as ``VectorIndexRetriever`` does, so grading can reuse it.
    ``scoped`` narrows the search to the nodes a scope admits (a mask over the same matrix).

    Args:
        nodes: The nodes to search.
        embed_model: The model that embeds the nodes and the queries.
        similarity_top_k: Results per query.
    """

    def __init__(self, nodes: Sequence[BaseNode], embed_model: BaseEmbedding, similarity_top_k: int = 5) -> None:
        self._nodes = list(nodes)
        self._embed_model = embed_model
        self._top_k = similarity_top_k
        texts = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in self._nodes]
        vectors = embed_model.get_text_embedding_batch(texts) if texts else []
        matrix = np.ascontiguousarray(np.asarray(vectors, dtype=np.float32).reshape(len(texts), -1))
        matrix /= np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)
        self._matrix = matrix
        self.scope: Scope = UNBOUNDED
        self._mask: Optional[np.ndarray] = None
        super().__init__()

    def scoped(self, scope: Scope) -> MatrixRetriever:
        """This retriever searching only the nodes inside ``scope`` too (sharing the matrix)."""
        other = copy.copy(self)
        other.scope = self.scope.narrow(scope)
        other._mask = np.fromiter((other.scope.admits_node(n) for n in self._nodes), dtype=bool, count=len(self._nodes))
        return other

    def _hits(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        assert query_bundle.embedding is not None
        query = np.asarray(query_bundle.embedding, dtype=np.float32)
        rows, sims = top_k(self._matrix, query, self._top_k, self._mask)
        return [NodeWithScore(node=self._nodes[i], score=float(s)) for i, s in zip(rows, sims)]

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        if query_bundle.embedding is None:
            query_bundle.embedding = self._embed_model.get_agg_embedding_from_queries(query_bundle.embedding_strs)
        return self._hits(query_bundle)

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        if query_bundle.embedding is None:
            query_bundle.embedding = await self._embed_model.aget_agg_embedding_from_queries(
                query_bundle.embedding_strs
            )
        return await asyncio.to_thread(self._hits, query_bundle)


class SentenceWindowRetriever(BaseRetriever):
    """Sentence-level dense retrieval, each hit widened to the chunk that holds it, or to its surrounding window.

    Small passages embed more precisely than whole chunks, so a fact buried in a chunk
    can be found. ``widen_to="chunk"`` (small to big) returns the chunk that holds each
    sentence found, each chunk once at its best sentence's rank: the chunk is what the
    index embedded, so grading it reads the stored vector and embeds nothing at query
    time. ``"window"`` returns ``window_size`` sentences either side of the sentence (a
    text no one embedded before, embedded when it is graded). Each sentence carries its
    chunk's metadata, so ``scoped`` narrows the search to a scope's sentences; scoped
    copies share the one matrix, built on first use.

    ``warm`` builds the index ahead of the first query and, with ``grading_vectors``, also
    embeds in one batch what a bi-encoder of the same model grades: each chunk as the
    index embedded it (what BM25 hands back) and each of its knowledge strips as the
    refiner decomposes it (``decompose`` with ``strip_min_tokens`` and the chunk's title).
    They are held as ``IndexVectors`` and published, so grading a fallback's chunk or
    refining an AMBIGUOUS batch reads them instead of calling the model. An index built by
    its first query leaves them out (that query would pay for them inside its correction
    budget). A widened window is not among them: embedding every window would cost several
    times the corpus, and it is embedded when it is graded.
    """

    def __init__(
        self,
        nodes: Sequence[BaseNode],
        embed_model: Optional[BaseEmbedding] = None,
        window_size: int = 3,
        similarity_top_k: int = 5,
        grading_vectors: bool = True,
        strip_min_tokens: int = 8,
        widen_to: str = "chunk",
    ) -> None:
        if widen_to not in ("chunk", "window"):
            raise ValueError(f"widen_to={widen_to!r}: a sentence hit is widened to its 'chunk' or its 'window'")
        self._nodes = list(nodes)
        self._chunks = {n.node_id: n for n in self._nodes}
        self._widen_to = widen_to
        self._embed_model = embed_model
        self._window_size = window_size
        self._top_k = similarity_top_k
        self._grading_vectors = grading_vectors
        self._strip_min_tokens = strip_min_tokens
        self._built: List[MatrixRetriever] = []  # shared with scoped copies: the windows are embedded once
        self._graded: List[IndexVectors] = []  # the vectors grading reads, shared likewise
        self._masks = ScopeCache()
        self._lock = threading.Lock()
        self.scope: Scope = UNBOUNDED
        super().__init__()

    def scoped(self, scope: Scope) -> SentenceWindowRetriever:
        """This retriever searching only the windows inside ``scope`` too."""
        other = copy.copy(self)
        other.scope = self.scope.narrow(scope)
        return other

    def warm(self) -> None:
        """Build the index now, with the vectors grading reads (``grading_vectors``), not in a query."""
        self._inner(grading=self._grading_vectors)

    def _inner(self, grading: bool = False) -> MatrixRetriever:
        from llama_index_crag.local.models import settings_or_default_embed_model

        with self._lock:
            if grading and not self._graded:
                self._graded.append(
                    grading_vectors(
                        self._nodes, self._embed_model or settings_or_default_embed_model(), self._strip_min_tokens
                    )
                )
                publish(self._graded[0])
            if not self._built:
                # One contiguous matrix product over every window (tens of ms on SciFact's 47,578 windows,
                # against about two seconds through SimpleVectorStore's per-vector loop).
                self._built.append(
                    MatrixRetriever(
                        sentence_windows(self._nodes, self._window_size),
                        self._embed_model or settings_or_default_embed_model(),
                        self._top_k * 2,
                    )
                )
            inner = self._built[0]
        if not self.scope.bounded:
            return inner
        return self._masks.get(self.scope, lambda: inner.scoped(self.scope))  # type: ignore[no-any-return]

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        hits = self._inner().retrieve(query_bundle)
        if self._widen_to == "window":
            return _widen(hits)
        # Small to big: the chunk that holds the sentence, as the index holds it (its vector is stored there),
        # each chunk once, at its best sentence's rank.
        chunks: Dict[str, NodeWithScore] = {}
        for hit in hits:
            chunk = self._chunks.get(hit.node.ref_doc_id or "")
            if chunk is not None and chunk.node_id not in chunks:
                chunks[chunk.node_id] = NodeWithScore(node=chunk, score=hit.score)
        return list(chunks.values())[: self._top_k]

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


def grading_vectors(nodes: Sequence[BaseNode], embed_model: BaseEmbedding, strip_min_tokens: int = 8) -> IndexVectors:
    """The vectors of what a bi-encoder grades of ``nodes``: each node's text as an index embeds it (metadata
    included) and each of its knowledge strips as ``StripRefiner`` grades it, each distinct text embedded once."""
    texts = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes]
    for node in nodes:
        title = str(node.metadata.get("title") or "")
        texts.extend(s.graded_text for s in decompose(node.get_content(), strip_min_tokens, title))
    distinct = sorted(dict.fromkeys(t for t in texts if t.strip()), key=len)  # batches of like lengths pad least
    vectors = embed_model.get_text_embedding_batch(distinct) if distinct else []
    return IndexVectors(embed_model.model_name, distinct, vectors)


def sentence_windows(nodes: Sequence[BaseNode], window_size: int = 3) -> List[BaseNode]:
    """The sentence nodes of ``nodes``, each carrying its window of ``window_size`` neighbours either side."""
    parser = SentenceWindowNodeParser.from_defaults(window_size=window_size)
    documents = [
        Document(
            text=n.get_content(),
            metadata=dict(n.metadata),
            id_=n.node_id,
            excluded_embed_metadata_keys=list(n.excluded_embed_metadata_keys),  # a tenant name is not embedded
            excluded_llm_metadata_keys=list(n.excluded_llm_metadata_keys),
        )
        for n in nodes
    ]
    return parser.get_nodes_from_documents(documents)


def _widen(hits: List[NodeWithScore]) -> List[NodeWithScore]:
    widened = []
    for hit in hits:
        metadata = {k: v for k, v in hit.node.metadata.items() if k not in ("window", "original_text")}
        text = hit.node.metadata.get("window") or hit.node.get_content()
        node = TextNode(
            text=text,
            metadata=metadata,
            excluded_embed_metadata_keys=[k for k in hit.node.excluded_embed_metadata_keys if k in metadata],
            excluded_llm_metadata_keys=[k for k in hit.node.excluded_llm_metadata_keys if k in metadata],
        )
        widened.append(NodeWithScore(node=node, score=hit.score))
    return widened
