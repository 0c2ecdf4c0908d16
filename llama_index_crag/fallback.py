"""FallbackRetriever: the second retrieval of the INCORRECT branch (BM25, sentence windows), chained."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Dict, List, Literal, Mapping, Optional, Sequence

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.callbacks import CallbackManager
from llama_index.core.node_parser import SentenceWindowNodeParser
from llama_index.core.schema import BaseNode, Document, MetadataMode, NodeWithScore, QueryBundle, TextNode

if TYPE_CHECKING:
    from llama_index_crag.web.retriever import WebSearchRetriever

SOURCE_KEY = "crag_source"
Mode = Literal["chain", "first"]


class FallbackRetriever(BaseRetriever):
    """Retrieves through several named retrievers and tags each result with its source.

    ``mode="chain"`` asks every source and interleaves their results rank by rank
    (first occurrence of a passage wins); ``mode="first"`` stops at the first source
    that returns anything. Each result's metadata gets ``crag_source`` (hidden from the
    LLM and the embedder) so traces and answers can say where a passage came from.

    Args:
        retrievers: Source name to retriever, asked in this order.
        similarity_top_k: Results kept after merging.
        mode: ``"chain"`` or ``"first"``.
    """

    def __init__(
        self,
        retrievers: Mapping[str, BaseRetriever],
        similarity_top_k: int = 5,
        mode: Mode = "chain",
        callback_manager: Optional[CallbackManager] = None,
    ) -> None:
        if not retrievers:
            raise ValueError("FallbackRetriever needs at least one retriever")
        if mode not in ("chain", "first"):
            raise ValueError(f"mode must be 'chain' or 'first', not {mode!r}")
        self.retrievers: Dict[str, BaseRetriever] = dict(retrievers)
        self.similarity_top_k = similarity_top_k
        self.mode = mode
        super().__init__(callback_manager=callback_manager)

    @classmethod
    def from_nodes(
        cls,
        nodes: Sequence[BaseNode],
        sources: Sequence[str] = ("bm25", "sentence_window"),
        similarity_top_k: int = 5,
        embed_model: Optional[BaseEmbedding] = None,
        window_size: int = 3,
        mode: Mode = "chain",
    ) -> FallbackRetriever:
        """Build the standard sources over the same nodes as the primary index.

        ``"bm25"`` is a BM25 index over the nodes (catches exact terms, codes and names
        that dense retrieval misses); ``"sentence_window"`` is a sentence-level vector
        index whose hits are widened to ``window_size`` sentences each side (built on
        first use, since it embeds every sentence).
        """
        nodes = [n for n in nodes if n.get_content().strip()]
        if not nodes:
            raise ValueError("FallbackRetriever.from_nodes needs at least one node with text")
        built: Dict[str, BaseRetriever] = {}
        for source in sources:
            if source == "bm25":
                from llama_index.retrievers.bm25 import BM25Retriever

                built[source] = BM25Retriever.from_defaults(
                    nodes=list(nodes), similarity_top_k=min(similarity_top_k, len(nodes))
                )
            elif source == "sentence_window":
                built[source] = SentenceWindowRetriever(nodes, embed_model, window_size, similarity_top_k)
            else:
                raise ValueError(
                    f"unknown fallback source {source!r}: use 'bm25' or 'sentence_window' "
                    "(the web source is added with FallbackRetriever.with_web, or web= on the engine)"
                )
        return cls(built, similarity_top_k=similarity_top_k, mode=mode)

    @classmethod
    def with_web(cls, base: BaseRetriever, web: WebSearchRetriever, similarity_top_k: int = 5) -> FallbackRetriever:
        """``base``'s sources followed by the opt-in ``"web"`` source.

        The web's strips get room of their own (its ``max_strips``) on top of
        ``similarity_top_k``, so local results cannot crowd them out before grading.
        """
        if isinstance(base, FallbackRetriever):
            sources, mode = {**base.retrievers, "web": web}, base.mode
        else:
            sources, mode = {"fallback": base, "web": web}, "chain"
        return cls(sources, similarity_top_k=similarity_top_k + web.settings.max_strips, mode=mode)

    @classmethod
    def class_name(cls) -> str:
        return "FallbackRetriever"

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        batches: List[List[NodeWithScore]] = []
        for name, retriever in self.retrievers.items():
            batches.append(_tag(name, retriever.retrieve(query_bundle)))
            if self.mode == "first" and batches[-1]:
                break
        return self._merge(batches)

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        if self.mode == "first":
            for name, retriever in self.retrievers.items():
                found = _tag(name, await retriever.aretrieve(query_bundle))
                if found:
                    return self._merge([found])
            return []
        results = await asyncio.gather(*(r.aretrieve(query_bundle) for r in self.retrievers.values()))
        return self._merge([_tag(name, found) for name, found in zip(self.retrievers, results)])

    def _merge(self, batches: List[List[NodeWithScore]]) -> List[NodeWithScore]:
        """Interleave the sources' results rank by rank, so each source is heard, dropping repeats."""
        seen: set[str] = set()
        merged: List[NodeWithScore] = []
        for rank in range(max((len(b) for b in batches), default=0)):
            for batch in batches:
                if rank < len(batch):
                    key = batch[rank].node.get_content(metadata_mode=MetadataMode.NONE).strip()
                    if key and key not in seen:
                        seen.add(key)
                        merged.append(batch[rank])
        return merged[: self.similarity_top_k]


def _tag(source: str, hits: List[NodeWithScore]) -> List[NodeWithScore]:
    tagged = []
    for hit in hits:
        node = hit.node.model_copy(deep=True)
        node.metadata[SOURCE_KEY] = source
        for excluded in (node.excluded_llm_metadata_keys, node.excluded_embed_metadata_keys):
            if SOURCE_KEY not in excluded:
                excluded.append(SOURCE_KEY)
        tagged.append(NodeWithScore(node=node, score=hit.score))
    return tagged


class SentenceWindowRetriever(BaseRetriever):
    """Sentence-level dense retrieval, each hit widened to its surrounding window.

    Small passages embed more precisely than whole chunks, so a fact buried in a long
    chunk can be found; the window gives the generator enough context to use it.
    """

    def __init__(
        self,
        nodes: Sequence[BaseNode],
        embed_model: Optional[BaseEmbedding] = None,
        window_size: int = 3,
        similarity_top_k: int = 5,
    ) -> None:
        self._nodes = list(nodes)
        self._embed_model = embed_model
        self._window_size = window_size
        self._top_k = similarity_top_k
        self._index_retriever: Optional[BaseRetriever] = None
        self._lock = threading.Lock()
        super().__init__()

    def _inner(self) -> BaseRetriever:
        with self._lock:
            if self._index_retriever is None:
                from llama_index_crag.dense import MatrixRetriever
                from llama_index_crag.models import default_embed_model

                # One contiguous matrix product over every window (tens of ms on SciFact's 47,578 windows,
                # against about two seconds through SimpleVectorStore's per-vector loop).
                self._index_retriever = MatrixRetriever(
                    sentence_windows(self._nodes, self._window_size),
                    self._embed_model or default_embed_model(),
                    self._top_k * 2,
                )
            return self._index_retriever

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return _widen(self._inner().retrieve(query_bundle))

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


def sentence_windows(nodes: Sequence[BaseNode], window_size: int = 3) -> List[BaseNode]:
    """The sentence nodes of ``nodes``, each carrying its window of ``window_size`` neighbours either side."""
    parser = SentenceWindowNodeParser.from_defaults(window_size=window_size)
    documents = [Document(text=n.get_content(), metadata=dict(n.metadata), id_=n.node_id) for n in nodes]
    return parser.get_nodes_from_documents(documents)


def _widen(hits: List[NodeWithScore]) -> List[NodeWithScore]:
    widened = []
    for hit in hits:
        metadata = {k: v for k, v in hit.node.metadata.items() if k not in ("window", "original_text")}
        text = hit.node.metadata.get("window") or hit.node.get_content()
        widened.append(NodeWithScore(node=TextNode(text=text, metadata=metadata), score=hit.score))
    return widened
