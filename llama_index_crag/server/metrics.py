"""Prometheus metrics: the engine's actions and stage times (an instrumentation handler), and the server's own.

The library registers no metric: ``install_engine_metrics`` attaches ``PrometheusEventHandler``
to LlamaIndex's root instrumentation dispatcher, and from then on every ``CragActionEvent``
(one per answered query, from any engine in the process) counts in ``crag_actions_total`` and
``crag_stage_seconds``. The server installs it; any other program can too. Beside them, the
server's requests, query latency by action, and fallback and refusal rates over a window.

With several worker processes, ``llama-crag serve`` sets ``PROMETHEUS_MULTIPROC_DIR`` before the
workers start and ``/metrics`` aggregates every worker's counters and histograms; the window
rates are each worker's latest (mostrecent), and the window counts are summed over live workers.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any, Deque, Dict, Tuple

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from llama_index_crag.core.trace import CragActionEvent

ACTIONS = Counter(
    "crag_actions_total",
    "Queries by the corrective action taken (correct, ambiguous, incorrect, disabled).",
    ["action", "abstained"],
)
STAGE_SECONDS = Histogram(
    "crag_stage_seconds",
    "Time spent in each stage of the corrective loop; stage 'crag' is the correction's own cost.",
    ["stage"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
REQUESTS = Counter("crag_http_requests_total", "HTTP requests by route and status.", ["route", "status"])
REQUEST_SECONDS = Histogram(
    "crag_http_request_seconds",
    "Time to answer an HTTP request (streamed answers: until the stream is handed over).",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
)
QUERY_SECONDS = Histogram(
    "crag_query_seconds",
    "Time to answer a query end to end, by corrective action.",
    ["action"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
)
FALLBACK_RATE = Gauge(
    "crag_fallback_rate",
    "Share of the queries in the last window that searched the fallback (the corpus did not cover them at first).",
    multiprocess_mode="mostrecent",
)
REFUSAL_RATE = Gauge(
    "crag_refusal_rate",
    "Share of the queries in the last window that ended in an abstention.",
    multiprocess_mode="mostrecent",
)
WINDOW_QUERIES = Gauge("crag_window_queries", "Queries in the rate window.", multiprocess_mode="livesum")
WINDOW_SECONDS = Gauge("crag_rate_window_seconds", "Length of the rate window.", multiprocess_mode="max")

#: Routes counted by their own name; anything else (unknown paths, probes) as "other", so labels stay bounded.
ROUTES = ("/", "/query", "/v1/chat/completions", "/metrics", "/healthz", "/recent")

_install_lock = threading.Lock()


class PrometheusEventHandler(BaseEventHandler):
    """Counts each query's corrective action and observes its stage times, from its ``CragActionEvent``."""

    @classmethod
    def class_name(cls) -> str:
        return "PrometheusEventHandler"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if not isinstance(event, CragActionEvent):
            return
        ACTIONS.labels(action=event.action, abstained=str(event.abstained).lower()).inc()
        for stage, ms in event.timings_ms.items():
            STAGE_SECONDS.labels(stage=stage).observe(ms / 1000.0)
        STAGE_SECONDS.labels(stage="crag").observe(event.crag_ms / 1000.0)


def install_engine_metrics() -> PrometheusEventHandler:
    """Attach the handler to the root dispatcher once per process (again: the one already attached)."""
    root = get_dispatcher()
    with _install_lock:
        for handler in root.event_handlers:
            if isinstance(handler, PrometheusEventHandler):
                return handler
        handler = PrometheusEventHandler()
        root.add_event_handler(handler)
        return handler


class ServerMetrics:
    """Counts one server's requests and queries; keeps the window behind the two rates."""

    def __init__(self, window_s: float = 300.0) -> None:
        self.window_s = window_s
        self._events: Deque[Tuple[float, bool, bool]] = deque()
        self._lock = threading.Lock()
        WINDOW_SECONDS.set(window_s)

    def request(self, path: str, status: int, seconds: float) -> None:
        route = (
            path
            if path in ROUTES
            else ("/static" if path.startswith("/static/") else "/queries" if path.startswith("/queries/") else "other")
        )
        REQUESTS.labels(route=route, status=str(status)).inc()
        REQUEST_SECONDS.labels(route=route).observe(seconds)

    def observe(self, trace: Dict[str, Any], seconds: float) -> None:
        """Count one answered query."""
        QUERY_SECONDS.labels(action=trace.get("action", "unknown")).observe(seconds)
        now = time.monotonic()
        with self._lock:
            self._events.append((now, bool(trace.get("fallback_sources")), bool(trace.get("abstained"))))
            self._update(now)

    def rates(self) -> Dict[str, float]:
        with self._lock:
            return self._update(time.monotonic())

    def _update(self, now: float) -> Dict[str, float]:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        total = len(self._events)
        fallback = sum(e[1] for e in self._events) / total if total else 0.0
        refusal = sum(e[2] for e in self._events) / total if total else 0.0
        FALLBACK_RATE.set(fallback)
        REFUSAL_RATE.set(refusal)
        WINDOW_QUERIES.set(total)
        return {"queries": total, "fallback_rate": fallback, "refusal_rate": refusal}

    def exposition(self) -> Tuple[bytes, str]:
        """The text exposition of every metric (of all workers, in multiprocess mode)."""
        self.rates()  # the window slides even when no query comes
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
