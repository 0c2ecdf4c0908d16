"""Prometheus metrics: the engine's actions and stage times (an instrumentation handler), and the server's own.

The library registers no metric: ``install_engine_metrics`` attaches ``PrometheusEventHandler``
to LlamaIndex's root instrumentation dispatcher, and from then on every ``CragActionEvent``
(one per answered query, from any engine in the process) counts in ``crag_actions_total`` and
``crag_stage_seconds``. The server installs it; any other program can too. Beside them, the
server's requests, query latency by action, and fallback and refusal rates over a window.

With several worker processes, ``llama-crag serve`` sets ``PROMETHEUS_MULTIPROC_DIR`` before the
workers start and ``/metrics`` aggregates every worker's counters and histograms; the window
counts are summed over live workers, and the two rates are computed from those sums at each
scrape (a rate of one worker, whichever answered the scrape, is not the server's).
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

from llama_index_crag.core.loop import CragActionEvent

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
FALLBACK_HELP = (
    "Share of the queries in the last window that searched the fallback (the corpus did not cover them at first)."
)
REFUSAL_HELP = "Share of the queries in the last window that ended in an abstention."
FALLBACK_RATE = Gauge("crag_fallback_rate", FALLBACK_HELP, multiprocess_mode="mostrecent")
REFUSAL_RATE = Gauge("crag_refusal_rate", REFUSAL_HELP, multiprocess_mode="mostrecent")
WINDOW_QUERIES = Gauge("crag_window_queries", "Queries in the rate window.", multiprocess_mode="livesum")
WINDOW_FALLBACKS = Gauge(
    "crag_window_fallbacks", "Queries in the rate window that searched the fallback.", multiprocess_mode="livesum"
)
WINDOW_REFUSALS = Gauge(
    "crag_window_refusals", "Queries in the rate window that ended in an abstention.", multiprocess_mode="livesum"
)
#: Each rate: its help text, and the window count it is the share of.
_RATES = {
    "crag_fallback_rate": (FALLBACK_HELP, "crag_window_fallbacks"),
    "crag_refusal_rate": (REFUSAL_HELP, "crag_window_refusals"),
}
WINDOW_SECONDS = Gauge("crag_rate_window_seconds", "Length of the rate window.", multiprocess_mode="max")

#: Routes counted by their own name; anything else (unknown paths, probes) as "other", so labels stay bounded.
#: The caller (an API key's name) is never a label: a key's name is for the trace and the logs.
ROUTES = ("/", "/query", "/v1/chat/completions", "/v1/models", "/metrics", "/healthz", "/recent", "/openapi.json")
#: Routes with a parameter in their path, counted under their template.
TEMPLATES = (("/static/", "/static"), ("/queries/", "/queries"), ("/v1/models/", "/v1/models/{id}"))

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
        route = path if path in ROUTES else next((t for p, t in TEMPLATES if path.startswith(p)), "other")
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
        fallbacks, refusals = sum(e[1] for e in self._events), sum(e[2] for e in self._events)
        fallback = fallbacks / total if total else 0.0
        refusal = refusals / total if total else 0.0
        FALLBACK_RATE.set(fallback)
        REFUSAL_RATE.set(refusal)
        WINDOW_QUERIES.set(total)
        WINDOW_FALLBACKS.set(fallbacks)
        WINDOW_REFUSALS.set(refusals)
        return {"queries": total, "fallback_rate": fallback, "refusal_rate": refusal}

    def exposition(self) -> Tuple[bytes, str]:
        """The text exposition of every metric (of all workers, in multiprocess mode)."""
        self.rates()  # the window slides even when no query comes
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            registry.register(_AllWorkers())
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


class _AllWorkers:
    """Every worker's metrics, with the two rates computed from the window counts summed over the live workers
    (each worker's own rate gauge is the share of its own queries)."""

    def collect(self) -> Any:
        from prometheus_client import multiprocess
        from prometheus_client.core import GaugeMetricFamily

        families = list(multiprocess.MultiProcessCollector(None).collect())
        sums = {f.name: sum(s.value for s in f.samples) for f in families}
        queries = sums.get("crag_window_queries", 0.0)
        for family in families:
            if family.name not in _RATES:
                yield family
        for rate, (help_text, count) in _RATES.items():
            yield GaugeMetricFamily(rate, help_text, value=sums.get(count, 0.0) / queries if queries else 0.0)
