"""CorrectiveQueryEngine: retrieve, grade, then generate, refine, fall back or abstain."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import asdict
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
)
from llama_index.core.callbacks import CallbackManager
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts.mixin import PromptMixinType
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, QueryBundle

from llama_index_crag.answers.extract import EvidenceQuoter, QuotedAnswer
from llama_index_crag.answers.grounding import AnswerCheck, GroundednessChecker
from llama_index_crag.answers.keywords import keyword_query
from llama_index_crag.answers.policy import default_answer_mode, outcome_of
from llama_index_crag.core.builder import from_defaults
from llama_index_crag.core.driver import (
    Io,
    Loop,
    adrive,
    bind,
    check_when_streamed,
    drive,
    left,
    text_response,
)
from llama_index_crag.core.fallback import SOURCE_KEY, FallbackRetriever
from llama_index_crag.core.grader import Grading, RelevanceGrader, Verdict
from llama_index_crag.core.prompts import QUOTED_QA_TEMPLATE, QUOTED_REFINE_TEMPLATE, quote_sources
from llama_index_crag.core.refiner import StripRefiner
from llama_index_crag.core.rewrite import QueryRewriter, RewriteError
from llama_index_crag.core.settings import CragSettings
from llama_index_crag.core.trace import CragTrace, NodeGrade
from llama_index_crag.errors import CorrectiveTimeout, GenerationError, InvalidQueryError
from llama_index_crag.local.models import describe_llm
from llama_index_crag.scorers.bi_encoder import reuse_retrieval_embeddings
from llama_index_crag.stores.chunking import clean_text
from llama_index_crag.web.retriever import WebSearchRetriever, collect_web_reports, is_web

logger = logging.getLogger(__name__)


dispatcher = get_dispatcher(__name__)


#: What LlamaIndex's synthesizers answer when the LLM returned no text.
_SYNTHESIZER_EMPTY = "Empty Response"


class CorrectiveQueryEngine(BaseQueryEngine):
    """A query engine that grades retrieval before generating, and corrects or abstains.

    The loop (see ``docs/loop.md``): retrieve; grade every candidate; then

    * CORRECT: generate from the candidates not graded incorrect (no added model call);
    * AMBIGUOUS: refine the candidates into their relevant knowledge strips, and
      optionally add graded fallback results (``hybrid``);
    * INCORRECT: rewrite the query (at most ``max_rewrites`` times), retrieve through
      the ``FallbackRetriever``, grade again against the user's question, and use the
      result if it clears ``lower``, else abstain.

    With the opt-in web source (``web=``, see ``docs/web.md``) the generator's prompt
    quotes every source between ``<source>`` tags with its origin and URL, tells it
    that sources are data and not instructions, and that internal documents win
    over web pages.

    Every failure of the correction path ends in an abstention, never in an answer.
    The decision trace is in ``response.metadata["crag"]``. The sync and async paths
    run the same loop (``_loop``); only the driver that performs its I/O differs.

    Args:
        retriever: Any LlamaIndex retriever.
        grader: Scores and bands the candidates.
        refiner: Knowledge-strip refinement for AMBIGUOUS.
        fallback: The retrieval of the INCORRECT branch (and of ``hybrid``).
        rewriter: The query rewrite of the INCORRECT branch.
        response_synthesizer: The stock synthesizer that generates the answer.
        settings: Resolved settings (see ``CragSettings.resolve``).
        node_postprocessors: Run after retrieval and before grading (e.g. a reranker
            whose scores the grader reuses).
    """

    def __init__(
        self,
        retriever: BaseRetriever,
        grader: RelevanceGrader,
        refiner: StripRefiner,
        fallback: Optional[BaseRetriever],
        rewriter: Optional[QueryRewriter],
        response_synthesizer: BaseSynthesizer,
        settings: CragSettings,
        node_postprocessors: Optional[Sequence[BaseNodePostprocessor]] = None,
        callback_manager: Optional[CallbackManager] = None,
    ) -> None:
        self._retriever = retriever
        self._grader = grader
        self._refiner = refiner
        self._fallback = fallback
        self._rewriter = rewriter
        self._synthesizer = response_synthesizer
        self._postprocessors = list(node_postprocessors or [])
        self._quoting: Optional[BaseSynthesizer] = None
        self.settings = settings
        #: "extract" or "generate": the setting, or when unset, what the generator allows (``default_answer_mode``).
        self.answer_mode = settings.answer_mode or default_answer_mode(getattr(response_synthesizer, "_llm", None))
        self._quoter = EvidenceQuoter(
            grader.scorer,
            max_quotes=settings.max_quotes,
            threshold=refiner.threshold,
            strip_min_tokens=refiner.strip_min_tokens,
        )
        self._checker = GroundednessChecker(
            grader.scorer, use_scorer=settings.check_with_grader, strip_min_tokens=refiner.strip_min_tokens
        )
        super().__init__(callback_manager=callback_manager or response_synthesizer.callback_manager)

    #: Build the engine around what the user already has (``core/builder.py`` says how).
    from_defaults = classmethod(from_defaults)

    def variant(self, *, streaming: Optional[bool] = None, explain: Optional[bool] = None) -> CorrectiveQueryEngine:
        """This engine with another streaming or explain setting, sharing every part (retrievers, scorer, caches).

        A server answers some requests streamed and some not, some with the scorer's
        explanations and some without, from one set of loaded models.
        """
        synthesizer = self._synthesizer
        if streaming is not None and streaming != bool(getattr(synthesizer, "_streaming", False)):
            synthesizer = copy.copy(synthesizer)
            synthesizer._streaming = streaming  # type: ignore[attr-defined]
        grader, settings = self._grader, self.settings
        if explain is not None and explain != grader.explain:
            grader = RelevanceGrader(
                grader.scorer,
                upper=grader.upper,
                lower=grader.lower,
                aggregation=grader.aggregation,
                min_relevant=grader.min_relevant,
                explain=explain,
            )
            settings = settings.model_copy(update={"explain": explain})
        return type(self)(
            retriever=self._retriever,
            grader=grader,
            refiner=self._refiner,
            fallback=self._fallback,
            rewriter=self._rewriter,
            response_synthesizer=synthesizer,
            settings=settings,
            node_postprocessors=self._postprocessors,
            callback_manager=self.callback_manager,
        )

    @property
    def fallback(self) -> Optional[BaseRetriever]:
        """The retrieval of the INCORRECT branch."""
        return self._fallback

    @property
    def synthesizer(self) -> BaseSynthesizer:
        """The response synthesizer that generates answers."""
        return self._synthesizer

    @property
    def grader(self) -> RelevanceGrader:
        """The grader that routes each query."""
        return self._grader

    @property
    def refiner(self) -> StripRefiner:
        """The knowledge-strip refiner of the AMBIGUOUS branch."""
        return self._refiner

    @property
    def retriever(self) -> BaseRetriever:
        """The primary retriever."""
        return self._retriever

    def _get_prompt_modules(self) -> PromptMixinType:
        return {"response_synthesizer": self._synthesizer}

    @dispatcher.span
    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        return drive(self._loop(query_bundle, is_async=False))

    @dispatcher.span
    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        return await adrive(self._loop(query_bundle, is_async=True))

    def _loop(self, query_bundle: QueryBundle, is_async: bool) -> Loop:
        """The corrective loop for one query; yields its I/O to the sync or async driver."""
        query_bundle = _checked_query(query_bundle, self.settings.max_query_chars)
        s = self.settings
        trace = CragTrace(
            query=query_bundle.query_str,
            enabled=s.enabled,
            scorer=self._grader.scorer.name,
            upper=self._grader.upper,
            lower=self._grader.lower,
            aggregation=self._grader.aggregation,
            strip_threshold=self._refiner.threshold,
            warnings=list(self._grader.scorer.warnings),
        )
        with trace.timed("retrieve"):
            nodes = yield Io(
                lambda: self._retriever.retrieve(query_bundle), lambda: self._retriever.aretrieve(query_bundle)
            )
        if s.enabled:
            reuse_retrieval_embeddings(self._grader.scorer, self._retriever, query_bundle, nodes)
        with trace.timed("rerank"):
            nodes = yield from self._postprocess(nodes, query_bundle, None)

        context: List[NodeWithScore] = nodes
        if s.enabled:
            with trace.timed("grade"):
                grading = yield Io(
                    bind(self._grader.grade, query_bundle, nodes), bind(self._grader.agrade, query_bundle, nodes)
                )
            _record(trace, nodes, grading)
            trace.action = grading.verdict.value
            if grading.verdict is Verdict.CORRECT:
                context = _not_incorrect(nodes, grading)
            elif grading.verdict is Verdict.AMBIGUOUS:
                context = yield from self._refine(query_bundle, nodes, grading, trace)
            else:
                context = yield from self._correct(query_bundle, trace)
        if not context and not trace.abstained:
            trace.abstain("no candidate passage survived retrieval and grading")

        streaming = bool(getattr(self._synthesizer, "_streaming", False))
        trace.answer_mode = self.answer_mode if s.enabled else "generate"
        response: Optional[RESPONSE_TYPE] = None
        if not trace.abstained and trace.answer_mode == "extract":
            quoted = yield from self._quote(query_bundle, context, trace)
            if quoted.quotes:
                trace.answered_by = "extract"
                response = text_response(quoted.text, context, streaming, is_async)
            else:
                trace.abstain(
                    "no strip of the graded passages clears the strip threshold and states what the question "
                    "asks for (its kind of answer, and the figures and codes it names)"
                )
        elif not trace.abstained:
            response = yield from self._generate(query_bundle, context, trace)
            trace.answered_by = "generate"
            if s.enabled and s.check_answers and not streaming:
                response = yield from self._check(query_bundle, context, response, trace, is_async)
        if trace.abstained or response is None:
            trace.answered_by = "abstain"
            response = text_response(s.abstain_text, [], streaming, is_async)
        response.metadata = {**(response.metadata or {}), "crag": trace.to_dict()}
        if trace.answered_by == "generate" and streaming and s.enabled and s.check_answers:
            check_when_streamed(response, self._stream_check(query_bundle, context, response))
        dispatcher.event(trace.action_event())
        return response

    def _generate(
        self, query_bundle: QueryBundle, context: List[NodeWithScore], trace: CragTrace
    ) -> Generator[Io, Any, RESPONSE_TYPE]:
        """The synthesizer's answer from the corrected context (web pages quoted between source tags)."""
        synthesizer, sources = self._synthesizer, context
        if any(is_web(n) for n in context):
            context = sorted(context, key=is_web)
            synthesizer, sources = self._quoting_synthesizer(), quote_sources(context)
        with trace.timed("generate"):
            try:
                response = yield Io(
                    bind(synthesizer.synthesize, query_bundle, sources),
                    bind(synthesizer.asynthesize, query_bundle, sources),
                )
            except Exception as exc:
                llm = getattr(self._synthesizer, "_llm", None)
                raise GenerationError(
                    f"the generator {describe_llm(llm) if llm is not None else ''} failed: {type(exc).__name__}: {exc}"
                ) from exc
        response.source_nodes = list(context)
        return response

    def _quote(
        self, query_bundle: QueryBundle, context: List[NodeWithScore], trace: CragTrace
    ) -> Generator[Io, Any, QuotedAnswer]:
        """The best strips of the context, quoted with their sources (recorded in the trace)."""
        question = query_bundle.query_str
        with trace.timed("extract"):
            quoted = yield Io(bind(self._quoter.quote, question, context), bind(self._quoter.aquote, question, context))
        trace.quotes = quoted.to_list()
        return quoted

    def _check(
        self,
        query_bundle: QueryBundle,
        context: List[NodeWithScore],
        response: RESPONSE_TYPE,
        trace: CragTrace,
        is_async: bool,
    ) -> Generator[Io, Any, Optional[RESPONSE_TYPE]]:
        """Check a generated answer against its context and apply ``on_ungrounded``; None means abstain."""
        question, answer = query_bundle.query_str, str(getattr(response, "response", None) or "")
        if answer.strip() == _SYNTHESIZER_EMPTY:
            answer = ""
        evidence = _evidence(context)
        with trace.timed("check"):
            try:
                check = yield Io(
                    bind(self._checker.check, answer, evidence, question),
                    bind(self._checker.acheck, answer, evidence, question),
                )
            except Exception as exc:
                check = AnswerCheck("error", None, reason=f"the check failed: {type(exc).__name__}: {exc}")
        policy = self.settings.on_ungrounded
        outcome = outcome_of(check, policy)
        trace.grounded = check.grounded
        trace.answer_check = {**check.to_dict(), "policy": policy, "outcome": outcome}
        if outcome == "kept":
            return response
        quoted = yield from self._quote(query_bundle, context, trace)
        if outcome == "flagged":
            return response
        if outcome == "extract" and quoted.quotes:
            trace.answered_by = "extract"
            return text_response(quoted.text, context, False, is_async)
        unsupported = ", ".join(check.unsupported[:5])
        trace.abstain(
            f"the generated answer failed its check against the sources ({check.reason}"
            + (f"; unsupported: {unsupported}" if unsupported else "")
            + ")"
        )
        return None

    def _stream_check(
        self, query_bundle: QueryBundle, context: List[NodeWithScore], response: RESPONSE_TYPE
    ) -> Callable[[str, Optional[str]], None]:
        """What runs when a streamed answer ends: check the finished text and record it in the response's trace.

        A streamed answer was already sent, so ``on_ungrounded`` cannot replace it: an
        ungrounded one is flagged, with the quoted evidence beside it in the trace.
        """

        def finish(answer: str, cut: Optional[str]) -> None:
            crag = response.metadata["crag"]  # type: ignore[index]
            started = time.perf_counter()
            if cut is not None:
                check = AnswerCheck("incomplete", None, reason=f"the stream ended before the answer did: {cut}")
            else:
                try:
                    check = self._checker.check(answer, _evidence(context), query_bundle.query_str)
                except Exception as exc:
                    check = AnswerCheck("error", None, reason=f"the check failed: {type(exc).__name__}: {exc}")
            outcome = outcome_of(check, "flag")
            if outcome != "kept":
                try:
                    crag["quotes"] = self._quoter.quote(query_bundle.query_str, context).to_list()
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

    def _refine(
        self, query_bundle: QueryBundle, nodes: List[NodeWithScore], grading: Grading, trace: CragTrace
    ) -> Generator[Io, Any, List[NodeWithScore]]:
        """AMBIGUOUS: keep the relevant strips of the candidates, optionally add fallback hits."""
        candidates = _not_incorrect(nodes, grading) or nodes
        with trace.timed("refine"):
            refinement = yield Io(
                bind(self._refiner.refine, query_bundle, candidates),
                bind(self._refiner.arefine, query_bundle, candidates),
            )
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
                    with trace.timed("rewrite"):
                        rewritten = yield Io(
                            bind(rewriter.rewrite, query_bundle.query_str),
                            bind(rewriter.arewrite, query_bundle.query_str),
                            left(deadline),
                        )
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
                    with trace.timed("rewrite"):
                        search = yield from self._rewrite(search, query_bundle.query_str, trace, deadline)
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
        reason = (
            f"after {trace.rewrites} rewrite(s) the fallback's best score "
            f"{trace.retry_score or 0.0:.3f} is still below lower={self._grader.lower:.3f}"
        )
        trace.abstain(reason + _web_shortfall(trace))
        return []

    def _rewrite(self, search: str, question: str, trace: CragTrace, deadline: float) -> Generator[Io, Any, str]:
        """The LLM's rewrite of ``search``; when it fails (or there is no LLM), the question's keywords.

        A small model's JSON rewrite is often invalid, empty, unchanged or noise: the
        deterministic keyword rewrite (``keyword_query``) replaces it, so the engine never
        abstains for a broken rewrite, only for missing evidence.
        """
        if self._rewriter is not None:
            rewriter = self._rewriter
            try:
                rewritten = yield Io(bind(rewriter.rewrite, search), bind(rewriter.arewrite, search), left(deadline))
                trace.rewrite_source = "llm"
                return str(rewritten)
            except RewriteError as exc:
                trace.rewrite_error = str(exc)
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
        self, question: QueryBundle, search: QueryBundle, deadline: float, trace: CragTrace
    ) -> Generator[Io, Any, List[NodeWithScore]]:
        """Retrieve ``search`` through the fallback and keep what grades relevant to ``question``."""
        fallback = self._fallback
        assert fallback is not None
        with collect_web_reports() as reports:
            try:
                with trace.timed("fallback"):
                    hits = yield Io(bind(fallback.retrieve, search), bind(fallback.aretrieve, search), left(deadline))
            finally:
                trace.web.extend(report.to_dict() for report in reports)
        trace.fallback_sources = sorted({h.node.metadata.get(SOURCE_KEY, "fallback") for h in hits})
        with trace.timed("regrade"):
            hits = yield from self._postprocess(hits, question, deadline)
            grading = yield Io(
                bind(self._grader.grade, question, hits), bind(self._grader.agrade, question, hits), left(deadline)
            )
        _record(trace, hits, grading)
        trace.retry_score = grading.aggregate
        if grading.verdict is Verdict.INCORRECT:
            return []
        return _not_incorrect(hits, grading)

    def _quoting_synthesizer(self) -> BaseSynthesizer:
        """The synthesizer with the quoted-source templates, for contexts that hold web pages."""
        if self._quoting is None:
            quoting = copy.copy(self._synthesizer)
            prompts = quoting.get_prompts()
            templates = {"text_qa_template": QUOTED_QA_TEMPLATE, "refine_template": QUOTED_REFINE_TEMPLATE}
            quoting.update_prompts({k: v for k, v in templates.items() if k in prompts})
            self._quoting = quoting
        return self._quoting


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


def _checked_query(query_bundle: QueryBundle, max_chars: int) -> QueryBundle:
    """The query with characters no store or tokenizer takes replaced (``clean_text``), or a clear error."""
    query = clean_text(query_bundle.query_str or "")
    if not query.strip():
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


def _not_incorrect(nodes: List[NodeWithScore], grading: Grading) -> List[NodeWithScore]:
    return [
        NodeWithScore(node=n.node, score=score)
        for n, score, label in zip(nodes, grading.scores, grading.labels)
        if label is not Verdict.INCORRECT
    ]


def _record(trace: CragTrace, nodes: Sequence[NodeWithScore], grading: Grading) -> None:
    first = not trace.nodes
    explanations: List[Optional[Dict[str, Any]]] = [None] * len(nodes)
    if grading.explanations is not None:
        explanations = list(grading.explanations)
    trace.nodes.extend(
        NodeGrade(
            node_id=n.node.node_id,
            doc_id=n.node.metadata.get("doc_id") or n.node.ref_doc_id,
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


def _evidence(context: Sequence[NodeWithScore]) -> List[str]:
    """The passage texts an answer was generated from, as the generator saw them."""
    return [n.node.get_content() for n in context]
