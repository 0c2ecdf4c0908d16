"""Shared fixtures: the real bundled embedding and sample index, and scripted parts for branch logic."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen, LLMMetadata
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from llama_index_crag import CorrectiveQueryEngine, FallbackRetriever
from llama_index_crag.datasets import load_documents
from llama_index_crag.local.models import default_embed_model
from llama_index_crag.scorers.base import RelevanceScorer

REWRITE_MARKER = "You rewrite search queries"


class ScriptedLLM(CustomLLM):
    """A deterministic LLM: answers with the first context line, rewrites as scripted, counts calls.

    ``rewrite`` decides the raw completion of a rewrite prompt: a string (returned as
    the model's text, so it can be invalid JSON), or a callable that may raise.
    """

    rewrite: Any = '{"query": "alpha project budget"}'
    calls: Dict[str, int] = {}
    _lock: Any = PrivateAttr(default_factory=threading.Lock)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls = {"answer": 0, "rewrite": 0}

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=4096, num_output=128, model_name="scripted")

    def _text(self, prompt: str) -> str:
        with self._lock:
            if REWRITE_MARKER in prompt:
                self.calls["rewrite"] += 1
                return self.rewrite(prompt) if callable(self.rewrite) else str(self.rewrite)
            self.calls["answer"] += 1
        context = prompt.split("---------------------")[1].strip() if "-----" in prompt else prompt
        return "ANSWER: " + context.splitlines()[-1][:80]

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return CompletionResponse(text=self._text(prompt))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        text = self._text(prompt)

        def gen() -> CompletionResponseGen:
            sent = ""
            for word in text.split(" "):
                sent += word + " "
                yield CompletionResponse(text=sent, delta=word + " ")

        return gen()


class Answering(ScriptedLLM):
    """Answers every question with ``answer``, whatever the context says (rewrites as ``ScriptedLLM``)."""

    answer: str = ""

    def _text(self, prompt: str) -> str:
        if REWRITE_MARKER in prompt:
            return super()._text(prompt)
        self.calls["answer"] += 1
        return self.answer


class EntryScorer(RelevanceScorer):
    """Grades every settings entry ("#### vat_min_age (integer) ...") relevant (0.95) and anything else not."""

    name = "entries"

    def score_texts(self, query: str, texts: Sequence[str]) -> List[float]:
        return [0.95 if "_age (integer)" in t else 0.05 for t in texts]


#: Engine settings under which a settings entry is CORRECT and any strip of it is quoted (``EntryScorer``'s tests
#: of the search for the asked entry by name): one passage retrieved, so the neighbour is all there is.
ENTRY_SETTINGS: Dict[str, Any] = {
    "upper": 0.7,
    "lower": 0.3,
    "answer_mode": "extract",
    "quote_threshold": 0.0,
    "similarity_top_k": 1,
}


class MarkerScorer(RelevanceScorer):
    """Scores a passage by the best marker word it contains (deterministic), counting calls."""

    name = "marker-scorer"

    def __init__(self, markers: Dict[str, float], default: float = 0.05) -> None:
        self.markers = markers
        self.default = default
        self.calls = 0

    def score_texts(self, query: str, texts: Sequence[str]) -> List[float]:
        self.calls += 1
        return [max([v for k, v in self.markers.items() if k in t.lower()] or [self.default]) for t in texts]


class FixedRetriever(BaseRetriever):
    """Returns the same candidates for every query (the primary retrieval in branch tests)."""

    def __init__(self, nodes: List[TextNode]) -> None:
        self._nodes = nodes
        super().__init__()

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return [NodeWithScore(node=n, score=0.5) for n in self._nodes]


ALPHA = TextNode(
    id_="alpha",
    text="The alpha project budget for 2024 is 3.2 million euros. It was approved in March by the board.",
)
BETA = TextNode(id_="beta", text="Beta is a cafeteria menu. Lunch is served from noon until two in the afternoon.")
GAMMA = TextNode(
    id_="gamma",
    text=(
        "The gamma office is in Porto and opened in 2019 with twelve staff members. "
        "The alpha project budget was discussed there once at a regional planning meeting. "
        "The office cafeteria is painted green and has a view over the river Douro."
    ),
)
CORPUS = [ALPHA, BETA, GAMMA]


@pytest.fixture
def scripted_llm() -> ScriptedLLM:
    return ScriptedLLM()


def make_engine(
    scorer: RelevanceScorer,
    llm: ScriptedLLM,
    primary: Optional[List[TextNode]] = None,
    fallback: Optional[BaseRetriever] = None,
    node_postprocessors: Optional[List[Any]] = None,
    **settings: Any,
) -> CorrectiveQueryEngine:
    """An engine over the tiny corpus: fixed primary candidates, real BM25 fallback."""
    settings.setdefault("upper", 0.7)
    settings.setdefault("lower", 0.3)
    return CorrectiveQueryEngine.from_defaults(
        retriever=FixedRetriever(primary if primary is not None else [BETA]),
        llm=llm,
        scorer=scorer,
        fallback=fallback or FallbackRetriever.from_nodes(CORPUS, sources=("bm25",), similarity_top_k=2),
        node_postprocessors=node_postprocessors,
        **settings,
    )


@pytest.fixture(scope="session")
def embed_model() -> Any:
    return default_embed_model()


@pytest.fixture(scope="session")
def sample_index(embed_model: Any) -> VectorStoreIndex:
    return VectorStoreIndex.from_documents(load_documents(), embed_model=embed_model)


def assert_engine_loads_calibration(path: Path) -> None:
    """An engine over the sample corpus built with ``path`` uses its weights and thresholds."""
    from llama_index_crag.scorers import EvidenceScorer

    nodes = load_documents()
    engine = CorrectiveQueryEngine.from_defaults(
        nodes=nodes,
        llm=ScriptedLLM(),
        scorer=EvidenceScorer(corpus=[n.text for n in nodes]),
        calibration_path=str(path),
        fallback_sources=("bm25",),
    )
    data = json.loads(path.read_text())
    assert engine.grader.scorer.weights.tolist() == pytest.approx(data["scorer_state"]["weights"])  # type: ignore[attr-defined]
    assert (engine.grader.upper, engine.grader.lower) == (data["thresholds"]["upper"], data["thresholds"]["lower"])
    assert engine.refiner.threshold == data["thresholds"]["strip_threshold"]


def write_hostile_documents(root: Path) -> Dict[str, Path]:
    """Documents with what stores and codecs refuse: a NUL past the binary sniff, JSON's lone surrogates, a
    file name that is not UTF-8, and one 120,000-character word. Returns the files folder and the JSON-lines folder.
    """
    files, jsonl = root / "files", root / "jsonl"
    files.mkdir(parents=True)
    jsonl.mkdir(parents=True)
    lead = "The Ostmoor creamery ages Vell Blue for nine weeks in a sandstone cave. " * 80  # past the first 4 KiB
    (files / "nul.txt").write_text(lead + "\x00After the NUL: the cheese is sold in Brill on Saturdays.\n")
    (files / "word.txt").write_text("Zebra" * 24_000 + " ends the longest word.\n")
    (files / b"latin1-\xe9t\xe9.txt".decode("utf-8", "surrogateescape")).write_bytes(b"Caf\xe9 opens at seven.\n")
    rows = [
        {"doc_id": "nul", "title": "Ti\u0000tle", "text": "Membership costs one share \u0000 priced at 1,500 crowns."},
        {"doc_id": "surrogate", "title": "Odd \ud800", "text": "The mill \ud800 grinds rye flour on Tuesdays."},
    ]
    (jsonl / "corpus.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"files": files, "jsonl": jsonl}
