"""The correction steps of the loop: refine (AMBIGUOUS), rewrite and fall back (INCORRECT), grade again.

``CorrectionSteps`` is mixed into ``CorrectiveRetriever``; each step is a generator that
yields its I/O to a driver (``core/driver.py``) and runs in its own instrumentation span.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, Generator, List, Optional, Sequence, Tuple

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle

from llama_index_crag.answers.keywords import keyword_query
from llama_index_crag.answers.sources import shown
from llama_index_crag.core.driver import Io, bind, left
from llama_index_crag.core.fallback import OUTSIDE_SCOPE_KEY, SOURCE_KEY, FallbackRetriever
from llama_index_crag.core.grader import Grading, RelevanceGrader, Verdict
from llama_index_crag.core.refiner import StripRefiner
from llama_index_crag.core.rewrite import QueryRewriter
from llama_index_crag.core.settings import CragSettings
from llama_index_crag.core.trace import CragTrace, NodeGrade, step_span
from llama_index_crag.errors import CorrectiveTimeout, RewriteError
from llama_index_crag.scope import Scope, scoped_retriever
from llama_index_crag.text.cleaning import clean_nodes
from llama_index_crag.web.retriever import WebSearchRetriever, collect_web_reports


@dataclass(frozen=True)
class Broadening:
    """The opt-in broadening fallback: after the rewrite fails, search again with ``keys`` relaxed.

    ``floor`` is the scope without those keys (never wider: the caller's own scope is all in it),
    and ``fallback`` searches inside ``floor``.
    """

    keys: Tuple[str, ...]
    floor: Scope
    fallback: BaseRetriever

    def scoped(self, filters: Any) -> Broadening:
        """This broadening for a caller narrowed to ``filters``: a key they name is never relaxed."""
        floor = self.floor.narrow(filters)
        return Broadening(self.keys, floor, scoped_retriever(self.fallback, floor))


class CorrectionSteps:
    """Refinement, rewrite, fallback and re-grading, for ``CorrectiveRetriever``."""

    _grader: RelevanceGrader
    _refiner: StripRefiner
    _fallback: Optional[BaseRetriever]
    _rewriter: Optional[QueryRewriter]
    _postprocessors: List[BaseNodePostprocessor]
    _scope: Scope
    _broadening: Optional[Broadening]
    settings: CragSettings

    def _refine(
        self, query_bundle: QueryBundle, nodes: List[NodeWithScore], grading: Grading, trace: CragTrace
    ) -> Generator[Io, Any, List[NodeWithScore]]:
        """AMBIGUOUS: keep the relevant strips of the candidates, optionally add fallback hits."""
        candidates = not_incorrect(nodes, grading) or nodes
        with trace.timed("refine"), step_span("refine", candidates=len(candidates)) as span:
            refinement = yield Io(
                bind(self._refiner.refine, query_bundle, candidates),
                bind(self._refiner.arefine, query_bundle, candidates),
            )
            span.outcome = "original" if refinement.used_original else "strips"
            span.sizes.update(strips_kept=refinement.kept, strips_dropped=refinement.dropped)
        trace.strips_kept, trace.strips_dropped = refinement.kept, refinement.dropped
        trace.strips = [asdict(strip) for strip in refinement.strips]
        if refinement.used_original and self.settings.on_no_strips == "incorrect":
            trace.no_strips = True
            return (yield from self._correct(query_bundle, trace))
        context = list(refinement.nodes)
        if self.settings.hybrid and self._fallback is not None:
            deadline = time.monotonic() + self.settings.correction_timeout_s
            try:
                search = query_bundle
                if _searches_web(self._fallback) and self._rewriter is not None and self.settings.max_rewrites > 0:
                    rewriter = self._rewriter
                    with trace.timed("rewrite"), step_span("rewrite") as span:
                        rewritten = yield Io(
                            bind(rewriter.rewrite, query_bundle.query_str),
                            bind(rewriter.arewrite, query_bundle.query_str),
                            left(deadline),
                        )
                        span.outcome = "llm"
                    trace.rewrites, trace.rewritten_query, search = 1, rewritten, QueryBundle(rewritten)
                context += yield from self._fallback_hits(query_bundle, search, deadline, trace)
            except Exception as exc:
                trace.fallback_error = f"{type(exc).__name__}: {exc}"
        return context

    def _correct(self, query_bundle: QueryBundle, trace: CragTrace) -> Generator[Io, Any, List[NodeWithScore]]:
        """INCORRECT: rewrite (capped), retrieve through the fallback, grade again, or abstain."""
        s = self.settings
        deadline = time.monotonic() + s.correction_timeout_s
        if self._fallback is None:
            trace.abstain("retrieval graded incorrect and no fallback retriever is configured")
            return []
        search = query_bundle.query_str
        tried = set()
        for attempt in range(max(1, s.max_rewrites)):
            if s.max_rewrites > 0:
                try:
                    with trace.timed("rewrite"), step_span("rewrite", attempt=attempt + 1) as span:
                        search = yield from self._rewrite(search, query_bundle.query_str, trace, deadline)
                        span.outcome = trace.rewrite_source
                except CorrectiveTimeout:
                    trace.abstain(f"the query rewrite ran past the {s.correction_timeout_s:g} s correction budget")
                    return []
                if search.casefold() in tried:
                    break
                tried.add(search.casefold())
                trace.rewrites = attempt + 1
                trace.rewritten_query = search
            try:
                hits = yield from self._fallback_hits(query_bundle, QueryBundle(search), deadline, trace)
            except CorrectiveTimeout:
                trace.abstain(f"the fallback retrieval ran past the {s.correction_timeout_s:g} s correction budget")
                return []
            except Exception as exc:
                trace.fallback_error = f"{type(exc).__name__}: {exc}"
                trace.abstain(f"the fallback retrieval failed: {trace.fallback_error}")
                return []
            if hits:
                return hits
        broadening = self._broadening
        if broadening is not None:
            try:
                hits = yield from self._fallback_hits(
                    query_bundle, QueryBundle(search), deadline, trace, broadening.fallback, broadening.floor
                )
            except CorrectiveTimeout:
                hits = []
            if hits:
                trace.broadened = list(broadening.keys)
                return hits
        reason = (
            f"after {trace.rewrites} rewrite(s) the fallback's best score "
            f"{trace.retry_score or 0.0:.3f} is still below lower={self._grader.lower:.3f}"
            + (f", with {', '.join(broadening.keys)} relaxed too" if broadening is not None else "")
        )
        trace.abstain(reason + _web_shortfall(trace))
        return []

    def _rewrite(self, search: str, question: str, trace: CragTrace, deadline: float) -> Generator[Io, Any, str]:
        """The LLM's rewrite of ``search``; when it fails (or there is no LLM), the question's keywords.

        A small model's JSON rewrite is often invalid, empty, unchanged or noise, and a large
        model on a CPU can be slow: the deterministic keyword rewrite (``keyword_query``)
        replaces a failed one, and one past ``rewrite_timeout_s`` while the correction budget
        has time left, so the engine never abstains for a broken rewrite, only for missing
        evidence.
        """
        if self._rewriter is not None:
            rewriter = self._rewriter
            own = self.settings.rewrite_timeout_s or self.settings.correction_timeout_s / 2
            try:
                rewritten = yield Io(
                    bind(rewriter.rewrite, search), bind(rewriter.arewrite, search), min(left(deadline), own)
                )
                trace.rewrite_source = "llm"
                return str(rewritten)
            except RewriteError as exc:
                trace.rewrite_error = str(exc)
            except CorrectiveTimeout:
                if left(deadline) <= 0:  # the whole budget is spent: nothing left to search with
                    raise
                trace.rewrite_error = f"the LLM rewrite ran past its {own:g} s limit (rewrite_timeout_s)"
        trace.rewrite_source = "keyword"
        return keyword_query(question)

    def _postprocess(
        self, nodes: List[NodeWithScore], query_bundle: QueryBundle, deadline: Optional[float]
    ) -> Generator[Io, Any, List[NodeWithScore]]:
        """Run the pipeline's own postprocessors (e.g. the reranker whose scores grading reuses)."""
        for postprocessor in self._postprocessors:
            nodes = yield Io(
                bind(postprocessor.postprocess_nodes, nodes, query_bundle),
                bind(postprocessor.apostprocess_nodes, nodes, query_bundle),
                None if deadline is None else left(deadline),
            )
        return nodes

    def _fallback_hits(
        self,
        question: QueryBundle,
        search: QueryBundle,
        deadline: float,
        trace: CragTrace,
        fallback: Optional[BaseRetriever] = None,
        scope: Optional[Scope] = None,
    ) -> Generator[Io, Any, List[NodeWithScore]]:
        """Retrieve ``search`` through the fallback (or ``fallback``, inside ``scope``: the broadening's) and keep
        what grades relevant to ``question``."""
        fallback = fallback or self._fallback
        assert fallback is not None
        with collect_web_reports() as reports:
            try:
                with trace.timed("fallback"), step_span("fallback") as span:
                    hits = yield Io(bind(fallback.retrieve, search), bind(fallback.aretrieve, search), left(deadline))
                    hits = self._in_scope(clean_nodes(hits), fallback, scope or self._scope)
                    span.outcome = "hits" if hits else "empty"
                    span.sizes["hits"] = len(hits)
            finally:
                trace.web.extend(report.to_dict() for report in reports)
        trace.fallback_sources = sorted({h.node.metadata.get(SOURCE_KEY, "fallback") for h in hits})
        with trace.timed("regrade"), step_span("regrade", candidates=len(hits)) as span:
            hits = yield from self._postprocess(hits, question, deadline)
            grading = yield Io(
                bind(self._grader.grade, question, hits), bind(self._grader.agrade, question, hits), left(deadline)
            )
            span.outcome = grading.verdict.value
            span.sizes["kept"] = sum(label is not Verdict.INCORRECT for label in grading.labels)
        record(trace, hits, grading)
        trace.retry_score = grading.aggregate
        if grading.verdict is Verdict.INCORRECT:
            return []
        return not_incorrect(hits, grading)

    @staticmethod
    def _in_scope(hits: List[NodeWithScore], fallback: BaseRetriever, scope: Scope) -> List[NodeWithScore]:
        """The fallback's hits inside ``scope``; the web's (marked by ``FallbackRetriever``, which strips the
        mark from every other source) are outside every document scope and kept."""
        if not scope.bounded:
            return hits
        tagged = isinstance(fallback, FallbackRetriever)
        return [h for h in hits if (tagged and h.node.metadata.get(OUTSIDE_SCOPE_KEY) is True) or scope.admits_node(h)]


def _searches_web(retriever: BaseRetriever) -> bool:
    if isinstance(retriever, FallbackRetriever):
        return any(_searches_web(r) for r in retriever.retrievers.values())
    return isinstance(retriever, WebSearchRetriever)


def _web_shortfall(trace: CragTrace) -> str:
    """Why the web gave nothing, for the abstention reason (empty when the web was not asked)."""
    if not trace.web:
        return ""
    last = trace.web[-1]
    if last["forbidden"] or last["skipped"]:
        return f"; the web was not searched: {last['skipped']}"
    if not last["urls_used"]:
        refused = "; ".join(f"{r['url']}: {r['reason']}" for r in last["refused"][:5])
        return f"; no web page could be used ({refused or 'the search returned no results'})"
    return ""


def not_incorrect(nodes: List[NodeWithScore], grading: Grading) -> List[NodeWithScore]:
    return [
        NodeWithScore(node=n.node, score=score)
        for n, score, label in zip(nodes, grading.scores, grading.labels)
        if label is not Verdict.INCORRECT
    ]


def record(trace: CragTrace, nodes: Sequence[NodeWithScore], grading: Grading) -> None:
    first = not trace.nodes
    explanations: List[Optional[Dict[str, Any]]] = [None] * len(nodes)
    if grading.explanations is not None:
        explanations = list(grading.explanations)
    trace.nodes.extend(
        NodeGrade(
            node_id=n.node.node_id,
            doc_id=shown(n.node.metadata.get("doc_id") or n.node.ref_doc_id) or None,  # a UUID or date in JSON
            score=round(score, 4),
            label=label.value,
            source=n.node.metadata.get(SOURCE_KEY, "retriever"),
            explanation=explanation,
        )
        for n, score, label, explanation in zip(nodes, grading.scores, grading.labels, explanations)
    )
    if first:
        trace.aggregate_score = round(grading.aggregate, 4)
        trace.top_score = round(grading.top_score, 4)
