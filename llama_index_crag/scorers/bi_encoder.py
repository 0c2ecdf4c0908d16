"""Bi-encoder scorer: cosine similarity from an embedding model (the offline default)."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import NodeWithScore, QueryBundle

from llama_index_crag.scorers.base import RelevanceScorer, node_text

BUNDLED_MODEL_NAME = "all-MiniLM-L6-v2"


class BiEncoderScorer(RelevanceScorer):
    """Scores a passage by the cosine similarity of its embedding to the query's.

    Normalisation: the cosine, clipped to [0, 1] (negative cosines mean unrelated).
    Passage and query embeddings are cached (keyed by a hash of the text), so a
    corpus node that comes back for many queries is embedded once; ``remember``
    seeds the cache with embeddings an index already holds.

    Args:
        embed_model: Any LlamaIndex embedding model; defaults to ``Settings.embed_model`` when one is set,
            else the bundled MiniLM. The shipped thresholds are the bundled MiniLM's: another model has none.
        cache_size: How many passage embeddings to keep.
    """

    normalization = "cosine similarity clipped to [0, 1]"
    #: For the bundled MiniLM only, read off its scores on the bundled sample corpus (off-topic
    #: questions top out at 0.26, answerable ones start at 0.38); calibrate on your own data.
    BUNDLED_THRESHOLDS = {"upper": 0.55, "lower": 0.30}

    def __init__(self, embed_model: Optional[BaseEmbedding] = None, cache_size: int = 50_000) -> None:
        from llama_index_crag.local.bundled import bundled_embedding_path
        from llama_index_crag.local.models import settings_or_default_embed_model

        self.embed_model = embed_model or settings_or_default_embed_model()
        self.default_thresholds: Optional[Dict[str, float]] = None
        self.name = f"bi-encoder:{self.embed_model.model_name}"
        if self.embed_model.model_name == str(bundled_embedding_path()):
            self.name = f"bi-encoder:{BUNDLED_MODEL_NAME}"
            self.default_thresholds = dict(self.BUNDLED_THRESHOLDS)
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def remember(self, texts: Sequence[str], vectors: Union[np.ndarray, Sequence[Sequence[float]]]) -> None:
        """Seed the cache with embeddings computed elsewhere (an index's, or a query's)."""
        with self._lock:
            for text, vector in zip(texts, vectors):
                self._cache[_key(text)] = _unit(vector)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def _query_vector(self, query: str) -> np.ndarray:
        with self._lock:
            cached = self._cache.get(_key("\x00query\x00" + query))
        if cached is not None:
            return cached
        vector = self.embed_model.get_query_embedding(query)
        self.remember(["\x00query\x00" + query], [vector])
        return _unit(vector)

    def remember_queries(self, queries: Sequence[str], vectors: Sequence[Sequence[float]]) -> None:
        """Seed the cache with query embeddings (a retriever computed them already)."""
        self.remember(["\x00query\x00" + q for q in queries], vectors)

    def _embed_passages(self, texts: Sequence[str]) -> np.ndarray:
        keys = [_key(t) for t in texts]
        with self._lock:
            cached = {k: self._cache[k] for k in keys if k in self._cache}
        missing = [(k, t) for k, t in zip(keys, texts) if k not in cached]
        if missing:
            unique = dict(missing)
            vectors = self.embed_model.get_text_embedding_batch(list(unique.values()))
            fresh = {k: _unit(v) for k, v in zip(unique.keys(), vectors)}
            cached.update(fresh)
            with self._lock:
                self._cache.update(fresh)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return np.stack([cached[k] for k in keys])

    def score_texts(self, query: str, texts: Sequence[str]) -> List[float]:
        if not texts:
            return []
        sims = self._embed_passages(texts) @ self._query_vector(query)
        return [float(min(1.0, max(0.0, s))) for s in sims]


def _key(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def _unit(vector: Sequence[float]) -> np.ndarray:
    array = np.asarray(vector, dtype=np.float32)
    norm = float(np.linalg.norm(array))
    return array / norm if norm > 0 else array


def bi_encoder_of(scorer: RelevanceScorer) -> Optional[BiEncoderScorer]:
    """The bi-encoder a scorer embeds with: itself, or the one inside it (the evidence scorer's); else None."""
    found = scorer if isinstance(scorer, BiEncoderScorer) else scorer.bi_encoder
    return found if isinstance(found, BiEncoderScorer) else None


def reuse_retrieval_embeddings(
    scorer: RelevanceScorer, retriever: Any, query_bundle: QueryBundle, nodes: Sequence[NodeWithScore]
) -> int:
    """Hand a bi-encoder-based scorer the embeddings a dense retriever already has, so grading embeds nothing again.

    Only when the retriever embedded with a model of the same name as the scorer's:
    the query's embedding (set on ``query_bundle`` by ``VectorIndexRetriever``), and
    each candidate's, from ``node.embedding`` or the vector store's ``get`` (an
    in-memory ``SimpleVectorStore``). The vectors are keyed by the text the index
    embedded, so a postprocessor that rewrites a node later gets no stale vector.
    Returns how many passage embeddings were reused.
    """
    bi_encoder = bi_encoder_of(scorer)
    embed_model = getattr(retriever, "_embed_model", None)
    if bi_encoder is None or not isinstance(embed_model, BaseEmbedding):
        return 0
    if embed_model.model_name != bi_encoder.embed_model.model_name:
        return 0
    if query_bundle.embedding is not None and query_bundle.embedding_strs == [query_bundle.query_str]:
        bi_encoder.remember_queries([query_bundle.query_str], [query_bundle.embedding])
    store = getattr(retriever, "_vector_store", None)
    lookup = getattr(store, "get", None) if getattr(store, "stores_text", True) is False else None
    texts: List[str] = []
    vectors: List[List[float]] = []
    for candidate in nodes:
        vector = candidate.node.embedding
        if vector is None and lookup is not None:
            try:
                vector = lookup(candidate.node.node_id)
            except (KeyError, TypeError, ValueError):
                vector = None
        if vector:
            texts.append(node_text(candidate))
            vectors.append(list(vector))
    if texts:
        bi_encoder.remember(texts, vectors)
    return len(texts)
