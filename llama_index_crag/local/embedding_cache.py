"""One on-disk cache of passage embeddings, shared by calibration, the grade report, the evaluation and benchmarks."""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np
from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import PrivateAttr

from llama_index_crag.datasets import content_hash

#: Where commands keep what they compute once per dataset (relative to the working directory by default).
DEFAULT_CACHE_DIR = Path(".crag-cache")

#: Passages embedded between two saves of the cache, so an interrupted build loses little.
_SAVE_EVERY = 1024


class WrappedEmbedding(BaseEmbedding):
    """An embedding model that is ``inner`` under its name, for a subclass to change how passages are embedded
    (``get_text_embedding_batch``): queries go to ``inner`` as they are, one passage is a batch of one."""

    _inner: BaseEmbedding = PrivateAttr()

    def __init__(self, inner: BaseEmbedding) -> None:
        super().__init__(model_name=inner.model_name, embed_batch_size=inner.embed_batch_size)
        self._inner = inner

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._inner.get_query_embedding(query)

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return await self._inner.aget_query_embedding(query)

    def _get_text_embedding(self, text: str) -> Embedding:
        return self.get_text_embedding_batch([text])[0]

    def get_text_embedding_batch(self, texts: List[str], show_progress: bool = False, **kwargs: Any) -> List[Embedding]:
        return self._inner.get_text_embedding_batch(texts, show_progress=show_progress, **kwargs)


class DiskCachedEmbedding(WrappedEmbedding):
    """An embedding model whose passage vectors persist in one ``.npz`` file, keyed by a hash of the text.

    The corpus (and the fallback's sentence windows) are embedded once per dataset
    content; later runs load the vectors. Query embeddings are never cached: they are
    part of the retrieval time the evaluation measures.

    With ``read_only`` (a server, where several processes load the same file) the file
    is never written: texts it lacks are embedded and not kept.
    """

    _path: Path = PrivateAttr()
    _vectors: Dict[str, np.ndarray] = PrivateAttr()
    _progress: bool = PrivateAttr()
    _read_only: bool = PrivateAttr()
    _lock: Any = PrivateAttr()

    def __init__(self, inner: BaseEmbedding, path: Path, progress: bool = False, read_only: bool = False) -> None:
        super().__init__(inner)
        self._path = path
        self._progress = progress
        self._read_only = read_only
        self._lock = threading.Lock()
        self._vectors = {}
        if path.exists():
            with np.load(path) as stored:
                self._vectors = dict(zip(stored["keys"].tolist(), stored["vectors"]))

    @classmethod
    def class_name(cls) -> str:
        return "DiskCachedEmbedding"

    def get_text_embedding_batch(self, texts: List[str], show_progress: bool = False, **kwargs: Any) -> List[Embedding]:
        """Vectors of ``texts``: from the cache, embedding (shortest first, saved as it goes) what is missing."""
        keys = [_key(t) for t in texts]
        if self._read_only:
            absent = [t for k, t in zip(keys, texts) if k not in self._vectors]
            fresh = iter(self._inner.get_text_embedding_batch(absent, show_progress=show_progress) if absent else [])
            return [self._vectors[k].tolist() if k in self._vectors else next(fresh) for k in keys]
        missing = sorted(
            {k: t for k, t in zip(keys, texts) if k not in self._vectors}.items(), key=lambda kv: len(kv[1])
        )
        for start in range(0, len(missing), _SAVE_EVERY):
            part = missing[start : start + _SAVE_EVERY]
            if start == 0 and len(missing) > _SAVE_EVERY:
                print(f"Embedding {len(missing):,} passages (cached in {self._path} for later runs).", file=sys.stderr)
            vectors = self._inner.get_text_embedding_batch(
                [t for _, t in part], show_progress=show_progress or (self._progress and len(missing) > 100)
            )
            with self._lock:
                self._vectors.update((k, np.asarray(v, dtype=np.float32)) for (k, _), v in zip(part, vectors))
                self._save()
        return [self._vectors[k].tolist() for k in keys]

    def _save(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        partial = self._path.with_name(f"{self._path.name}.{os.getpid()}-{threading.get_ident()}.partial.npz")
        np.savez(partial, keys=np.array(list(self._vectors)), vectors=np.stack(list(self._vectors.values())))
        partial.replace(self._path)


def _key(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def corpus_cache(
    inner: BaseEmbedding, corpus_file: Path, cache_dir: Path = DEFAULT_CACHE_DIR, progress: bool = False
) -> DiskCachedEmbedding:
    """The cached embedding model for one dataset's corpus: one file per corpus content and model.

    Keyed by the corpus file's content (not its location) and the model name, so that
    every command that embeds the same corpus with the same model reads the same vectors.
    """
    model = f"{Path(inner.model_name).name}-{_key(inner.model_name)[:8]}"
    digest = content_hash(Path(corpus_file))
    root = Path(cache_dir) / "embeddings"
    path = root / f"{Path(corpus_file).parent.name}-{digest}" / f"{model}.npz"
    if not path.exists():  # the same corpus under another folder's name (a copy of the dataset) was embedded
        path = next(iter(sorted(root.glob(f"*-{digest}/{model}.npz"))), path)
    return DiskCachedEmbedding(inner, path, progress)


def unit_vectors(model: BaseEmbedding, texts: Sequence[str]) -> np.ndarray:
    """Embeddings of ``texts`` as a unit-length float32 matrix, one row a text."""
    matrix = np.asarray(model.get_text_embedding_batch(list(texts)), dtype=np.float32).reshape(len(texts), -1)
    matrix /= np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)
    return matrix
