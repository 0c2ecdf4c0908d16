"""FallbackRetriever: the second retrieval of the INCORRECT branch (BM25, sentence windows), chained."""

from __future__ import annotations

import asyncio
import copy
from typing import TYPE_CHECKING, Any, Dict, List, Literal, Mapping, Optional, Sequence

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle

from llama_index_crag.scope import Scope, scoped_retriever

if TYPE_CHECKING:
    from llama_index_crag.web.retriever import WebSearchRetriever

SOURCE_KEY = "crag_source"
#: Metadata key set (True) on hits of a source outside every document scope (the opt-in web), and removed from
#: every other hit, so that no stored metadata can claim it.
OUTSIDE_SCOPE_KEY = "crag_outside_scope"
Mode = Literal["chain", "first"]


class FallbackRetriever(BaseRetriever):
    """Retrieves through several named retrievers and tags each result with its source.

    ``mode="chain"`` asks every source and interleaves their results rank by rank
    (first occurrence of a passage wins); ``mode="first"`` stops at the first source
    that returns anything. Each result's metadata gets ``crag_source`` (hidden from the
    LLM and the embedder) so traces and answers can say where a passage came from.
    ``scoped`` narrows every document source to a scope (the web, outside every document
    scope, is asked as it is; its hits are marked ``crag_outside_scope``).

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
        callback_manager: Optional[CallbackManager] = None,
        widen_to: str = "chunk",
    ) -> FallbackRetriever:
        """Build the standard sources over the same nodes as the primary index.

        ``"bm25"`` is a BM25 index over the nodes (catches exact terms, codes and names
        that dense retrieval misses); ``"sentence_window"`` is a sentence-level vector
        index whose hits are widened to the node that holds them (``widen_to="chunk"``: small to
        big, each node once) or to ``window_size`` sentences each side (``"window"``); it is built on
        first use, since it embeds every sentence.
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
                from llama_index_crag.stores.memory import SentenceWindowRetriever

                built[source] = SentenceWindowRetriever(
                    nodes, embed_model, window_size, similarity_top_k, widen_to=widen_to
                )
            else:
                raise ValueError(
                    f"unknown fallback source {source!r}: use 'bm25' or 'sentence_window' "
                    "(the web source is added with FallbackRetriever.with_web, or web= on the engine)"
                )
        return cls(built, similarity_top_k=similarity_top_k, mode=mode, callback_manager=callback_manager)

    @classmethod
    def with_web(
        cls,
        base: BaseRetriever,
        web: WebSearchRetriever,
        similarity_top_k: int = 5,
        callback_manager: Optional[CallbackManager] = None,
    ) -> FallbackRetriever:
        """``base``'s sources followed by the opt-in ``"web"`` source.

        The web's strips get room of their own (its ``max_strips``) on top of
        ``similarity_top_k``, so local results cannot crowd them out before grading.
        """
        if isinstance(base, FallbackRetriever):
            sources, mode = {**base.retrievers, "web": web}, base.mode
        else:
            sources, mode = {"fallback": base, "web": web}, "chain"
        return cls(
            sources,
            similarity_top_k=similarity_top_k + web.settings.max_strips,
            mode=mode,
            callback_manager=callback_manager or base.callback_manager,
        )

    @classmethod
    def class_name(cls) -> str:
        return "FallbackRetriever"

    def warm(self) -> FallbackRetriever:
        """Build every source's index now rather than in the first query that falls back; the sentence windows
        also embed what grading reads (``SentenceWindowRetriever.warm``), so that no correction embeds a chunk
        or a knowledge strip again."""
        for retriever in self.retrievers.values():
            warm = getattr(retriever, "warm", None)
            if callable(warm):
                warm()
        return self

    def scoped(self, scope: Scope) -> FallbackRetriever:
        """This fallback with every source narrowed to ``scope`` (``scope.scoped_retriever``; a ``ScopeError``
        for a source that cannot be narrowed), sharing their indexes and models."""
        other = copy.copy(self)
        other.retrievers = {
            name: r if _outside_scope(r) else scoped_retriever(r, scope) for name, r in self.retrievers.items()
        }
        return other

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        batches: List[List[NodeWithScore]] = []
        for name, retriever in self.retrievers.items():
            batches.append(_tag(name, retriever.retrieve(query_bundle), _outside_scope(retriever)))
            if self.mode == "first" and batches[-1]:
                break
        return self._merge(batches)

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        if self.mode == "first":
            for name, retriever in self.retrievers.items():
                found = _tag(name, await retriever.aretrieve(query_bundle), _outside_scope(retriever))
                if found:
                    return self._merge([found])
            return []
        results = await asyncio.gather(*(r.aretrieve(query_bundle) for r in self.retrievers.values()))
        return self._merge(
            [_tag(name, found, _outside_scope(r)) for (name, r), found in zip(self.retrievers.items(), results)]
        )

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


def fallback_query(question: QueryBundle, search: str, primary: Any, fallback: Any) -> QueryBundle:
    """What the fallback searches with: ``search`` (the rewrite) for its sparse sources, the question for its dense.

    BM25, full-text search and the web match words, and the rewrite is made for them (abbreviations
    expanded, names added, or the question's keywords). A dense source embeds the question itself
    (``custom_embedding_strs``): an embedding model is trained on questions, and a keyword rewrite embeds
    worse than the question it came from. The question's vector is already on ``question`` when the primary
    retriever embedded it; it is handed on when every dense source of the fallback embeds with a model of
    the primary's name, so an INCORRECT correction embeds no query a second time. A fallback that searches
    back through the primary retriever (its ``"primary"`` source: there are no nodes to build other sources
    over) searches everything with the rewrite, which is then all that makes its search another one.
    """
    if isinstance(fallback, FallbackRetriever) and "primary" in fallback.retrievers:
        return QueryBundle(search)
    bundle = QueryBundle(query_str=search, custom_embedding_strs=list(question.embedding_strs))
    primary_model = getattr(primary, "_embed_model", None)
    models = query_models(fallback)
    if (
        question.embedding is not None
        and isinstance(primary_model, BaseEmbedding)
        and models is not None
        and all(m.model_name == primary_model.model_name for m in models)
    ):
        bundle.embedding = list(question.embedding)
    return bundle


def query_models(retriever: Any) -> Optional[List[BaseEmbedding]]:
    """The embedding models ``retriever`` embeds a query with (none for BM25, full-text search or the web), or
    None when that cannot be told (a retriever of another kind, or a dense one that has no model yet)."""
    from llama_index.retrievers.bm25 import BM25Retriever

    if isinstance(retriever, FallbackRetriever):
        found: List[BaseEmbedding] = []
        for source in retriever.retrievers.values():
            models = query_models(source)
            if models is None:
                return None
            found.extend(models)
        return found
    model = getattr(retriever, "_embed_model", None)
    if isinstance(model, BaseEmbedding):
        return [model]
    inner = getattr(retriever, "_inner", None)
    if isinstance(inner, BaseRetriever):  # a view or wrapper over another retriever
        return query_models(inner)
    if isinstance(retriever, BM25Retriever) or getattr(retriever, "embeds_queries", None) is False:
        return []
    return None


def _outside_scope(retriever: BaseRetriever) -> bool:
    """Whether ``retriever`` searches outside every document scope (the web source)."""
    from llama_index_crag.web.retriever import WebSearchRetriever

    return isinstance(retriever, WebSearchRetriever)


def _tag(source: str, hits: List[NodeWithScore], outside_scope: bool = False) -> List[NodeWithScore]:
    tagged = []
    for hit in hits:
        node = hit.node.model_copy(deep=True)
        node.metadata[SOURCE_KEY] = source
        node.metadata.pop(OUTSIDE_SCOPE_KEY, None)
        if outside_scope:
            node.metadata[OUTSIDE_SCOPE_KEY] = True
        for excluded in (node.excluded_llm_metadata_keys, node.excluded_embed_metadata_keys):
            for key in (SOURCE_KEY, OUTSIDE_SCOPE_KEY):
                if key not in excluded:
                    excluded.append(key)
        tagged.append(NodeWithScore(node=node, score=hit.score))
    return tagged
