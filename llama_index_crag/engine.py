"""CorrectiveQueryEngine: retrieve, grade, then generate, refine, fall back or abstain."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable, Dict, Generator, List, Mapping, Optional, Sequence, Tuple, Union

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks import CallbackManager
from llama_index.core.indices.base import BaseIndex
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.llms import LLM, MockLLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts.mixin import PromptMixinType
from llama_index.core.response_synthesizers import BaseSynthesizer, ResponseMode, get_response_synthesizer
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle
from llama_index.core.settings import Settings

from llama_index_crag.answers.extract import EvidenceQuoter, QuotedAnswer
from llama_index_crag.answers.grounding import AnswerCheck, GroundednessChecker
from llama_index_crag.answers.keywords import keyword_query
from llama_index_crag.answers.policy import default_answer_mode, outcome_of
from llama_index_crag.datasets import clean_text
from llama_index_crag.fallback import SOURCE_KEY, FallbackRetriever
from llama_index_crag.grader import Grading, RelevanceGrader, Verdict
from llama_index_crag.models import describe_llm
from llama_index_crag.prompts import QUOTED_QA_TEMPLATE, QUOTED_REFINE_TEMPLATE, quote_sources
from llama_index_crag.refiner import StripRefiner
from llama_index_crag.rewrite import QueryRewriter, RewriteError
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.scorers.bi_encoder import reuse_retrieval_embeddings
from llama_index_crag.scorers.evidence import EvidenceScorer
from llama_index_crag.settings import CragSettings, WebSearchSettings, read_calibration
from llama_index_crag.trace import CragTrace, NodeGrade
from llama_index_crag.web.retriever import WebSearchRetriever, collect_web_reports, is_web

logger = logging.getLogger(__name__)

#: Whether ``from_defaults()`` grades with the reader shipped in the package (behind the evidence
#: features, as a cascade) rather than with the evidence features alone. Set by measurement: the
#: reader becomes the default only where its 5-fold cross-validated figures beat the evidence
#: scorer's on SQuAD 2.0, SciFact and the held-out human pairs (docs/grading.md, "The packaged reader").
PACKAGED_READER_IS_DEFAULT = False

dispatcher = get_dispatcher(__name__)


#: What LlamaIndex's synthesizers answer when the LLM returned no text.
_SYNTHESIZER_EMPTY = "Empty Response"


class InvalidQueryError(ValueError):
    """The query cannot be answered as given (empty, or longer than ``max_query_chars``)."""


class GenerationError(RuntimeError):
    """The generator LLM failed; the message names the model and, where it has one, its server."""


class RetrievalUnavailableError(RuntimeError):
    """The retriever's backing store cannot be reached (a server answers 503); the message names the store."""


@dataclass
class _Io:
    """One piece of I/O the loop hands to a driver: how to do it sync and async, and its time limit."""

    run: Callable[[], Any]
    arun: Callable[[], Awaitable[Any]]
    timeout_s: Optional[float] = None


class CorrectiveTimeout(TimeoutError):
    """A step of the correction path ran past what was left of its time budget."""


_Loop = Generator[_Io, Any, Any]
_Outcome = Tuple[Any, Optional[BaseException]]


@dataclass
class _Done:
    """The loop has finished with this response."""

    response: RESPONSE_TYPE


def _advance(loop: _Loop, outcome: _Outcome) -> Union[_Io, _Done]:
    """Hand the last step's result (or its error) back to the loop and get its next step."""
    value, error = outcome
    try:
        return loop.throw(error) if error is not None else loop.send(value)
    except StopIteration as done:
        return _Done(done.value)


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

    @classmethod
    def from_defaults(
        cls,
        index: Optional[BaseIndex] = None,
        retriever: Optional[BaseRetriever] = None,
        nodes: Optional[Sequence[BaseNode]] = None,
        llm: Optional[LLM] = None,
        scorer: Optional[RelevanceScorer] = None,
        embed_model: Optional[BaseEmbedding] = None,
        node_postprocessors: Optional[Sequence[BaseNodePostprocessor]] = None,
        response_synthesizer: Optional[BaseSynthesizer] = None,
        response_mode: ResponseMode = ResponseMode.COMPACT,
        streaming: bool = False,
        fallback: Optional[BaseRetriever] = None,
        fallback_sources: Sequence[str] = ("bm25", "sentence_window"),
        web: Union[None, bool, Mapping[str, Any], WebSearchSettings] = None,
        calibration_path: Optional[str] = None,
        callback_manager: Optional[CallbackManager] = None,
        vector_store: Optional[Any] = None,
        **settings: Any,
    ) -> CorrectiveQueryEngine:
        """Build the engine around what the user already has.

        Give a ``vector_store`` (a ``PGVectorStore`` or ``postgresql://`` URL filled by
        ``llama-crag ingest --store``: retrieval, fallback and word statistics then stay in
        PostgreSQL, see ``docs/postgres.md``), an ``index``, a ``retriever`` or ``nodes`` (an in-memory vector index is
        built over them). The fallback retriever is built over the same nodes (taken
        from ``nodes`` or the index's docstore); with no nodes at hand (a remote vector
        store), the rewritten query goes back through the primary retriever.

        ``scorer`` defaults to the offline ``EvidenceScorer`` (bundled MiniLM plus lexical
        and answer-type evidence, IDF from the same nodes), or to a ``ReaderScorer`` over
        the grader directory in ``CRAG_GRADER`` (``llama-crag train-grader``). Any keyword
        of ``CragSettings`` (``upper``, ``lower``, ``max_rewrites``, ``enabled`` ...)
        may be passed; it wins over ``CRAG_*`` variables and the calibration file.

        ``web`` turns on the web-search source of the fallback (off by default): ``True``,
        a dict of ``WebSearchSettings`` fields, or the settings themselves; ``CRAG_WEB=on``
        and ``CRAG_WEB_*`` variables do the same, and ``CRAG_WEB_FORBIDDEN=true`` forbids
        sending anything whatever the code says.
        """
        if vector_store is not None:  # a PostgreSQL store: the whole loop runs against it (llama_index_crag.postgres)
            from llama_index_crag.postgres import engine_from_store

            return engine_from_store(
                vector_store,
                llm=llm or _settings_llm(),
                embed_model=embed_model,
                scorer=scorer,
                node_postprocessors=node_postprocessors,
                response_synthesizer=response_synthesizer,
                calibration_path=calibration_path,
                callback_manager=callback_manager,
                **settings,
            )
        llm = llm or _settings_llm()
        unknown = set(settings) - set(CragSettings.model_fields)
        if unknown:
            raise TypeError(f"unknown settings {sorted(unknown)}; see CragSettings for the names")
        if nodes is None and index is not None:
            nodes = list(index.docstore.docs.values())
        if scorer is None:
            corpus = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes or []]
            scorer = default_scorer(embed_model, corpus or None)
        calibration_path = calibration_path or os.environ.get("CRAG_CALIBRATION")
        load_state = getattr(scorer, "load_state", None)
        if calibration_path and load_state is not None:
            state = read_calibration(calibration_path, scorer.name).get("scorer_state")
            if state is not None:
                load_state(state)
        resolved = CragSettings.resolve(
            settings,
            calibration_path=calibration_path,
            scorer_name=scorer.name,
            scorer_defaults=getattr(scorer, "default_thresholds", None),
        )
        if index is None and retriever is None:
            if nodes is None:
                raise ValueError("give the engine something to search: index=, retriever= or nodes=")
            from llama_index.core import VectorStoreIndex

            from llama_index_crag.models import default_embed_model

            index = VectorStoreIndex(list(nodes), embed_model=embed_model or default_embed_model())
        if retriever is None:
            assert index is not None
            retriever = index.as_retriever(similarity_top_k=resolved.similarity_top_k)
        web_settings = WebSearchSettings.resolve(web)
        if fallback is None:
            if nodes and any(n.get_content().strip() for n in nodes):
                fallback = FallbackRetriever.from_nodes(
                    nodes, sources=fallback_sources, similarity_top_k=resolved.similarity_top_k, embed_model=embed_model
                )
            else:
                fallback = FallbackRetriever({"primary": retriever}, similarity_top_k=resolved.similarity_top_k)
        if web_settings.enabled:
            fallback = FallbackRetriever.with_web(
                fallback,
                WebSearchRetriever(web_settings, scorer=scorer, strip_min_tokens=resolved.strip_min_tokens),
                similarity_top_k=resolved.similarity_top_k,
            )
        synthesizer = response_synthesizer or get_response_synthesizer(
            llm=llm or MockLLM(), response_mode=response_mode, streaming=streaming, callback_manager=callback_manager
        )
        return cls(
            retriever=retriever,
            grader=RelevanceGrader(
                scorer,
                upper=resolved.upper,
                lower=resolved.lower,
                aggregation=resolved.aggregation,
                min_relevant=resolved.min_relevant,
                explain=resolved.explain,
            ),
            refiner=StripRefiner(
                scorer,
                threshold=resolved.lower if resolved.strip_threshold is None else resolved.strip_threshold,
                strip_min_tokens=resolved.strip_min_tokens,
            ),
            fallback=fallback,
            rewriter=QueryRewriter(llm) if llm is not None else None,
            response_synthesizer=synthesizer,
            settings=resolved,
            node_postprocessors=node_postprocessors,
            callback_manager=callback_manager,
        )

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
        loop = self._loop(query_bundle, is_async=False)
        outcome: _Outcome = (None, None)
        while not isinstance(step := _advance(loop, outcome), _Done):
            try:
                outcome = (_run_with_timeout(step.run, step.timeout_s), None)
            except Exception as exc:
                outcome = (None, exc)
        return step.response

    @dispatcher.span
    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        loop = self._loop(query_bundle, is_async=True)
        outcome: _Outcome = (None, None)
        while not isinstance(step := _advance(loop, outcome), _Done):
            try:
                limit = None if step.timeout_s is None else max(step.timeout_s, 0.0)
                outcome = (await asyncio.wait_for(step.arun(), limit), None)
            except asyncio.TimeoutError:
                outcome = (None, CorrectiveTimeout())
            except Exception as exc:
                outcome = (None, exc)
        return step.response

    def _loop(self, query_bundle: QueryBundle, is_async: bool) -> _Loop:
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
            nodes = yield _Io(
                lambda: self._retriever.retrieve(query_bundle), lambda: self._retriever.aretrieve(query_bundle)
            )
        if s.enabled:
            reuse_retrieval_embeddings(self._grader.scorer, self._retriever, query_bundle, nodes)
        with trace.timed("rerank"):
            nodes = yield from self._postprocess(nodes, query_bundle, None)

        context: List[NodeWithScore] = nodes
        if s.enabled:
            with trace.timed("grade"):
                grading = yield _Io(
                    _bind(self._grader.grade, query_bundle, nodes), _bind(self._grader.agrade, query_bundle, nodes)
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
                response = _text_response(quoted.text, context, streaming, is_async)
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
            response = _text_response(s.abstain_text, [], streaming, is_async)
        response.metadata = {**(response.metadata or {}), "crag": trace.to_dict()}
        if trace.answered_by == "generate" and streaming and s.enabled and s.check_answers:
            _check_when_streamed(response, self._stream_check(query_bundle, context, response))
        dispatcher.event(trace.publish())
        return response

    def _generate(
        self, query_bundle: QueryBundle, context: List[NodeWithScore], trace: CragTrace
    ) -> Generator[_Io, Any, RESPONSE_TYPE]:
        """The synthesizer's answer from the corrected context (web pages quoted between source tags)."""
        synthesizer, sources = self._synthesizer, context
        if any(is_web(n) for n in context):
            context = sorted(context, key=is_web)
            synthesizer, sources = self._quoting_synthesizer(), quote_sources(context)
        with trace.timed("generate"):
            try:
                response = yield _Io(
                    _bind(synthesizer.synthesize, query_bundle, sources),
                    _bind(synthesizer.asynthesize, query_bundle, sources),
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
    ) -> Generator[_Io, Any, QuotedAnswer]:
        """The best strips of the context, quoted with their sources (recorded in the trace)."""
        question = query_bundle.query_str
        with trace.timed("extract"):
            quoted = yield _Io(
                _bind(self._quoter.quote, question, context), _bind(self._quoter.aquote, question, context)
            )
        trace.quotes = quoted.to_list()
        return quoted

    def _check(
        self,
        query_bundle: QueryBundle,
        context: List[NodeWithScore],
        response: RESPONSE_TYPE,
        trace: CragTrace,
        is_async: bool,
    ) -> Generator[_Io, Any, Optional[RESPONSE_TYPE]]:
        """Check a generated answer against its context and apply ``on_ungrounded``; None means abstain."""
        question, answer = query_bundle.query_str, str(getattr(response, "response", None) or "")
        if answer.strip() == _SYNTHESIZER_EMPTY:
            answer = ""
        evidence = _evidence(context)
        with trace.timed("check"):
            try:
                check = yield _Io(
                    _bind(self._checker.check, answer, evidence, question),
                    _bind(self._checker.acheck, answer, evidence, question),
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
            return _text_response(quoted.text, context, False, is_async)
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
    ) -> Generator[_Io, Any, List[NodeWithScore]]:
        """AMBIGUOUS: keep the relevant strips of the candidates, optionally add fallback hits."""
        candidates = _not_incorrect(nodes, grading) or nodes
        with trace.timed("refine"):
            refinement = yield _Io(
                _bind(self._refiner.refine, query_bundle, candidates),
                _bind(self._refiner.arefine, query_bundle, candidates),
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
                        rewritten = yield _Io(
                            _bind(rewriter.rewrite, query_bundle.query_str),
                            _bind(rewriter.arewrite, query_bundle.query_str),
                            _left(deadline),
                        )
                    trace.rewrites, trace.rewritten_query, search = 1, rewritten, QueryBundle(rewritten)
                context += yield from self._fallback_hits(query_bundle, search, deadline, trace)
            except Exception as exc:
                trace.fallback_error = f"{type(exc).__name__}: {exc}"
        return context

    def _correct(self, query_bundle: QueryBundle, trace: CragTrace) -> Generator[_Io, Any, List[NodeWithScore]]:
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

    def _rewrite(self, search: str, question: str, trace: CragTrace, deadline: float) -> Generator[_Io, Any, str]:
        """The LLM's rewrite of ``search``; when it fails (or there is no LLM), the question's keywords.

        A small model's JSON rewrite is often invalid, empty, unchanged or noise: the
        deterministic keyword rewrite (``keyword_query``) replaces it, so the engine never
        abstains for a broken rewrite, only for missing evidence.
        """
        if self._rewriter is not None:
            rewriter = self._rewriter
            try:
                rewritten = yield _Io(
                    _bind(rewriter.rewrite, search), _bind(rewriter.arewrite, search), _left(deadline)
                )
                trace.rewrite_source = "llm"
                return str(rewritten)
            except RewriteError as exc:
                trace.rewrite_error = str(exc)
        trace.rewrite_source = "keyword"
        return keyword_query(question)

    def _postprocess(
        self, nodes: List[NodeWithScore], query_bundle: QueryBundle, deadline: Optional[float]
    ) -> Generator[_Io, Any, List[NodeWithScore]]:
        """Run the pipeline's own postprocessors (e.g. the reranker whose scores grading reuses)."""
        for postprocessor in self._postprocessors:
            nodes = yield _Io(
                _bind(postprocessor.postprocess_nodes, nodes, query_bundle),
                _bind(postprocessor.apostprocess_nodes, nodes, query_bundle),
                None if deadline is None else _left(deadline),
            )
        return nodes

    def _fallback_hits(
        self, question: QueryBundle, search: QueryBundle, deadline: float, trace: CragTrace
    ) -> Generator[_Io, Any, List[NodeWithScore]]:
        """Retrieve ``search`` through the fallback and keep what grades relevant to ``question``."""
        fallback = self._fallback
        assert fallback is not None
        with collect_web_reports() as reports:
            try:
                with trace.timed("fallback"):
                    hits = yield _Io(
                        _bind(fallback.retrieve, search), _bind(fallback.aretrieve, search), _left(deadline)
                    )
            finally:
                trace.web.extend(report.to_dict() for report in reports)
        trace.fallback_sources = sorted({h.node.metadata.get(SOURCE_KEY, "fallback") for h in hits})
        with trace.timed("regrade"):
            hits = yield from self._postprocess(hits, question, deadline)
            grading = yield _Io(
                _bind(self._grader.grade, question, hits), _bind(self._grader.agrade, question, hits), _left(deadline)
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


def default_scorer(
    embed_model: Optional[BaseEmbedding] = None,
    corpus: Optional[Sequence[str]] = None,
    grader: Optional[str] = None,
) -> EvidenceScorer:
    """The offline default scorer, IDF from ``corpus`` when given.

    ``grader`` (or ``CRAG_GRADER``) chooses: a grader directory gives a ``ReaderScorer`` over
    it (a directory that cannot be loaded is an error: it was asked for by name);
    ``"evidence"`` gives the ``EvidenceScorer``; ``"packaged"`` the reader shipped in the
    package. Unset, the packaged reader is used when ``PACKAGED_READER_IS_DEFAULT`` (its
    cross-validated figures beat the evidence scorer's, see docs/grading.md), else the
    evidence scorer. A packaged reader that cannot be loaded (a damaged install) never
    stops the engine: the evidence scorer grades instead and says so in ``warnings``,
    which every trace of the engine carries.
    """
    grader = grader or os.environ.get("CRAG_GRADER") or ("packaged" if PACKAGED_READER_IS_DEFAULT else "evidence")
    if grader == "evidence":
        return EvidenceScorer(embed_model, corpus=corpus)
    from llama_index_crag.scorers.reader import GraderLoadError, ReaderScorer, packaged_grader_path

    if grader != "packaged":
        return ReaderScorer(grader, embed_model, corpus=corpus)
    try:
        return ReaderScorer(packaged_grader_path(), embed_model, corpus=corpus)
    except (GraderLoadError, ImportError, OSError) as exc:
        warning = f"the packaged reader could not be loaded, grading with the evidence features instead: {exc}"
        logger.warning(warning)
        scorer = EvidenceScorer(embed_model, corpus=corpus)
        scorer.warnings = (warning,)
        return scorer


def _settings_llm() -> Optional[LLM]:
    """LlamaIndex's ``Settings.llm`` when one is set; None otherwise (the engine then quotes, never generates)."""
    return getattr(Settings, "_llm", None)


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


def _bind(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)


def _left(deadline: float) -> float:
    return deadline - time.monotonic()


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


def _text_response(text: str, sources: Sequence[NodeWithScore], streaming: bool, is_async: bool) -> RESPONSE_TYPE:
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


def _check_when_streamed(response: RESPONSE_TYPE, finish: Callable[[str, Optional[str]], None]) -> None:
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


def _run_with_timeout(fn: Callable[[], Any], timeout_s: Optional[float]) -> Any:
    """Run ``fn``; with a limit, in a daemon thread that is abandoned when the limit passes."""
    if timeout_s is None:
        return fn()
    if timeout_s <= 0:
        raise CorrectiveTimeout()
    outcome: Dict[str, Any] = {}
    finished = threading.Event()
    context = contextvars.copy_context()

    def target() -> None:
        try:
            outcome["value"] = context.run(fn)
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
