"""Cross-encoder scorer: sentence-transformers ``CrossEncoder`` or FlagEmbedding ``FlagReranker``."""

from __future__ import annotations

from typing import Any, Callable, List, Literal, Optional, Sequence

from llama_index_crag.errors import GraderLoadError, MissingDependency
from llama_index_crag.scorers.base import RelevanceScorer, sigmoid

Backend = Literal["sentence-transformers", "flagembedding"]


class CrossEncoderScorer(RelevanceScorer):
    """Scores each (query, passage) pair jointly with a cross-encoder.

    The most accurate scorer when a cross-encoder is available (for example
    ``BAAI/bge-reranker-v2-m3`` or ``cross-encoder/ms-marco-MiniLM-L-6-v2``).
    Normalisation: the model's raw logit through a sigmoid, for both backends, so
    the same checkpoint gives the same scores whichever library loads it.

    Args:
        model: A model name or a local directory.
        backend: ``"sentence-transformers"`` (``CrossEncoder``) or ``"flagembedding"``
            (``FlagReranker``).
        max_length: Longest pair in tokens; longer passages are truncated.
        device: Torch device; ``None`` lets the library choose.
        batch_size: Pairs per forward pass.
    """

    normalization = "sigmoid of the cross-encoder logit"

    def __init__(
        self,
        model: str,
        backend: Backend = "sentence-transformers",
        max_length: int = 512,
        device: Optional[str] = None,
        batch_size: int = 32,
    ) -> None:
        self.model = model
        self.backend = backend
        self.batch_size = batch_size
        self.name = f"cross-encoder:{backend}:{model}"
        self._model: Any
        if backend == "sentence-transformers":
            try:
                from sentence_transformers import CrossEncoder
            except ImportError as exc:
                raise MissingDependency(
                    "CrossEncoderScorer needs sentence-transformers: pip install 'llama-index-crag[cross-encoder]'"
                ) from exc
            self._model = _loaded(model, lambda: CrossEncoder(model, max_length=max_length, device=device))
        elif backend == "flagembedding":
            try:
                from FlagEmbedding import FlagReranker
            except ImportError as exc:
                raise MissingDependency(
                    "The flagembedding backend needs FlagEmbedding 1.4 "
                    "(with transformers<5, sentence-transformers<6): "
                    "pip install 'llama-index-crag[flagembedding]'"
                ) from exc
            self._model = _loaded(
                model, lambda: FlagReranker(model, use_fp16=False, max_length=max_length, devices=device or "cpu")
            )
        else:
            raise ValueError(
                f"unknown cross-encoder backend {backend!r}: use 'sentence-transformers' or 'flagembedding'"
            )

    def score_texts(self, query: str, texts: Sequence[str]) -> List[float]:
        if not texts:
            return []
        pairs = [(query, text) for text in texts]
        if self.backend == "sentence-transformers":
            import torch

            logits = self._model.predict(
                pairs,
                batch_size=self.batch_size,
                activation_fn=torch.nn.Identity(),
                show_progress_bar=False,
            )
        else:
            logits = self._model.compute_score(pairs, batch_size=self.batch_size, normalize=False)
            if isinstance(logits, float):
                logits = [logits]
        return [sigmoid(float(v)) for v in logits]


def _loaded(model: str, load: Callable[[], Any]) -> Any:
    """``load()``, or a ``GraderLoadError`` in one line: a model-hub name on a machine without the hub fails after
    the hub client's retries with an ``OSError``, and a folder that holds no model with a ``ValueError``."""
    try:
        return load()
    except (OSError, ValueError) as exc:
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0][:200]  # its first sentence
        raise GraderLoadError(
            f"cannot load the cross-encoder {model!r} ({type(exc).__name__}: {said}): name a local folder that holds "
            "the model, or a model-hub name on a machine that reaches the hub"
        ) from exc
