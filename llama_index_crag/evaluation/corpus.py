"""The evaluated index: embedded once and cached on disk, with a per-question view that hides gold documents."""

from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import FrozenSet, Iterable, Iterator, List, Optional, Sequence

from llama_index.core import VectorStoreIndex
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import BaseNode, NodeWithScore, QueryBundle

from llama_index_crag.core.fallback import FallbackRetriever
from llama_index_crag.core.settings import CragSettings
from llama_index_crag.datasets import load_documents
from llama_index_crag.evaluation.dataset import EvalQuestion
from llama_index_crag.local.embedding_cache import corpus_cache
from llama_index_crag.scope import UNBOUNDED, Scope, retriever_scope, scoped_retriever
from llama_index_crag.stores.chunking import chunk


class CorpusView:
    """Which documents the questions may see: all of them, or all but a question's gold documents.

    The out-of-corpus protocol asks an answerable question of an index built without
    its relevant documents. Re-embedding the corpus per question would cost minutes, so
    every retriever of the evaluation reads through a ``ViewRetriever`` that drops the
    hidden documents from a slightly wider result instead.
    """

    def __init__(self) -> None:
        self.hidden: FrozenSet[str] = frozenset()

    @contextmanager
    def without(self, doc_ids: Iterable[str]) -> Iterator[None]:
        """Hide ``doc_ids`` from every retriever of this view for the duration of the block."""
        self.hidden = frozenset(doc_ids)
        try:
            yield
        finally:
            self.hidden = frozenset()


class ViewRetriever(BaseRetriever):
    """Retrieves through ``inner``, drops the documents the view hides, and keeps the first ``keep``."""

    def __init__(self, inner: BaseRetriever, view: CorpusView, keep: int) -> None:
        self._inner = inner
        self._view = view
        self._keep = keep
        # What ``reuse_retrieval_embeddings`` reads, so grading through the view reuses the index's
        # embeddings as it would on the bare retriever.
        self._embed_model = getattr(inner, "_embed_model", None)
        self._vector_store = getattr(inner, "_vector_store", None)
        super().__init__()

    @property
    def scope(self) -> Scope:
        """The inner retriever's scope (the view hides documents, it never widens what the inner one reads)."""
        return retriever_scope(self._inner) or UNBOUNDED

    def scoped(self, scope: Scope) -> ViewRetriever:
        """This view over the inner retriever narrowed to ``scope``."""
        return ViewRetriever(scoped_retriever(self._inner, scope), self._view, self._keep)

    def _visible(self, hits: List[NodeWithScore]) -> List[NodeWithScore]:
        hidden = self._view.hidden
        return [h for h in hits if h.node.metadata.get("doc_id") not in hidden][: self._keep]

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return self._visible(self._inner.retrieve(query_bundle))

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return self._visible(await self._inner.aretrieve(query_bundle))


@dataclass
class EvalCorpus:
    """A dataset's vector index and fallback retriever, shared by every evaluated system.

    ``margin`` is the most chunks any question's gold documents have: retrieving
    ``keep + margin`` and dropping the hidden ones leaves ``keep`` results, exactly the
    top ``keep`` of an index built without them.
    """

    nodes: List[BaseNode]
    index: VectorStoreIndex
    fallback: FallbackRetriever
    view: CorpusView
    margin: int

    @classmethod
    def build(
        cls,
        folder: Path,
        questions: Sequence[EvalQuestion],
        cache_dir: Path,
        top_k: int,
        embed_model: Optional[BaseEmbedding] = None,
        progress: bool = False,
        split: str = "all",
    ) -> EvalCorpus:
        """Chunk, embed (through the cache) and index the corpus (one half of it, ``datasets.Halves``), and build and
        warm the fallback."""
        from llama_index_crag.local.models import default_embed_model

        inner = embed_model or default_embed_model()
        cached = corpus_cache(inner, Path(folder) / "corpus.jsonl", cache_dir, progress)
        nodes = chunk(load_documents(folder, split))
        index = VectorStoreIndex(nodes, embed_model=cached, show_progress=progress)
        per_doc = Counter(n.metadata.get("doc_id") for n in nodes)
        margin = max((sum(per_doc[d] for d in q.question.relevant_doc_ids) for q in questions), default=0)
        # Sentence windows of one hidden document can fill a fallback result: ask it for more.
        # The fallback widens as the engine's would (CRAG_FALLBACK_WIDEN, else the setting's default).
        widen = os.environ.get("CRAG_FALLBACK_WIDEN") or str(CragSettings.model_fields["fallback_widen"].default)
        fallback = FallbackRetriever.from_nodes(
            nodes, similarity_top_k=2 * (top_k + margin), embed_model=cached, widen_to=widen
        )
        fallback.retrieve(QueryBundle("warm-up"))  # builds BM25 and embeds the sentence windows now, not in a query
        return cls(nodes=nodes, index=index, fallback=fallback, view=CorpusView(), margin=margin)

    def retriever(self, keep: int) -> BaseRetriever:
        """The vector retriever of the top ``keep`` visible chunks."""
        return ViewRetriever(self.index.as_retriever(similarity_top_k=keep + self.margin), self.view, keep)

    def fallback_retriever(self, keep: int) -> BaseRetriever:
        """The fallback retriever (BM25 and sentence windows) of the top ``keep`` visible results."""
        return ViewRetriever(self.fallback, self.view, keep)
