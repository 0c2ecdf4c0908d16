"""The corrective loop, top to bottom: retrieve, grade, branch (keep, refine, rewrite and fall back), answer, check.

This module is the loop of ``docs/loop.md`` in the order it runs::

    run(question):                          # the engine's query
        parts = split(question)             # one part unless the question asks several things
        for part in parts: one(part)
    one(question):
        evidence = correct(question)        # the corrective retriever's retrieve
        return answer(question, evidence)
    correct(question):
        candidates = retrieve(question)
        grading = grade(question, candidates)
        if CORRECT:    keep the candidates not graded incorrect
        elif AMBIGUOUS: refine them into their relevant strips (and, with ``hybrid``, add graded fallback hits)
        else:          fall_back: rewrite, search the fallback, grade again; abstain when nothing clears ``lower``
    answer(question, evidence):
        quote the evidence, or generate from it and check the answer; or abstain

Every step is a generator that yields its I/O (an ``Io``: how to do it sync and async, and its time
limit) to a driver, so one loop serves ``retrieve`` and ``aretrieve``, ``query`` and ``aquery``. ``step``
wraps a step: its instrumentation span, its time in the trace, its I/O. ``CorrectiveRetriever``
(``core/retriever.py``) and ``CorrectiveQueryEngine`` (``core/engine.py``) are adapters: they hold the
parts, resolved once from the settings when they are built, and run a ``Loop`` over them. The parts are
the grader (``core/grader.py``), the refiner, the rewrite and the fallback on the way, and the answer
step (``answers/extract.py``) at the end.

Below the loop, in the order a reader needs them: the drivers (``drive`` runs the steps in the calling
thread, a step with a limit in a daemon thread abandoned when the limit passes; ``adrive`` awaits them
under ``asyncio.wait_for``; both turn a step past its limit into ``CorrectiveTimeout``), the responses the
loop returns (``text_response``, ``check_when_streamed``), and the trace (``CragTrace``: what the query
decided, ``response.metadata["crag"]``; its events; ``step_span``, the span of one step).
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import inspect
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import (
    Any,
    AsyncGenerator,
    Awaitable,
    Callable,
    Dict,
    Generator,
    Generic,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import RESPONSE_TYPE, AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.callbacks import CallbackManager, CBEventType, EventPayload
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.base import BaseEvent
from llama_index.core.instrumentation.span import active_span_id
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, QueryBundle

from llama_index_crag.answers.extract import NO_FILE, EvidenceQuoter, QuotedAnswer, evidence_place, shown_value
from llama_index_crag.answers.grounding import AnswerCheck, GroundednessChecker
from llama_index_crag.answers.keywords import keyword_query
from llama_index_crag.answers.policy import outcome_of
from llama_index_crag.core.compound import combined, keep_to_subject
from llama_index_crag.core.fallback import OUTSIDE_SCOPE_KEY, SOURCE_KEY, FallbackRetriever, fallback_query
from llama_index_crag.core.grader import Grading, RelevanceGrader, Verdict
from llama_index_crag.core.prompts import quote_sources
from llama_index_crag.core.refiner import StripRefiner
from llama_index_crag.core.rewrite import QueryRewriter, Rewrite
from llama_index_crag.core.settings import CragSettings
from llama_index_crag.deadline import running_until
from llama_index_crag.errors import CorrectiveTimeout, GenerationError, InvalidQueryError, RewriteError
from llama_index_crag.local.models import describe_llm
from llama_index_crag.scope import Scope, scoped_retriever
from llama_index_crag.scorers.bi_encoder import reuse_retrieval_embeddings
from llama_index_crag.scorers.language import language_warning
from llama_index_crag.text.cleaning import clean_nodes, clean_text, is_blank
from llama_index_crag.text.compound import Split, split_question
from llama_index_crag.web.retriever import WebSearchRetriever, collect_web_reports, is_web

#: The engine's dispatcher: the loop's action event is the engine's, as its query span is.
dispatcher = get_dispatcher("llama_index_crag.core.engine")
#: What LlamaIndex's synthesizers answer when the LLM returned no text.
_SYNTHESIZER_EMPTY = "Empty Response"


@dataclass
class Correction:
    """The loop's outcome before the answer step: the checked query, the kept evidence, and the trace."""

    query_bundle: QueryBundle
    nodes: List[NodeWithScore]
    trace: CragTrace
    #: AMBIGUOUS: the graded passages the refiner cut ``nodes`` from, read whole when every kept strip was set aside
    #: for naming no file (``Loop.quote_whole``).
    unrefined: List[NodeWithScore] = field(default_factory=list)


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


@dataclass(frozen=True)
class Answering:
    """The answer step's parts, the engine's: how it answers (``mode``), and what quotes, generates and checks."""

    mode: str  #: "extract" (quote the evidence) or "generate"
    synthesizer: BaseSynthesizer
    quoter: EvidenceQuoter
    checker: GroundednessChecker
    callback_manager: CallbackManager
    #: The synthesizer with the quoted-source templates, for evidence that holds web pages.
    quoting: Callable[[], BaseSynthesizer]

    @property
    def streaming(self) -> bool:
        return bool(getattr(self.synthesizer, "_streaming", False))

    def streamed(self, streaming: bool) -> Answering:
        """These parts with the synthesizer streaming or not (a copy sharing its LLM)."""
        if streaming == self.streaming:
            return self
        synthesizer = copy.copy(self.synthesizer)
        synthesizer._streaming = streaming  # type: ignore[attr-defined]
        return replace(self, synthesizer=synthesizer)


def step(trace: CragTrace, name: str, work: Any, *, stage: Optional[str] = None, **sizes: int) -> Steps[Any]:
    """One step of the loop: ``work`` (an ``Io`` for the driver, or steps of its own) run inside the step's
    span, its wall time added to ``trace.timings_ms[stage or name]``; the span's outcome and sizes are
    ``describe``'s. A step that raises drops its span with the error, and its time is still counted."""
    with trace.timed(stage or name), step_span(name, **sizes) as span:
        result = (yield work) if isinstance(work, Io) else (yield from work)
        span.outcome, more = describe(name, result, trace)
        span.sizes.update(more)
    return result


def io(fn: Callable[..., Any], afn: Callable[..., Any], *args: Any, limit: Optional[float] = None) -> Io:
    """The I/O of calling ``fn(*args)``, or awaiting ``afn(*args)``, within ``limit`` seconds."""
    return Io(bind(fn, *args), bind(afn, *args), limit)


@dataclass(frozen=True)
class Loop:
    """The corrective loop over its parts (see the module's docstring). Built per call; holds no state of its own."""

    retriever: BaseRetriever
    grader: RelevanceGrader
    refiner: StripRefiner
    fallback: Optional[BaseRetriever]
    rewriter: Optional[QueryRewriter]
    settings: CragSettings
    scope: Scope
    broadening: Optional[Broadening] = None
    postprocessors: Sequence[BaseNodePostprocessor] = field(default_factory=tuple)
    answering: Optional[Answering] = None
    #: Whether parts found by the LLM's rewrite end this question's search (``run`` then asks each part alone);
    #: off for a retriever, which has no answer step to put parts together.
    parts_apart: bool = False

    # -- the engine's query ---------------------------------------------------------------------------------------

    def run(self, query_bundle: QueryBundle, is_async: bool) -> Steps[RESPONSE_TYPE]:
        """A question, answered; one that asks several things part by part, each part's loop in its own span
        (``core/compound.py``). The parts come from the rules of ``text/compound.py`` before retrieval, or, for a
        question asked whole that graded INCORRECT, from the LLM's rewrite (``rewrite_parts``): that question is
        then answered part by part instead of searched whole. A single question costs one regular-expression
        pass more."""
        s, answering = self.settings, self._answering()
        splits = s.enabled and s.split_compound
        split = split_question(query_bundle.query_str, s.max_parts) if splits else None
        first: Optional[RESPONSE_TYPE] = None
        if split is None or not split.compound:
            if not splits or self.rewriter is None:
                return (yield from self.one(query_bundle, is_async))
            first = yield from replace(self, parts_apart=True).one(query_bundle, is_async)
            found = list(((first.metadata or {}).get("crag") or {}).get("rewrite_parts") or [])
            if len(found) < 2:
                return first
            kept = found[: s.max_parts]
            split = Split(query_bundle.query_str, kept, len(found) - len(kept), by="rewrite")
        # Each part is answered whole (its check run), then the parts are put together and streamed in one piece.
        # The parts share the question's one correction budget: what a part's rewrite, fallback and regrade
        # spent (and the whole question's, when its rewrite found the parts) is not there for the next.
        whole = replace(self, answering=answering.streamed(False))
        asked_whole = dict((first.metadata or {}).get("crag") or {}) if first is not None else None
        budget = s.correction_timeout_s - correction_spent_s(asked_whole or {})
        responses, spent_before = [], 0
        for number, part in enumerate(split.parts, start=1):
            if budget <= 0 and not spent_before:
                spent_before = number
            # A spent budget leaves a part a token of time: a part that needs no correction is still answered.
            part_loop = replace(whole, settings=s.model_copy(update={"correction_timeout_s": max(budget, 1e-3)}))
            with step_span("part", part=number, parts=len(split.parts)) as span:
                response = yield from part_loop.one(QueryBundle(part), is_async)
                keep_to_subject(response, split, number - 1)
                crag = (response.metadata or {}).get("crag") or {}
                span.outcome = "abstained" if crag.get("abstained") else str(crag.get("action"))
            budget -= correction_spent_s(crag)
            responses.append(response)
        text, sources, crag = combined(split, responses, s.abstain_text, asked_whole)
        if spent_before:
            crag["warnings"].append(
                f"the parts share one correction budget of {s.correction_timeout_s:g} s (correction_timeout_s); "
                f"it was spent before part {spent_before}"
            )
        response = text_response(text, sources, answering.streaming, is_async)
        response.metadata = {"crag": crag}
        return response

    def one(self, query_bundle: QueryBundle, is_async: bool) -> Steps[RESPONSE_TYPE]:
        """One question: the evidence, corrected, then the answer from it."""
        callbacks = self._answering().callback_manager
        with callbacks.event(CBEventType.QUERY, payload={EventPayload.QUERY_STR: query_bundle.query_str}) as query:
            with callbacks.event(
                CBEventType.RETRIEVE, payload={EventPayload.QUERY_STR: query_bundle.query_str}
            ) as retrieve:
                correction = yield from self.correct(query_bundle)
                retrieve.on_end(payload={EventPayload.NODES: correction.nodes})
            response = yield from self.answer(correction, is_async)
            query.on_end(payload={EventPayload.RESPONSE: response})
        return response

    # -- the corrective retriever's retrieve ----------------------------------------------------------------------

    def correct(self, query_bundle: QueryBundle) -> Steps[Correction]:
        """Retrieve, grade, and keep, refine or correct the evidence (or abstain): the loop up to the answer."""
        s = self.settings
        query_bundle = checked_query(query_bundle, s.max_query_chars)
        trace = self._trace(query_bundle)
        with trace.timed("retrieve"):
            nodes = yield io(self.retriever.retrieve, self.retriever.aretrieve, query_bundle)
            nodes = clean_nodes(nodes)  # a retriever that does not embed can return text no tokenizer takes
            nodes = self.scope.keep(nodes)  # a retriever that ignored the scope cannot widen it
        if not nodes and self.scope.bounded and self.broadening is None:
            trace.action = Verdict.INCORRECT.value if s.enabled else trace.action  # nothing to grade, none to read
            trace.abstain(f"no passage inside the caller's scope matched ({self.scope.describe()})")
            return Correction(query_bundle, [], trace)
        if s.enabled:
            reuse_retrieval_embeddings(self.grader.scorer, self.retriever, query_bundle, nodes)
        with trace.timed("rerank"):
            nodes = yield from self._postprocess(nodes, query_bundle, None)

        context: List[NodeWithScore] = nodes
        unrefined: List[NodeWithScore] = []
        if s.enabled:
            grading = yield from step(
                trace, "grade", io(self.grader.grade, self.grader.agrade, query_bundle, nodes), candidates=len(nodes)
            )
            record(trace, nodes, grading)
            trace.action = grading.verdict.value
            if grading.verdict is Verdict.CORRECT:
                context = not_incorrect(nodes, grading)
            elif grading.verdict is Verdict.AMBIGUOUS:
                context = yield from self.refine(query_bundle, nodes, grading, trace)
                unrefined = not_incorrect(nodes, grading) or nodes
            else:
                context = yield from self.fall_back(query_bundle, trace)
        if not context and not trace.abstained:
            trace.abstain("no candidate passage survived retrieval and grading")
        return Correction(query_bundle, [] if trace.abstained else context, trace, unrefined)

    def refine(
        self, query_bundle: QueryBundle, nodes: List[NodeWithScore], grading: Grading, trace: CragTrace
    ) -> Steps[List[NodeWithScore]]:
        """AMBIGUOUS: keep the relevant strips of the candidates; with ``hybrid``, add graded fallback hits."""
        s = self.settings
        candidates = not_incorrect(nodes, grading) or nodes
        refinement = yield from step(
            trace,
            "refine",
            io(self.refiner.refine, self.refiner.arefine, query_bundle, candidates),
            candidates=len(candidates),
        )
        trace.strips_kept, trace.strips_dropped = refinement.kept, refinement.dropped
        trace.strips = [asdict(strip) for strip in refinement.strips]
        if refinement.used_original and s.on_no_strips == "incorrect":
            trace.no_strips = True
            return (yield from self.fall_back(query_bundle, trace))
        context = list(refinement.nodes)
        if s.hybrid and self.fallback is not None:
            deadline = time.monotonic() + s.correction_timeout_s
            try:
                search = query_bundle.query_str
                if _searches_web(self.fallback) and self.rewriter is not None and s.max_rewrites > 0:
                    rewriter = self.rewriter
                    rewritten = yield from step(
                        trace,
                        "rewrite",
                        io(rewriter.rewrite, rewriter.arewrite, query_bundle.query_str, limit=left(deadline)),
                    )
                    trace.rewrite_source = "llm"
                    trace.rewrites, trace.rewritten_query, search = 1, rewritten, str(rewritten)
                context += yield from self.search_fallback(query_bundle, search, deadline, trace)
            except Exception as exc:
                trace.fallback_error = f"{type(exc).__name__}: {exc}"
        return context

    def fall_back(self, query_bundle: QueryBundle, trace: CragTrace) -> Steps[List[NodeWithScore]]:
        """INCORRECT: rewrite (capped), retrieve through the fallback, grade again; or abstain."""
        s = self.settings
        deadline = time.monotonic() + s.correction_timeout_s
        if self.fallback is None:
            trace.abstain("retrieval graded incorrect and no fallback retriever is configured")
            return []
        search, tried = query_bundle.query_str, set()
        for attempt in range(max(1, s.max_rewrites)):
            if s.max_rewrites > 0:
                try:
                    search = yield from step(
                        trace,
                        "rewrite",
                        self.rewrite(search, query_bundle.query_str, trace, deadline),
                        attempt=attempt + 1,
                    )
                except CorrectiveTimeout:
                    trace.abstain(f"the query rewrite ran past the {s.correction_timeout_s:g} s correction budget")
                    return []
                if search.casefold() in tried:
                    break
                tried.add(search.casefold())
                trace.rewrites, trace.rewritten_query = attempt + 1, search
                if self.parts_apart and trace.rewrite_parts:
                    trace.abstain(
                        f"the rewrite found {len(trace.rewrite_parts)} questions in this one; each is asked on its own"
                    )
                    return []
            try:
                hits = yield from self.search_fallback(query_bundle, search, deadline, trace)
            except CorrectiveTimeout:
                trace.abstain(f"the fallback retrieval ran past the {s.correction_timeout_s:g} s correction budget")
                return []
            except Exception as exc:
                trace.fallback_error = f"{type(exc).__name__}: {exc}"
                trace.abstain(f"the fallback retrieval failed: {trace.fallback_error}")
                return []
            if hits:
                return hits
        broadening = self.broadening
        if broadening is not None:
            try:
                hits = yield from self.search_fallback(
                    query_bundle, search, deadline, trace, broadening.fallback, broadening.floor
                )
            except CorrectiveTimeout:
                hits = []
            if hits:
                trace.broadened = list(broadening.keys)
                return hits
        reason = (
            f"after {trace.rewrites} rewrite(s) the fallback's best score "
            f"{trace.retry_score or 0.0:.3f} is still below lower={self.grader.lower:.3f}"
            + (f", with {', '.join(broadening.keys)} relaxed too" if broadening is not None else "")
        )
        trace.abstain(reason + _web_shortfall(trace))
        return []

    def rewrite(self, search: str, question: str, trace: CragTrace, deadline: float) -> Steps[str]:
        """The LLM's rewrite of ``search``; when it fails (or there is no LLM), the question's keywords.

        A small model's JSON rewrite is often invalid, empty, unchanged or noise, and a large
        model on a CPU can be slow: the deterministic keyword rewrite (``keyword_query``)
        replaces a failed one, and one past ``rewrite_timeout_s`` while the correction budget
        has time left, so the engine never abstains for a broken rewrite, only for missing
        evidence.
        """
        if self.rewriter is not None:
            rewriter = self.rewriter
            own = self.settings.rewrite_timeout_s or self.settings.correction_timeout_s / 2
            try:
                limit = min(left(deadline), own)
                if search != question:  # a later attempt rewrites a rewrite: its parts would not be the question's
                    again: str = yield io(rewriter.rewrite, rewriter.arewrite, search, limit=limit)
                    trace.rewrite_source = "llm"
                    return again
                rewritten: Rewrite = yield io(rewriter.rewrite_parts, rewriter.arewrite_parts, search, limit=limit)
                trace.rewrite_source = "llm"
                trace.rewrite_parts, trace.rewrite_parts_refused = list(rewritten.parts), rewritten.parts_refused
                return rewritten.query
            except RewriteError as exc:
                trace.rewrite_error = str(exc)
            except CorrectiveTimeout:
                if left(deadline) <= 0:  # the whole budget is spent: nothing left to search with
                    raise
                trace.rewrite_error = f"the LLM rewrite ran past its {own:g} s limit (rewrite_timeout_s)"
        trace.rewrite_source = "keyword"
        return keyword_query(question)

    def search_fallback(
        self,
        question: QueryBundle,
        search: str,
        deadline: float,
        trace: CragTrace,
        fallback: Optional[BaseRetriever] = None,
        scope: Optional[Scope] = None,
    ) -> Steps[List[NodeWithScore]]:
        """Retrieve through the fallback (or ``fallback``, inside ``scope``: the broadening's), ``search`` for its
        word sources and the question's own vector for its dense ones (``fallback_query``), and keep what grades
        relevant to ``question``."""
        fallback = fallback or self.fallback
        assert fallback is not None
        query = fallback_query(question, search, self.retriever, fallback)
        with collect_web_reports() as reports:
            try:
                hits = yield from step(trace, "fallback", self._fallback_hits(fallback, query, deadline, scope))
            finally:
                trace.web.extend(report.to_dict() for report in reports)
        trace.fallback_sources = sorted({h.node.metadata.get(SOURCE_KEY, "fallback") for h in hits})
        # A chunk the fallback found again (BM25's) has its vector in the primary index: grading reads it there.
        reuse_retrieval_embeddings(self.grader.scorer, self.retriever, question, hits)
        grading = yield from step(trace, "regrade", self._regrade(question, hits, deadline), candidates=len(hits))
        record(trace, hits, grading)
        trace.retry_score = grading.aggregate
        if grading.verdict is Verdict.INCORRECT:
            return []
        return not_incorrect(hits, grading)

    # -- the engine's answer --------------------------------------------------------------------------------------

    def answer(self, correction: Correction, is_async: bool) -> Steps[RESPONSE_TYPE]:
        """Quote the evidence, or generate from it and check the answer; or abstain."""
        s, answering = self.settings, self._answering()
        query_bundle, context, trace = correction.query_bundle, correction.nodes, correction.trace
        streaming = answering.streaming
        trace.answer_mode = answering.mode if s.enabled else "generate"
        response: Optional[RESPONSE_TYPE] = None
        if not trace.abstained and trace.answer_mode == "extract":
            with answering.callback_manager.event(
                CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: query_bundle.query_str}
            ) as synthesize:
                quoted, grade = (yield from self.quote(query_bundle, context, trace)), None
                if quoted.all_set_aside_for == {NO_FILE} and correction.unrefined and trace.strips_kept:
                    context, quoted = yield from self.quote_whole(query_bundle, context, quoted, correction, trace)
                if not quoted.quotes and quoted.elsewhere and self.fallback is not None:
                    found = yield from self.search_entry(query_bundle, quoted.elsewhere, trace)
                    if found:
                        context, grade = found, trace.retry_score
                        quoted = yield from self.quote(query_bundle, context, trace, grade)
                if quoted.quotes:
                    trace.answered_by = "extract"
                    response = text_response(quoted.text, context, streaming, is_async)
                elif quoted.withheld:
                    trace.abstain(
                        f"no strip of the graded passages answers the question: {quoted.why_withheld()}"
                        f"{_graded_at(trace, grade)}{_searched_by_name(trace)}"
                    )
                elif quoted.set_aside:
                    trace.abstain(
                        f"no strip of the graded passages answers the question: {quoted.why_withheld()}"
                        f"{_searched_by_name(trace)}"
                    )
                else:
                    trace.abstain("the graded passages hold no strip that may be quoted")
                synthesize.on_end(payload={EventPayload.RESPONSE: response})
        elif not trace.abstained:
            response = yield from self.generate(query_bundle, context, trace)
            trace.answered_by = "generate"
            if s.enabled and s.check_answers and not streaming:
                response = yield from self.check(query_bundle, context, response, trace, is_async)
        if trace.abstained or response is None:
            trace.answered_by = "abstain"
            response = text_response(s.abstain_text, [], streaming, is_async)
        response.metadata = {**(response.metadata or {}), "crag": trace.to_dict()}
        if trace.answered_by == "generate" and streaming and s.enabled and s.check_answers:
            check_when_streamed(response, self.check_streamed(query_bundle, context, response))
        if not trace.abstained and trace.broadened:
            _say_broadened(response, trace.broadened)
        dispatcher.event(trace.action_event())
        return response

    def quote_whole(
        self,
        query_bundle: QueryBundle,
        context: List[NodeWithScore],
        quoted: QuotedAnswer,
        correction: Correction,
        trace: CragTrace,
    ) -> Steps[Tuple[List[NodeWithScore], QuotedAnswer]]:
        """Every strip the refiner kept was set aside for naming no file where the question asks which file: the
        refiner scores a strip by the question's words, and the sentence that names the file ("... the ident map
        file, which by default is named pg_ident.conf") shares few of them. Read the graded passages whole, under the
        same threshold and rules; when that quotes nothing either, the first reading stands. Not for a default: every
        entry of a reference page states its own, and read whole, the passages offered another setting's."""
        whole = yield from self.quote(query_bundle, correction.unrefined, trace)
        if whole.quotes:
            trace.quote_check = {**(trace.quote_check or {}), "whole_passages": True}
            return correction.unrefined, whole
        trace.quotes, trace.quote_check = quoted.to_list(), quoted.check()
        return context, quoted

    def search_entry(self, query_bundle: QueryBundle, names: List[str], trace: CragTrace) -> Steps[List[NodeWithScore]]:
        """Every strip that could answer stood in another identifier's entry: the passages retrieved are the asked
        one's neighbours on a reference page. Search the fallback for the asked identifiers by name (its word
        sources find the entry that bears it; its dense ones read the question), graded against the question; []
        when nothing clears ``lower`` or the search fails, and the abstention stands."""
        trace.entry_search = " ".join(names)
        deadline, graded = time.monotonic() + self.settings.correction_timeout_s, trace.retry_score
        try:
            found = yield from self.search_fallback(query_bundle, trace.entry_search, deadline, trace)
        except Exception as exc:  # a time-out included: the abstention stands, and says why
            trace.fallback_error = f"{type(exc).__name__}: {exc}"
            found = []
        if not found:
            trace.retry_score = graded  # the evidence answered from is still the one graded before
        return found

    def quote(
        self,
        query_bundle: QueryBundle,
        context: List[NodeWithScore],
        trace: CragTrace,
        grade: Optional[float] = None,
    ) -> Steps[QuotedAnswer]:
        """The best strips of the evidence, quoted with their sources (recorded in the trace); ``grade`` is the
        grader's grade of ``context`` when it is not the one the action says (``evidence_grade``)."""
        quoter = self._answering().quoter
        if grade is None:
            grade = evidence_grade(trace.action, trace.top_score, trace.retry_score)
        place = evidence_place(grade, trace.upper, trace.lower)
        quoted = yield from step(
            trace,
            "quote",
            io(quoter.quote, quoter.aquote, query_bundle.query_str, context, place),
            stage="extract",
            passages=len(context),
        )
        trace.quotes = quoted.to_list()
        trace.quote_check = quoted.check()
        return quoted  # type: ignore[no-any-return]

    def generate(
        self, query_bundle: QueryBundle, context: List[NodeWithScore], trace: CragTrace
    ) -> Steps[RESPONSE_TYPE]:
        """The synthesizer's answer from the evidence (web pages quoted between source tags)."""
        answering = self._answering()
        synthesizer, sources = answering.synthesizer, context
        if any(is_web(n) for n in context):
            context = sorted(context, key=is_web)
            synthesizer, sources = answering.quoting(), quote_sources(context)
        with trace.timed("generate"):  # the synthesizer's own spans are the step's
            try:
                response = yield io(synthesizer.synthesize, synthesizer.asynthesize, query_bundle, sources)
            except Exception as exc:
                raise self.generation_error(exc) from exc
        response.source_nodes = list(context)
        tokens = getattr(response, "response_gen", None)
        if tokens is not None:  # streamed: the generator is called as the tokens are read
            response.response_gen = _named_failures(tokens, self.generation_error)  # type: ignore[union-attr]
        return response  # type: ignore[no-any-return]

    def check(
        self,
        query_bundle: QueryBundle,
        context: List[NodeWithScore],
        response: RESPONSE_TYPE,
        trace: CragTrace,
        is_async: bool,
    ) -> Steps[Optional[RESPONSE_TYPE]]:
        """Check a generated answer against its evidence and apply ``on_ungrounded``; None means abstain."""
        checker = self._answering().checker
        question, answer = query_bundle.query_str, str(getattr(response, "response", None) or "")
        if answer.strip() == _SYNTHESIZER_EMPTY:
            answer = ""
        evidence = context_texts(context)
        check = yield from step(
            trace,
            "check",
            _checked(io(checker.check, checker.acheck, answer, evidence, question)),
            passages=len(evidence),
        )
        policy = self.settings.on_ungrounded
        outcome = outcome_of(check, policy)
        trace.grounded = check.grounded
        trace.answer_check = {**check.to_dict(), "policy": policy, "outcome": outcome}
        if outcome == "kept":
            return response
        quoted = yield from self.quote(query_bundle, context, trace)
        if outcome == "flagged":
            return response
        if outcome == "extract" and quoted.quotes:
            trace.answered_by = "extract"
            return text_response(quoted.text, context, False, is_async)
        unsupported = ", ".join(check.unsupported[:5])
        withheld = (
            f"; no quotes were given instead: {quoted.why_withheld()}"
            if (quoted.withheld and quoted.grade is not None) or quoted.set_aside
            else ""
        )
        trace.abstain(
            f"the generated answer failed its check against the sources ({check.reason}"
            + (f"; unsupported: {unsupported}" if unsupported else "")
            + ")"
            + withheld
        )
        return None

    def check_streamed(
        self, query_bundle: QueryBundle, context: List[NodeWithScore], response: RESPONSE_TYPE
    ) -> Callable[[str, Optional[str]], None]:
        """The check of a streamed answer, run when its stream ends, recorded in the response's trace.

        The same check as ``check``; a streamed answer was already sent, so ``on_ungrounded``
        cannot replace it: an ungrounded one is flagged, with the quoted evidence beside it.
        """
        answering = self._answering()

        def finish(answer: str, cut: Optional[str]) -> None:
            crag = response.metadata["crag"]  # type: ignore[index]
            started = time.perf_counter()
            if cut is not None:
                check = AnswerCheck("incomplete", None, reason=f"the stream ended before the answer did: {cut}")
            else:
                check = _checked_now(answering.checker, answer, context_texts(context), query_bundle.query_str)
            outcome = outcome_of(check, "flag")
            if outcome != "kept":
                try:
                    bands = crag["thresholds"]
                    grade = evidence_grade(crag["action"], crag.get("top_score"), crag.get("retry_score"))
                    place = evidence_place(grade, bands["upper"], bands["lower"])
                    quoted = answering.quoter.quote(query_bundle.query_str, context, place)
                    crag["quotes"] = quoted.to_list()
                    crag["quote_check"] = quoted.check()
                except Exception as exc:
                    crag["quotes"] = []
                    check.reason = f"{check.reason}; the evidence could not be quoted: {type(exc).__name__}: {exc}"
            crag["grounded"] = check.grounded
            crag["answer_check"] = {
                **check.to_dict(),
                "policy": self.settings.on_ungrounded,
                "outcome": outcome,
                "streamed": True,
            }
            elapsed = round((time.perf_counter() - started) * 1000.0, 3)
            timings = crag["timings_ms"]
            timings["check"] = elapsed
            timings["crag_ms"] = round(timings.get("crag_ms", 0.0) + elapsed, 3)

        return finish

    def generation_error(self, exc: BaseException) -> GenerationError:
        """What a failing generator raises: a ``GenerationError`` that names the model and its server."""
        llm = getattr(self._answering().synthesizer, "_llm", None)
        return GenerationError(
            f"the generator {describe_llm(llm) if llm is not None else ''} failed: {type(exc).__name__}: {exc}"
        )

    # -- the steps' small parts -----------------------------------------------------------------------------------

    def _trace(self, query_bundle: QueryBundle) -> CragTrace:
        trace = CragTrace(
            query=query_bundle.query_str,
            enabled=self.settings.enabled,
            scorer=self.grader.scorer.name,
            upper=self.grader.upper,
            lower=self.grader.lower,
            aggregation=self.grader.aggregation,
            strip_threshold=self.refiner.threshold,
            warnings=list(self.grader.scorer.warnings),
            scope=self.scope.filters.model_dump(mode="json") if self.scope.filters is not None else None,
        )
        if self.settings.enabled and (warning := language_warning(query_bundle.query_str, self.grader.scorer)):
            trace.warnings.append(warning)
        return trace

    def _answering(self) -> Answering:
        if self.answering is None:
            raise TypeError("this loop has no answer step: build it from a CorrectiveQueryEngine")
        return self.answering

    def _postprocess(
        self, nodes: List[NodeWithScore], query_bundle: QueryBundle, deadline: Optional[float]
    ) -> Steps[List[NodeWithScore]]:
        """Run the pipeline's own postprocessors (e.g. the reranker whose scores grading reuses)."""
        for postprocessor in self.postprocessors:
            nodes = yield io(
                postprocessor.postprocess_nodes,
                postprocessor.apostprocess_nodes,
                nodes,
                query_bundle,
                limit=None if deadline is None else left(deadline),
            )
        return nodes

    def _fallback_hits(
        self, fallback: BaseRetriever, search: QueryBundle, deadline: float, scope: Optional[Scope]
    ) -> Steps[List[NodeWithScore]]:
        hits = yield io(fallback.retrieve, fallback.aretrieve, search, limit=left(deadline))
        return _in_scope(clean_nodes(hits), fallback, scope or self.scope)

    def _regrade(self, question: QueryBundle, hits: List[NodeWithScore], deadline: float) -> Steps[Grading]:
        hits = yield from self._postprocess(hits, question, deadline)
        return (yield io(self.grader.grade, self.grader.agrade, question, hits, limit=left(deadline)))


def describe(name: str, result: Any, trace: CragTrace) -> Tuple[str, Dict[str, int]]:
    """A step's outcome and sizes for its span, from what it returned."""
    if isinstance(result, Grading):
        return result.verdict.value, {"kept": sum(label is not Verdict.INCORRECT for label in result.labels)}
    if name == "refine":
        return ("original" if result.used_original else "strips"), {
            "strips_kept": result.kept,
            "strips_dropped": result.dropped,
        }
    if name == "fallback":
        return ("hits" if result else "empty"), {"hits": len(result)}
    if name == "rewrite":
        return trace.rewrite_source or "llm", {}
    if isinstance(result, QuotedAnswer):
        return ("quoted" if result.quotes else "withheld" if result.withheld else "none"), {
            "quotes": len(result.quotes),
            "withheld": len(result.withheld),
        }
    if isinstance(result, AnswerCheck):
        return (result.status if result.grounded is None else "grounded" if result.grounded else "ungrounded"), {}
    return "", {}


#: The stages the correction budget bounds.
BUDGETED_STAGES = ("rewrite", "fallback", "regrade")


def correction_spent_s(trace: Dict[str, Any]) -> float:
    """Seconds a question's trace spent on the stages ``correction_timeout_s`` bounds."""
    timings = trace.get("timings_ms") or {}
    return sum(float(timings.get(stage) or 0.0) for stage in BUDGETED_STAGES) / 1000.0


def checked_query(query_bundle: QueryBundle, max_chars: int) -> QueryBundle:
    """The query with characters no store or tokenizer takes replaced (``clean_text``), or a clear error."""
    query = clean_text(query_bundle.query_str or "")
    if is_blank(query):
        raise InvalidQueryError("the query is empty: ask a question")
    if len(query_bundle.query_str) > max_chars:
        raise InvalidQueryError(
            f"the query is {len(query_bundle.query_str):,} characters, over the limit of {max_chars:,} "
            "(raise max_query_chars or CRAG_MAX_QUERY_CHARS if this is intended)"
        )
    if query == query_bundle.query_str:
        return query_bundle
    return QueryBundle(
        query,
        image_path=query_bundle.image_path,
        custom_embedding_strs=[clean_text(t) for t in query_bundle.custom_embedding_strs or []] or None,
        embedding=query_bundle.embedding,
    )


def not_incorrect(nodes: List[NodeWithScore], grading: Grading) -> List[NodeWithScore]:
    """The candidates not graded incorrect, scored with their grades."""
    return [
        NodeWithScore(node=n.node, score=score)
        for n, score, label in zip(nodes, grading.scores, grading.labels)
        if label is not Verdict.INCORRECT
    ]


def record(trace: CragTrace, nodes: Sequence[NodeWithScore], grading: Grading) -> None:
    """Add each candidate's grade to the trace; the first grading's batch and top scores are the trace's."""
    first = not trace.nodes
    explanations: List[Optional[Dict[str, Any]]] = [None] * len(nodes)
    if grading.explanations is not None:
        explanations = list(grading.explanations)
    trace.nodes.extend(
        NodeGrade(
            node_id=n.node.node_id,
            doc_id=shown_value(n.node.metadata.get("doc_id") or n.node.ref_doc_id) or None,  # a UUID or date in JSON
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


def evidence_grade(action: str, top_score: Optional[float], retry_score: Optional[float]) -> Optional[float]:
    """The grader's grade of the evidence an answer comes from: the retrieved passages' top score, or for evidence
    the fallback found (action "incorrect"), its own grade."""
    if action == Verdict.INCORRECT.value and retry_score is not None:
        return retry_score
    return top_score


def context_texts(context: Sequence[NodeWithScore]) -> List[str]:
    """The passage texts an answer was generated from, as the generator saw them."""
    return [n.node.get_content() for n in context]


def _checked(check: Io) -> Steps[AnswerCheck]:
    """The answer check's I/O; a check that fails is an "error" outcome, never an answer kept or lost by it."""
    try:
        return (yield check)  # type: ignore[no-any-return]
    except Exception as exc:
        return _check_failed(exc)


def _checked_now(checker: GroundednessChecker, answer: str, evidence: List[str], question: str) -> AnswerCheck:
    """``_checked`` run at once, where a streamed answer ends (no driver to yield to)."""
    try:
        return checker.check(answer, evidence, question)
    except Exception as exc:
        return _check_failed(exc)


def _check_failed(exc: Exception) -> AnswerCheck:
    return AnswerCheck("error", None, reason=f"the check failed: {type(exc).__name__}: {exc}")


def _in_scope(hits: List[NodeWithScore], fallback: BaseRetriever, scope: Scope) -> List[NodeWithScore]:
    """The fallback's hits inside ``scope``; the web's (marked by ``FallbackRetriever``, which strips the mark
    from every other source) are outside every document scope and kept."""
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


def _graded_at(trace: CragTrace, grade: Optional[float] = None) -> str:
    """What the quote threshold was set by, for an abstention's reason: the grade of the evidence (``grade``, when
    it is not the one the action says: what a search for the asked entry found)."""
    grade = evidence_grade(trace.action, trace.top_score, trace.retry_score) if grade is None else grade
    return "" if grade is None else f" for evidence graded {grade:.3f}"


def _searched_by_name(trace: CragTrace) -> str:
    """For an abstention's reason: that the entry of the asked identifier was searched for too."""
    return "" if trace.entry_search is None else f"; a search for {trace.entry_search} by name did not answer it either"


def _say_broadened(response: RESPONSE_TYPE, keys: List[str]) -> None:
    """Begin the answer with a line saying it came from a search with ``keys`` relaxed (``broaden=``)."""
    note = f"(From a broadened search: the filter on {', '.join(keys)} was relaxed.)\n"
    tokens = getattr(response, "response_gen", None)
    if tokens is None:
        response.response = f"{note}{response.response or ''}"  # type: ignore[union-attr]
    elif hasattr(tokens, "__aiter__"):

        async def noted_async() -> Any:
            yield note
            async for token in tokens:
                yield token

        response.response_gen = noted_async()  # type: ignore[union-attr]
    else:

        def noted() -> Any:
            yield note
            yield from tokens

        response.response_gen = noted()  # type: ignore[union-attr]


def _named_failures(tokens: Any, error: Callable[[BaseException], GenerationError]) -> Any:
    """A streamed answer's tokens, a failure of the generator while they are read raised as ``error`` makes it (a
    ``GenerationError``, as an answer that is not streamed raises), sync or async as ``tokens`` are."""
    if hasattr(tokens, "__aiter__"):

        async def named_async() -> AsyncGenerator[str, None]:
            try:
                async for token in tokens:
                    yield token
            except GenerationError:
                raise
            except Exception as exc:
                raise error(exc) from exc

        return named_async()

    def named() -> Generator[str, None, None]:
        try:
            yield from tokens
        except GenerationError:
            raise
        except Exception as exc:
            raise error(exc) from exc

    return named()


# ----------------------------------------------------------------------------------------------------
# The drivers: each step's I/O run in the calling thread (``drive``) or awaited (``adrive``), under its
# time limit, and the responses the loop returns.
# ----------------------------------------------------------------------------------------------------


@dataclass
class Io:
    """One piece of I/O the loop hands to a driver: how to do it sync and async, and its time limit."""

    run: Callable[[], Any]
    arun: Callable[[], Awaitable[Any]]
    timeout_s: Optional[float] = None


T = TypeVar("T")
#: Steps of the loop (or of a part of it) that end with a ``T``: the retriever's end with its ``Correction``, the
#: engine's with its response.
Steps = Generator[Io, Any, T]
Outcome = Tuple[Any, Optional[BaseException]]


@dataclass
class Done(Generic[T]):
    """The steps have finished with this value."""

    value: T


def advance(loop: Steps[T], outcome: Outcome) -> Union[Io, Done[T]]:
    """Hand the last step's result (or its error) back to the loop and get its next step."""
    value, error = outcome
    try:
        return loop.throw(error) if error is not None else loop.send(value)
    except StopIteration as done:
        return Done(done.value)


def drive(loop: Steps[T]) -> T:
    """Run the steps in this thread, each under its time limit; what they end with."""
    outcome: Outcome = (None, None)
    while not isinstance(step := advance(loop, outcome), Done):
        try:
            outcome = (run_with_timeout(step.run, step.timeout_s), None)
        except Exception as exc:
            outcome = (None, exc)
    return step.value


async def adrive(loop: Steps[T]) -> T:
    """Await the steps, each under its time limit; what they end with."""
    outcome: Outcome = (None, None)
    while not isinstance(step := advance(loop, outcome), Done):
        try:
            limit = None if step.timeout_s is None else max(step.timeout_s, 0.0)
            with running_until(None if limit is None else time.monotonic() + limit):
                # The task wait_for starts, and any thread it hands work to, inherit the deadline.
                outcome = (await asyncio.wait_for(_own_errors(step.arun()), limit), None)
        except _StepError as failed:  # the step's own TimeoutError (a client's), not the limit running out
            outcome = (None, failed.error)
        except asyncio.TimeoutError:  # wait_for's: the step ran past its limit
            outcome = (None, CorrectiveTimeout())
        except Exception as exc:
            outcome = (None, exc)
    return step.value


class _StepError(Exception):
    """A ``TimeoutError`` the step raised itself, carried past ``wait_for``'s own (since 3.11, the same class)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


async def _own_errors(step: Awaitable[Any]) -> Any:
    try:
        return await step
    except asyncio.TimeoutError as exc:
        raise _StepError(exc) from exc


def bind(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)


def left(deadline: float) -> float:
    return deadline - time.monotonic()


def text_response(text: str, sources: Sequence[NodeWithScore], streaming: bool, is_async: bool) -> RESPONSE_TYPE:
    """A response that is a fixed text (an abstention or a quoted answer), streamed in one piece when asked."""
    if not streaming:
        return Response(response=text, source_nodes=list(sources))
    if is_async:

        async def once() -> Any:
            yield text

        return AsyncStreamingResponse(response_gen=once(), source_nodes=list(sources))

    def single() -> Generator[str, None, None]:
        yield text

    return StreamingResponse(response_gen=single(), source_nodes=list(sources))


def check_when_streamed(response: RESPONSE_TYPE, finish: Callable[[str, Optional[str]], None]) -> None:
    """Wrap a streamed answer's tokens so that ``finish(text, cut)`` runs when the stream ends.

    ``cut`` is None when the generator ran to its end, else why it did not (the reader
    stopped reading, or the generator raised): the trace then says the answer is unchecked.
    """
    crag = response.metadata["crag"]  # type: ignore[index]
    crag["answer_check"] = {"status": "pending", "grounded": None, "reason": "checked when the stream ends"}
    tokens = response.response_gen  # type: ignore[union-attr]
    if hasattr(tokens, "__aiter__"):

        async def checked_async() -> Any:
            parts: List[str] = []
            cut: Optional[str] = "the reader stopped reading"
            try:
                async for token in tokens:
                    parts.append(token)
                    yield token
                cut = None
            except Exception as exc:
                cut = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                if cut is None:
                    await asyncio.to_thread(finish, "".join(parts), None)
                else:
                    finish("".join(parts), cut)

        response.response_gen = checked_async()  # type: ignore[union-attr]
        return

    def checked() -> Generator[str, None, None]:
        parts: List[str] = []
        cut: Optional[str] = "the reader stopped reading"
        try:
            for token in tokens:
                parts.append(token)
                yield token
            cut = None
        except Exception as exc:
            cut = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            finish("".join(parts), cut)

    response.response_gen = checked()  # type: ignore[union-attr]


def run_with_timeout(fn: Callable[[], Any], timeout_s: Optional[float]) -> Any:
    """Run ``fn``; with a limit, in a daemon thread that is abandoned when the limit passes (``fn`` sees the
    deadline as ``deadline.step_deadline()``)."""
    if timeout_s is None:
        return fn()
    if timeout_s <= 0:
        raise CorrectiveTimeout()
    outcome: Dict[str, Any] = {}
    finished = threading.Event()
    context = contextvars.copy_context()
    deadline = time.monotonic() + timeout_s

    def until_deadline() -> Any:
        with running_until(deadline):  # so that a part that can stop early stops when the step is abandoned
            return fn()

    def target() -> None:
        try:
            outcome["value"] = context.run(until_deadline)
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc
        finally:
            finished.set()

    threading.Thread(target=target, daemon=True, name="crag-correction").start()
    if not finished.wait(timeout_s):
        raise CorrectiveTimeout()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# ----------------------------------------------------------------------------------------------------
# The trace: what one query decided, the events that report it, and the span of each step.
# ----------------------------------------------------------------------------------------------------


STAGES = ("retrieve", "rerank", "grade", "refine", "rewrite", "fallback", "regrade", "generate", "extract", "check")
CORRECTION_STAGES = ("grade", "refine", "rewrite", "fallback", "regrade", "check")


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


#: The dispatcher of the steps' spans and events (the query's span is the engine's).
_steps = get_dispatcher(__name__)

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
    _steps.span_enter(id_=id_, bound_args=bound, parent_id=parent, tags={"crag.step": step})
    record = StepRecord(step, sizes=dict(sizes))
    try:
        yield record
    except BaseException as exc:
        _steps.span_drop(id_=id_, bound_args=bound, err=exc)
        raise
    else:
        _steps.event(CragStepEvent(step=step, outcome=record.outcome, sizes=record.sizes))
        _steps.span_exit(id_=id_, bound_args=bound, result=record)
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
