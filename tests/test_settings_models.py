"""LlamaIndex's Settings.embed_model is the model of grading and sentence windows wherever none is passed."""

from __future__ import annotations

from typing import Any, List

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.settings import Settings

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.errors import ConfigError
from llama_index_crag.local.models import default_embed_model

CEO = "Who is the CEO of Harbor Analytics?"


class Counting(BaseEmbedding):
    """The bundled MiniLM under ``model_name``, counting the texts and queries it embeds."""

    calls: int = 0
    _inner: Any = PrivateAttr()

    def __init__(self, inner: BaseEmbedding, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._inner = inner

    def _get_query_embedding(self, query: str) -> List[float]:
        self.calls += 1
        return self._inner.get_query_embedding(query)

    async def _aget_query_embedding(self, query: str) -> List[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> List[float]:
        self.calls += 1
        return self._inner.get_text_embedding(text)

    def _get_text_embeddings(self, texts: List[str]) -> List[List[float]]:
        self.calls += len(texts)
        return self._inner.get_text_embedding_batch(texts)


def test_the_bundled_model_set_in_settings_grades(
    monkeypatch: pytest.MonkeyPatch, sample_index: VectorStoreIndex, embed_model: BaseEmbedding
) -> None:
    counting = Counting(embed_model, model_name=embed_model.model_name)
    monkeypatch.setattr(Settings, "_embed_model", counting)
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index)
    response = engine.query(CEO)
    assert response.metadata["crag"]["action"] == "correct"
    assert engine.grader.scorer.name == "evidence:all-MiniLM-L6-v2"
    # The query reused the index's embeddings; a passage the index never held is embedded by the Settings model.
    before = counting.calls
    engine.grader.scorer.score_texts(CEO, ["Miriam Okafor has led the company since 2019."])
    assert counting.calls > before


def test_another_model_in_settings_is_refused_without_thresholds_fitted_for_it(
    monkeypatch: pytest.MonkeyPatch, sample_index: VectorStoreIndex, embed_model: BaseEmbedding
) -> None:
    monkeypatch.setattr(Settings, "_embed_model", Counting(embed_model, model_name="my-embedder"))
    with pytest.raises(ConfigError, match=r"'evidence:my-embedder'.*llama-crag calibrate.*upper= and lower="):
        CorrectiveQueryEngine.from_defaults(index=sample_index)


def test_another_model_in_settings_grades_and_searches_windows_with_thresholds_given(
    monkeypatch: pytest.MonkeyPatch, sample_index: VectorStoreIndex, embed_model: BaseEmbedding
) -> None:
    counting = Counting(embed_model, model_name="my-embedder")
    monkeypatch.setattr(Settings, "_embed_model", counting)
    engine = CorrectiveQueryEngine.from_defaults(
        index=sample_index, upper=0.8, lower=0.45, fallback_sources=("sentence_window",)
    )
    assert engine.grader.scorer.name == "evidence:my-embedder"
    engine.query(CEO)
    graded = counting.calls
    assert graded > 0
    trace = engine.query("Who wrote the novel Moby-Dick?").metadata["crag"]
    assert trace["fallback_sources"] == ["sentence_window"] and counting.calls > graded + len(
        sample_index.docstore.docs
    )


def test_settings_are_left_alone_when_a_model_is_passed(sample_index: VectorStoreIndex) -> None:
    assert getattr(Settings, "_embed_model", None) is None
    engine = CorrectiveQueryEngine.from_defaults(index=sample_index, embed_model=default_embed_model())
    assert engine.grader.scorer.name == "evidence:all-MiniLM-L6-v2"
