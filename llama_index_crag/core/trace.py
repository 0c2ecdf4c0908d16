"""The decision trace of one query and its instrumentation events.

The library registers no metric: Prometheus counts these events where a program installs
``llama_index_crag.server.metrics.PrometheusEventHandler`` (the server does).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Optional

from llama_index.core.instrumentation.events.base import BaseEvent

STAGES = ("retrieve", "rerank", "grade", "refine", "rewrite", "fallback", "regrade", "generate", "extract", "check")
CORRECTION_STAGES = ("grade", "refine", "rewrite", "fallback", "regrade", "check")


class CragGradeEvent(BaseEvent):
    """Emitted each time a batch of candidates is graded."""

    query: str
    node_ids: List[str]
    scores: List[float]
    labels: List[str]
    aggregate: float
    verdict: str

    @classmethod
    def class_name(cls) -> str:
        return "CragGradeEvent"


class CragActionEvent(BaseEvent):
    """Emitted once a query's corrective action is decided and carried out."""

    query: str
    action: str
    abstained: bool
    abstain_reason: Optional[str] = None
    rewritten_query: Optional[str] = None
    fallback_sources: List[str] = []
    crag_ms: float
    #: Milliseconds spent in each stage (the keys of the trace's ``timings_ms``, without ``crag_ms``).
    timings_ms: Dict[str, float] = {}

    @classmethod
    def class_name(cls) -> str:
        return "CragActionEvent"


@dataclass
class NodeGrade:
    """One graded candidate as the trace shows it."""

    node_id: str
    score: float
    label: str
    source: str
    doc_id: Optional[str] = None
    #: Why it scored what it did (``explain=True`` and a scorer that can say), else None.
    explanation: Optional[Dict[str, Any]] = None


@dataclass
class CragTrace:
    """Everything the engine decided for one query; ``response.metadata["crag"]`` is its dict."""

    query: str
    enabled: bool
    scorer: str
    upper: float
    lower: float
    aggregation: str
    strip_threshold: Optional[float] = None
    action: str = "disabled"
    nodes: List[NodeGrade] = field(default_factory=list)
    aggregate_score: Optional[float] = None
    top_score: Optional[float] = None
    strips_kept: int = 0
    strips_dropped: int = 0
    #: AMBIGUOUS: every strip graded, kept or dropped, with its candidate's node id and score.
    strips: List[Dict[str, Any]] = field(default_factory=list)
    no_strips: bool = False
    rewritten_query: Optional[str] = None
    rewrites: int = 0
    rewrite_error: Optional[str] = None
    #: Which rewrite was searched with: "llm" (the generator's JSON rewrite) or "keyword" (its deterministic fallback).
    rewrite_source: Optional[str] = None
    fallback_sources: List[str] = field(default_factory=list)
    fallback_error: Optional[str] = None
    #: Each web search of the fallback: provider, the exact query sent, pages fetched and refused (see WebReport).
    web: List[Dict[str, Any]] = field(default_factory=list)
    retry_score: Optional[float] = None
    abstained: bool = False
    abstain_reason: Optional[str] = None
    #: What the user should know about how this answer was graded (a packaged grader that could
    #: not be loaded, so the evidence features graded instead, say).
    warnings: List[str] = field(default_factory=list)
    #: How the engine answers: "extract" (quoted strips, no generation) or "generate".
    answer_mode: str = "generate"
    #: What produced the answer the user got: "generate", "extract" or "abstain" (None until decided).
    answered_by: Optional[str] = None
    #: The generated answer's check: True or False once read, None when unchecked (see answer_check["status"]).
    grounded: Optional[bool] = None
    #: The check itself: status, score and unsupported spans of each sentence, the policy and its outcome.
    answer_check: Optional[Dict[str, Any]] = None
    #: The quoted strips, with their sources, of an extractive answer (or of the evidence beside a failed check).
    quotes: List[Dict[str, Any]] = field(default_factory=list)
    #: The quotes read together and graded against the question: grade, threshold, passed, and withheld quotes.
    quote_check: Optional[Dict[str, Any]] = None
    timings_ms: Dict[str, float] = field(default_factory=dict)

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Add the wall time of the block to ``timings_ms[stage]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = (time.perf_counter() - start) * 1000.0
            self.timings_ms[stage] = round(self.timings_ms.get(stage, 0.0) + elapsed, 3)

    @property
    def crag_ms(self) -> float:
        """The correction's own cost: every stage a plain RAG pipeline would not run."""
        return round(sum(self.timings_ms.get(s, 0.0) for s in CORRECTION_STAGES), 3)

    def abstain(self, reason: str) -> None:
        """Record that the engine will answer with its abstention text, and why."""
        self.abstained = True
        self.abstain_reason = reason

    def to_dict(self) -> Dict[str, Any]:
        """The trace as plain JSON-ready data, with ``crag_ms`` among the timings."""
        data = asdict(self)
        data["timings_ms"] = {**self.timings_ms, "crag_ms": self.crag_ms}
        data["thresholds"] = {
            "upper": self.upper,
            "lower": self.lower,
            "aggregation": self.aggregation,
            "strip_threshold": self.strip_threshold,
        }
        return data

    def action_event(self) -> CragActionEvent:
        """The event that reports the action carried out, with the time of each stage."""
        return CragActionEvent(
            query=self.query,
            action=self.action,
            abstained=self.abstained,
            abstain_reason=self.abstain_reason,
            rewritten_query=self.rewritten_query,
            fallback_sources=self.fallback_sources,
            crag_ms=self.crag_ms,
            timings_ms=dict(self.timings_ms),
        )
