"""Grading over the PostgreSQL store: the IDF of the query's words only, stored embeddings reused."""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle

from llama_index_crag.errors import ConfigError
from llama_index_crag.scorers.base import RelevanceScorer, node_text
from llama_index_crag.scorers.bi_encoder import bi_encoder_of
from llama_index_crag.scorers.evidence import EvidenceScorer, idf
from llama_index_crag.stores.postgres.store import PostgresStore
from llama_index_crag.text.split import terms

if TYPE_CHECKING:
    pass


class StoredIdf(Mapping[str, float]):
    """The evidence scorer's IDF table, read from the store a word at a time and kept for a while.

    Only the words queries use are ever read (about ten a query); each is kept for
    ``ttl_s`` seconds so that documents ingested meanwhile change the weights soon.
    ``prefetch`` reads a query's words in one round trip.

    The frequencies are over every chunk of the store, whatever a caller's scope: counts of documents
    holding a word, never text, so no passage outside the scope can reach the caller through them
    (scoping them would need a count per word and scope, for a weight that only ranks passages inside it).

    Args:
        store: The store.
        ttl_s: How long a word's weight (and the chunk count) is trusted.
        max_words: Words kept at most.
    """

    def __init__(self, store: PostgresStore, ttl_s: float = 60.0, max_words: int = 100_000) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._max_words = max_words
        self._weights: Dict[str, Tuple[float, Optional[float]]] = {}
        self._lock = threading.Lock()
        self._size = 0
        self._size_at = -math.inf

    @property
    def size(self) -> int:
        """The store's chunk count (re-read after ``ttl_s``)."""
        if time.monotonic() - self._size_at > self._ttl_s:
            self._size, self._size_at = self._store.chunk_count(), time.monotonic()
        return self._size

    def prefetch(self, words: Sequence[str]) -> None:
        """Read the weights of those of ``words`` not known (or known too long) in one query."""
        now = time.monotonic()
        with self._lock:
            stale = [w for w in set(words) if w not in self._weights or now - self._weights[w][0] > self._ttl_s]
        if not stale:
            return
        size = self.size
        found = self._store.term_frequencies(stale)
        with self._lock:
            if len(self._weights) + len(stale) > self._max_words:
                self._weights.clear()
            for word in stale:
                self._weights[word] = (now, idf(size, found[word]) if word in found else None)

    def _weight(self, word: str) -> Optional[float]:
        self.prefetch([word])
        with self._lock:
            return self._weights[word][1]

    def __getitem__(self, word: str) -> float:
        weight = self._weight(word)
        if weight is None:
            raise KeyError(word)
        return weight

    def __contains__(self, word: object) -> bool:
        return isinstance(word, str) and self._weight(word) is not None

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[str]:
        """Every word of the store, streamed (for export; the scorer never iterates)."""
        with self._store.connection() as conn, conn.transaction():
            cursor = conn.cursor(name="crag_terms_export")
            cursor.execute(f"SELECT term FROM {self._store.name('terms')}")
            for (term,) in cursor:
                yield term


class StoredEvidence(BaseNodePostprocessor):
    """Hands the scorer what the store already holds for a query, before grading.

    For every candidate that carries a stored embedding (the store's retrievers return
    them), the scorer's bi-encoder is given that vector instead of embedding the text
    again; the vector is then dropped from the node so it travels no further. And the
    IDF weights of the query's words are read from the store in one round trip. Runs as
    the engine's node postprocessor, so it sees both the primary and the fallback hits.
    """

    idf_ttl_s: float = Field(default=60.0, description="How long a word's IDF weight is trusted.")
    _scorer: RelevanceScorer = PrivateAttr()
    _idf: Optional[StoredIdf] = PrivateAttr()

    def __init__(self, scorer: RelevanceScorer, idf: Optional[StoredIdf] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._scorer = scorer
        self._idf = idf

    @classmethod
    def class_name(cls) -> str:
        return "StoredEvidence"

    def _postprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        bi_encoder = bi_encoder_of(self._scorer)
        texts, vectors, kept = [], [], []
        for hit in nodes:
            if hit.node.embedding is not None:
                texts.append(node_text(hit))
                vectors.append(hit.node.embedding)
                node = hit.node.model_copy()
                node.embedding = None
                hit = NodeWithScore(node=node, score=hit.score)
            kept.append(hit)
        if bi_encoder is not None and texts:
            bi_encoder.remember(texts, vectors)
        if self._idf is not None and query_bundle is not None:
            self._idf.prefetch(terms(query_bundle.query_str))
        return kept


def stored_scorer(
    store: PostgresStore, embed_model: BaseEmbedding, grader: Optional[str] = None, idf_ttl_s: float = 60.0
) -> Tuple[EvidenceScorer, StoredIdf]:
    """The evidence scorer (or the reader cascade of ``grader``) weighing words by the store's IDF, read on demand."""
    from llama_index_crag.scorers.registry import default_scorer

    scorer = default_scorer(embed_model, grader=grader)
    if not isinstance(scorer, EvidenceScorer):
        raise ConfigError(
            f"the grader {scorer.name} cannot weigh words by the store's IDF: use the evidence scorer or a reader"
        )
    weights = StoredIdf(store, ttl_s=idf_ttl_s)
    scorer.use_idf(weights, weights.size)
    return scorer, weights
