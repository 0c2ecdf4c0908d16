"""Bi-encoder scorer: cosine similarity from an embedding model (the offline default); and the model's window.

An embedding model reads a bounded number of word pieces (the bundled MiniLM: 256, two of them its own markers)
and silently drops the rest: a passage longer than that is embedded from its beginning alone. ``EmbeddingWindow``
says how long that window is and counts a text's word pieces with the model's own tokenizer, so that ingest cuts
chunks the model reads whole (``stores/chunking.py``) and the scorer reads a longer passage in windows.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import re
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import NodeWithScore, QueryBundle

from llama_index_crag.scorers.base import RelevanceScorer, node_text
from llama_index_crag.text.split import split_sentences

BUNDLED_MODEL_NAME = "all-MiniLM-L6-v2"
#: Word pieces per word or punctuation mark, for a model whose tokenizer cannot be read (a remote API's): the
#: bundled MiniLM's tokenizer gives 1.14 on the PostgreSQL manual's pages (identifiers such as work_mem cut into
#: several pieces); 1.3 errs on the side of chunks a little shorter than the window.
ESTIMATED_PIECES_PER_WORD = 1.3
#: The window assumed for a model that states none: the bundled MiniLM's, the smallest of the common ones.
DEFAULT_WINDOW = 256
#: Long passages whose windows are kept between calls (the text of each, about its own size again).
LONG_PASSAGES_KEPT = 4096
_WORDS = re.compile(r"\w+|[^\w\s]")


class EmbeddingWindow:
    """How much of a text an embedding model reads: ``tokens`` word pieces, its own markers ([CLS], [SEP])
    excluded, counted with the model's tokenizer (``exact``), or estimated (``ESTIMATED_PIECES_PER_WORD``) for
    a model whose tokenizer cannot be read.

    The tokenizer is a copy of the model's, used under a lock: the model sets truncation on its own as it
    embeds, and a fast tokenizer refuses to be reconfigured from two threads at once.
    """

    def __init__(self, tokens: int, tokenizer: Any = None, name: str = "") -> None:
        self.tokens = max(1, int(tokens))
        self._tokenizer = tokenizer
        self.exact = tokenizer is not None
        self.name = name or ("tokenizer" if self.exact else f"estimate ({ESTIMATED_PIECES_PER_WORD} pieces a word)")
        self._lock = threading.Lock()

    def describe(self) -> Dict[str, Any]:
        return {"window": self.tokens, "counted_with": self.name}

    def counts(self, texts: Sequence[str]) -> List[int]:
        """Each text's word pieces (the model's markers not counted)."""
        if not self.exact:
            return [math.ceil(len(_WORDS.findall(t)) * ESTIMATED_PIECES_PER_WORD) for t in texts]
        if not texts:
            return []
        with self._lock:
            ids = self._tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        return [len(i) for i in ids]

    def count(self, text: str) -> int:
        return self.counts([text])[0]

    def over(self, texts: Sequence[str]) -> List[bool]:
        """Whether each text is longer than the window. A text of no more characters than the window holds no
        more word pieces, so only longer ones are tokenized."""
        flags = [False] * len(texts)
        long = [i for i, t in enumerate(texts) if len(t) > self.tokens or not self.exact]
        for i, n in zip(long, self.counts([texts[i] for i in long])):
            flags[i] = n > self.tokens
        return flags

    def offsets(self, text: str) -> List[Tuple[int, int]]:
        """Where each word piece of ``text`` stands (start, end), in characters."""
        if not self.exact:
            spans = [m.span() for m in _WORDS.finditer(text)]
            # Each word weighs ESTIMATED_PIECES_PER_WORD pieces: repeat spans so that cuts by count stay inside.
            return [s for i, s in enumerate(spans) for _ in range(_pieces_of(i))]
        with self._lock:
            found = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return [tuple(o) for o in found["offset_mapping"]]

    def hard_cut(self, text: str, tokens: Optional[int] = None) -> List[str]:
        """``text`` cut into consecutive pieces of at most ``tokens`` word pieces (the window by default), each
        cut at the last space before the limit where there is one (else inside a word), no text lost."""
        limit = max(1, tokens or self.tokens)
        spans = self.offsets(text)
        if len(spans) <= limit:
            return [text]
        pieces, start, i = [], 0, 0
        while len(spans) - i > limit:
            end = spans[i + limit][0]  # the first piece that does not fit starts here
            space = text.rfind(" ", spans[i][0] + 1, end + 1)
            cut = space + 1 if space > start else end
            pieces.append(text[start:cut])
            start = cut
            while i < len(spans) and spans[i][0] < cut:
                i += 1
        pieces.append(text[start:])
        return [p for p in pieces if p.strip()]

    def windows(self, text: str) -> List[str]:
        """``text`` as the windows the scorer reads a long passage in: whole sentences packed up to the window,
        each window after the first starting with the last sentence of the one before (a sentence longer than
        the window is cut in pieces)."""
        units: List[str] = []
        for sentence in split_sentences(text) or [text]:
            units.extend(self.hard_cut(sentence) if len(sentence) > self.tokens else [sentence])
        sizes = self.counts(units)
        found: List[str] = []
        current: List[int] = []
        total = 0
        for i, size in enumerate(sizes):
            if current and total + size > self.tokens:
                found.append("".join(units[j] for j in current))
                last = current[-1]
                current, total = ([last], sizes[last]) if sizes[last] + size <= self.tokens else ([], 0)
            current.append(i)
            total += size
        if current:
            found.append("".join(units[j] for j in current))
        return [w for w in found if w.strip()] or [text]


def _pieces_of(i: int) -> int:
    """How many estimated pieces the ``i``-th word counts for, so that ``n`` words count ceil(1.3 n) or so."""
    return int(math.floor((i + 1) * ESTIMATED_PIECES_PER_WORD) - math.floor(i * ESTIMATED_PIECES_PER_WORD))


def _inner_model(embed_model: Any) -> Any:
    """The model under wrappers that cache or count (they keep it as ``_inner``)."""
    seen = 0
    while getattr(embed_model, "_inner", None) is not None and seen < 8:
        embed_model, seen = embed_model._inner, seen + 1
    return embed_model


def embedding_window(embed_model: Optional[BaseEmbedding] = None) -> EmbeddingWindow:
    """The window of ``embed_model`` (a LlamaIndex embedding, wrappers such as the disk cache looked through):
    a sentence-transformers model's ``max_seq_length`` and tokenizer (HuggingFaceEmbedding), else its
    ``max_length`` with an estimate; ``None``: the bundled MiniLM's, read without loading the model."""
    if embed_model is None:
        return bundled_window()
    model = _inner_model(embed_model)
    client = getattr(model, "_model", None)
    tokenizer = getattr(client, "tokenizer", None)
    limit = getattr(client, "max_seq_length", None) or getattr(model, "max_length", None) or DEFAULT_WINDOW
    if tokenizer is None or not callable(tokenizer):
        return EmbeddingWindow(int(limit))
    mine = copy.deepcopy(tokenizer)
    name = _model_label(str(getattr(model, "model_name", "") or type(mine).__name__))
    return EmbeddingWindow(int(limit) - mine.num_special_tokens_to_add(pair=False), mine, name)


def _model_label(name: str) -> str:
    """A model's name as windows are described (and fingerprinted) by: the bundled MiniLM's own name however
    it was loaded (its folder is called ``model``), else the last part of its name or path."""
    from llama_index_crag.local.bundled import bundled_embedding_path

    try:
        if Path(name).resolve() == Path(bundled_embedding_path()).resolve():
            return BUNDLED_MODEL_NAME
    except (OSError, ValueError):
        pass
    return Path(name).name or name


@functools.lru_cache(maxsize=1)
def bundled_window() -> EmbeddingWindow:
    """The bundled MiniLM's window and tokenizer, from its files (the tokenizer alone: no torch, no weights)."""
    from transformers import AutoTokenizer

    from llama_index_crag.local.bundled import bundled_embedding_path

    path = Path(bundled_embedding_path())
    limit = json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"]
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return EmbeddingWindow(int(limit) - tokenizer.num_special_tokens_to_add(pair=False), tokenizer, BUNDLED_MODEL_NAME)


LONG_WARNING_START = "passages longer than the embedding model reads"


def long_passage_warning(window: int) -> str:
    """What a trace says when passages longer than the embedding model's window are searched and graded."""
    return (
        f"{LONG_WARNING_START} ({window} word pieces) are in this index: retrieval saw only their beginning, the "
        "grader reads them in windows. Ingest the documents again to cut chunks the model reads whole"
    )


class IndexVectors:
    """Vectors an index computed when it was built, by the exact text each embeds, for one embedding model.

    A bi-encoder over a model of the same name reads a passage's vector here instead of embedding it
    again (``publish``): the chunks a fallback returns and the knowledge strips the refiner grades were
    embedded with the index, not at query time. The key is the whole text, so a text the index did not
    embed (another metadata mode, a window widened at query time) is never matched, and a grade read
    from here is the grade the model gives.

    Args:
        model_name: The embedding model's name (``BaseEmbedding.model_name``).
        texts: The embedded texts.
        vectors: One vector a text, in the same order.
    """

    def __init__(
        self, model_name: str, texts: Sequence[str], vectors: Union[np.ndarray, Sequence[Sequence[float]]]
    ) -> None:
        self.model_name = model_name
        self._rows = {_key(t): i for i, t in enumerate(texts)}
        matrix = np.asarray(vectors, dtype=np.float32).reshape(len(texts), -1)
        self._matrix = matrix / np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)

    def __len__(self) -> int:
        return len(self._rows)

    def find(self, keys: Sequence[str]) -> Dict[str, np.ndarray]:
        """The unit vectors held for those of ``keys`` (``_key`` of a text) this table has."""
        return {k: self._matrix[self._rows[k]] for k in keys if k in self._rows}


#: The tables of vectors that built indexes hold, while their indexes live (``publish``).
_PUBLISHED: weakref.WeakSet[IndexVectors] = weakref.WeakSet()


def publish(vectors: IndexVectors) -> None:
    """Offer ``vectors`` to every bi-encoder of their model, for as long as their owner keeps them."""
    _PUBLISHED.add(vectors)


def index_vectors(model_name: str, keys: Sequence[str]) -> Dict[str, np.ndarray]:
    """The vectors of ``keys`` that an index built with the model ``model_name`` holds."""
    found: Dict[str, np.ndarray] = {}
    for table in list(_PUBLISHED):
        if table.model_name == model_name and len(found) < len(keys):
            found.update(table.find([k for k in keys if k not in found]))
    return found


class BiEncoderScorer(RelevanceScorer):
    """Scores a passage by the cosine similarity of its embedding to the query's.

    Normalisation: the cosine, clipped to [0, 1] (negative cosines mean unrelated).
    Passage and query embeddings are cached (keyed by a hash of the text), so a
    corpus node that comes back for many queries is embedded once; ``remember``
    seeds the cache with embeddings an index already holds, and a text an index of
    the same model embedded when it was built (``IndexVectors``: the chunks and their
    knowledge strips, held by the in-memory sentence-window index) is read there.
    What is left is embedded in one batch a call, shortest first (less padding).

    Args:
        embed_model: Any LlamaIndex embedding model; defaults to ``Settings.embed_model`` when one is set,
            else the bundled MiniLM. The shipped thresholds are the bundled MiniLM's: another model has none.
        cache_size: How many passage embeddings to keep.
        reuse_index_vectors: Read the vectors indexes of the same model computed when they were built
            (``IndexVectors``) instead of embedding those texts again.

    A passage longer than the model's window (``EmbeddingWindow``) is read in windows of whole sentences and
    scores its best window's cosine, so that an answer at its end counts; such a passage adds a warning to
    ``warnings`` (and so to the traces that follow). A passage within the window is embedded once, as before:
    only a passage of more characters than the window has word pieces is tokenized to tell.
    """

    normalization = "cosine similarity clipped to [0, 1]"
    #: For the bundled MiniLM only, read off its scores on the bundled sample corpus (off-topic
    #: questions top out at 0.26, answerable ones start at 0.38); calibrate on your own data.
    BUNDLED_THRESHOLDS = {"upper": 0.55, "lower": 0.30}

    def __init__(
        self, embed_model: Optional[BaseEmbedding] = None, cache_size: int = 50_000, reuse_index_vectors: bool = True
    ) -> None:
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
        self.reuse_index_vectors = reuse_index_vectors
        self._lock = threading.Lock()
        self._window: Optional[EmbeddingWindow] = None
        #: Passages longer than the window: their windows, by the passage's key (so each is cut once).
        self._long: OrderedDict[str, Tuple[str, ...]] = OrderedDict()
        #: Passages within the window, by key, so that a passage retrieved again is not tokenized again.
        self._short: OrderedDict[str, None] = OrderedDict()
        #: How many distinct passages longer than the window this scorer has read.
        self.long_passages = 0

    @property
    def window(self) -> EmbeddingWindow:
        """The embedding model's window (read on first use)."""
        if self._window is None:
            self._window = embedding_window(self.embed_model)
        return self._window

    def note_long_passages(self, count: int) -> None:
        """Record ``count`` more passages longer than the window (read, or counted in a corpus), with a warning."""
        if count <= 0:
            return
        self.long_passages += count
        if not any(w.startswith(LONG_WARNING_START) for w in self.warnings):
            self.warnings = (*self.warnings, long_passage_warning(self.window.tokens))

    def windows_of(self, texts: Sequence[str]) -> List[Optional[Tuple[str, ...]]]:
        """For each text, the windows it is read in when it is longer than the model's window; else None."""
        keys = [_key(t) for t in texts]
        found: List[Optional[Tuple[str, ...]]] = [None] * len(texts)
        unknown = []
        with self._lock:
            for i, key in enumerate(keys):
                if key in self._long:
                    found[i] = self._long[key]
                elif key not in self._short and len(texts[i]) > self.window.tokens:
                    unknown.append(i)
        if not unknown:
            return found
        flags = self.window.over([texts[i] for i in unknown])
        fresh = {keys[i]: tuple(self.window.windows(texts[i])) for i, long in zip(unknown, flags) if long}
        with self._lock:
            new = [k for k in fresh if k not in self._long]
            self._long.update(fresh)
            self._short.update((keys[i], None) for i, long in zip(unknown, flags) if not long)
            while len(self._long) > LONG_PASSAGES_KEPT:
                self._long.popitem(last=False)
            while len(self._short) > self._cache_size:
                self._short.popitem(last=False)
        for i in unknown:
            found[i] = fresh.get(keys[i])
        self.note_long_passages(len(set(new)))
        return found

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
        if missing and self.reuse_index_vectors:
            cached.update(index_vectors(self.embed_model.model_name, [k for k, _ in missing]))
            missing = [(k, t) for k, t in missing if k not in cached]
        if missing:
            unique = dict(missing)
            order = sorted(unique, key=lambda k: len(unique[k]))  # batches of like lengths pad least
            vectors = self.embed_model.get_text_embedding_batch([unique[k] for k in order])
            fresh = {k: _unit(v) for k, v in zip(order, vectors)}
            cached.update(fresh)
            with self._lock:
                self._cache.update(fresh)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return np.stack([cached[k] for k in keys])

    def score_texts(self, query: str, texts: Sequence[str]) -> List[float]:
        if not texts:
            return []
        windows = self.windows_of(texts)
        if not any(windows):
            sims = self._embed_passages(texts) @ self._query_vector(query)
            return [float(min(1.0, max(0.0, s))) for s in sims]
        # A long passage is as close as its closest window: its own vector saw its beginning only.
        parts = [w or (t,) for t, w in zip(texts, windows)]
        flat = [p for group in parts for p in group]
        sims = self._embed_passages(flat) @ self._query_vector(query)
        scores, start = [], 0
        for group in parts:
            scores.append(float(min(1.0, max(0.0, float(np.max(sims[start : start + len(group)]))))))
            start += len(group)
        return scores


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
