"""The decision trace of one query, its instrumentation events, and the span of each corrective step.

The library registers no metric: Prometheus counts these events where a program installs
``llama_index_crag.server.metrics.PrometheusEventHandler`` (the server does).
"""

from __future__ import annotations

import inspect
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Optional

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.base import BaseEvent
from llama_index.core.instrumentation.span import active_span_id

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


class CragStepEvent(BaseEvent):
    """Emitted at the end of each corrective step, inside the step's span: what it decided and on how much."""

    step: str
    outcome: Optional[str] = None
    #: Counts in and out of the step (candidates, kept, hits, strips, quotes ...).
    sizes: Dict[str, int] = {}

    @classmethod
    def class_name(cls) -> str:
        return "CragStepEvent"


@dataclass
class StepRecord:
    """What a corrective step reports about itself: its outcome and sizes (the span's result and its event)."""

    step: str
    outcome: Optional[str] = None
    sizes: Dict[str, int] = field(default_factory=dict)


dispatcher = get_dispatcher(__name__)

#: The signature span handlers see for a step span: its name and its input sizes.
_STEP_SIGNATURE = inspect.Signature(
    [
        inspect.Parameter("step", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("sizes", inspect.Parameter.VAR_KEYWORD),
    ]
)


@contextmanager
def step_span(step: str, **sizes: int) -> Iterator[StepRecord]:
    """An instrumentation span for one corrective step (``CorrectiveStep.<step>-<uuid>``), around the block.

    The loop is a generator whose I/O runs in a driver, so no decorated function spans a
    step: the span is entered and left here, and made the active span so that the
    model calls and retrievals inside the step are its children. The block sets the
    record's ``outcome`` and ``sizes``; on exit they go to span handlers as the span's
    result and to event handlers as a ``CragStepEvent`` inside the span. A step that
    raises drops its span with the error.
    """
    id_ = f"CorrectiveStep.{step}-{uuid.uuid4()}"
    bound = _STEP_SIGNATURE.bind(step, **sizes)
    token = active_span_id.set(id_)
    parent = token.old_value if isinstance(token.old_value, str) else None
    dispatcher.span_enter(id_=id_, bound_args=bound, parent_id=parent, tags={"crag.step": step})
    record = StepRecord(step, sizes=dict(sizes))
    try:
        yield record
    except BaseException as exc:
        dispatcher.span_drop(id_=id_, bound_args=bound, err=exc)
        raise
    else:
        dispatcher.event(CragStepEvent(step=step, outcome=record.outcome, sizes=record.sizes))
        dispatcher.span_exit(id_=id_, bound_args=bound, result=record)
    finally:
        try:
            active_span_id.reset(token)
        except ValueError:  # a loop abandoned and closed from another context: that context keeps its own span
            pass


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
    #: The questions the LLM's rewrite found in the query, when they passed its check (each is then asked alone).
    rewrite_parts: List[str] = field(default_factory=list)
    #: Why the parts the LLM's rewrite wrote were not used ("" when it wrote none or they were used).
    rewrite_parts_refused: str = ""
    fallback_sources: List[str] = field(default_factory=list)
    fallback_error: Optional[str] = None
    #: Each web search of the fallback: provider, the exact query sent, pages fetched and refused (see WebReport).
    web: List[Dict[str, Any]] = field(default_factory=list)
    retry_score: Optional[float] = None
    #: The identifiers the engine searched the fallback for by name, when every strip that could answer stood in
    #: another identifier's entry (the retrieved passages were the asked one's neighbours); None when it did not.
    entry_search: Optional[str] = None
    #: The caller's scope (its metadata filters as JSON), None when unbounded.
    scope: Optional[Dict[str, Any]] = None
    #: The filter keys the opt-in broadening fallback relaxed to find the evidence answered from (``broaden=``).
    broadened: List[str] = field(default_factory=list)
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
