"""CorrectiveQueryEngine: the corrective retriever's evidence, answered by quoting or generating, or an abstention."""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any, List, Mapping, Optional, Sequence, Union

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.callbacks import CallbackManager, CBEventType, EventPayload
from llama_index.core.indices.base import BaseIndex
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.llms import LLM, MockLLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts.mixin import PromptMixin, PromptMixinType
from llama_index.core.response_synthesizers import BaseSynthesizer, ResponseMode, get_response_synthesizer
from llama_index.core.schema import BaseNode, NodeWithScore, QueryBundle

from llama_index_crag.answers.answer_model import AnswerModel
from llama_index_crag.answers.extract import EvidenceQuoter
from llama_index_crag.answers.grounding import GroundednessChecker
from llama_index_crag.answers.policy import default_answer_mode
from llama_index_crag.core.answering import AnswerSteps, QuotingPrompts, evidence_grade
from llama_index_crag.core.builder import settings_llm
from llama_index_crag.core.compound import combined
from llama_index_crag.core.driver import Steps, adrive, check_when_streamed, drive, text_response
from llama_index_crag.core.grader import RelevanceGrader
from llama_index_crag.core.refiner import StripRefiner
from llama_index_crag.core.retriever import CorrectiveRetriever
from llama_index_crag.core.settings import CragSettings
from llama_index_crag.core.trace import CragTrace, step_span
from llama_index_crag.errors import ConfigError
from llama_index_crag.scope import Scope, ScopeCache, ScopeLike
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.text.compound import split_question
from llama_index_crag.web.settings import WebSearchSettings

if TYPE_CHECKING:
    from llama_index_crag.core.chat import CorrectiveChatEngine

logger = logging.getLogger(__name__)


dispatcher = get_dispatcher(__name__)
#: The chat modes ``as_chat_engine`` answers (all through the loop).
CHAT_MODES = ("condense_question", "condense_plus_context", "context", "best")


class CorrectiveQueryEngine(AnswerSteps, BaseQueryEngine):
    """A query engine that grades retrieval before answering, and corrects or abstains.

    Its ``CorrectiveRetriever`` runs the loop up to the answer (see ``docs/loop.md``):
    retrieve; grade every candidate; then

    * CORRECT: keep the candidates not graded incorrect (no added model call);
    * AMBIGUOUS: refine the candidates into their relevant knowledge strips, and
      optionally add graded fallback results (``hybrid``);
    * INCORRECT: rewrite the query (at most ``max_rewrites`` times), retrieve through
      the ``FallbackRetriever``, grade again against the user's question, and use the
      result if it clears ``lower``, else abstain.

    The engine then answers from that evidence: it quotes it (``answer_mode="extract"``)
    or generates with the stock synthesizer and checks the answer against it.

    With the opt-in web source (``web=``, see ``docs/web.md``) the generator's prompt
    quotes every source between ``<source>`` tags with its origin and URL, tells it
    that sources are data and not instructions, and that internal documents win
    over web pages.

    Every failure of the correction path ends in an abstention, never in an answer.
    The decision trace is in ``response.metadata["crag"]``. The sync and async paths
    run the same loop (``_loop``); only the driver that performs its I/O differs.
    ``engine.retrieve`` and ``engine.aretrieve`` return what the corrective retriever does.

    Args:
        retriever: The corrective retriever whose evidence is answered.
        response_synthesizer: The stock synthesizer that generates the answer.
        callback_manager: Receives the ``query`` and ``retrieve`` callback events (by default the synthesizer's).
    """

    def __init__(
        self,
        retriever: CorrectiveRetriever,
        response_synthesizer: BaseSynthesizer,
        callback_manager: Optional[CallbackManager] = None,
    ) -> None:
        self._retriever = retriever
        self._synthesizer = response_synthesizer
        self._quoting = None
        self._quoting_prompts = QuotingPrompts()
        settings, grader, refiner = retriever.settings, retriever.grader, retriever.refiner
        #: "extract" or "generate": the setting, or when unset, what the generator allows (``default_answer_mode``).
        self.answer_mode = settings.answer_mode or default_answer_mode(getattr(response_synthesizer, "_llm", None))
        self._quoter = EvidenceQuoter(
            grader.scorer,
            max_quotes=settings.max_quotes,
            strip_min_tokens=refiner.strip_min_tokens,
            answer_threshold=settings.quote_threshold,
            model=AnswerModel.load(settings.answer_model) if settings.answer_model else None,
            preset=settings.quote_preset,
        )
        self._checker = GroundednessChecker(
            grader.scorer, use_scorer=settings.check_with_grader, strip_min_tokens=refiner.strip_min_tokens
        )
        self._scoped = ScopeCache()
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
        filters: ScopeLike = None,
        **settings: Any,
    ) -> CorrectiveQueryEngine:
        """Build the engine around what the user already has: its ``CorrectiveRetriever`` and its answer step.

        ``filters`` bound what every path of the loop may read (``docs/scope.md``); ``scoped``
        narrows a built engine further, per caller.

        Every argument but ``response_synthesizer``, ``response_mode`` and ``streaming`` (the
        answer step's) builds the corrective retriever, as ``CorrectiveRetriever.from_defaults`` says.
        """
        llm = llm or settings_llm()
        corrective = CorrectiveRetriever.from_defaults(
            index=index,
            retriever=retriever,
            nodes=nodes,
            llm=llm,
            scorer=scorer,
            embed_model=embed_model,
            node_postprocessors=node_postprocessors,
            fallback=fallback,
            fallback_sources=fallback_sources,
            web=web,
            calibration_path=calibration_path,
            callback_manager=callback_manager,
            vector_store=vector_store,
            filters=filters,
            **settings,
        )
        if not corrective.settings.enabled and llm is None and response_synthesizer is None:
            # Quoting is CRAG's answer step; with CRAG off there is nothing to answer with but a generator, and
            # LlamaIndex's stand-in (MockLLM) would hand back its prompt as the answer.
            raise ConfigError(
                "CRAG off (enabled=False or CRAG_ENABLED=false) is plain retrieve-then-generate and needs a "
                "generator: pass llm= or set Settings.llm (llama-crag: serve --llm llamacpp, demo --generate); "
                "without one, keep CRAG on and the engine answers by quoting"
            )
        synthesizer = response_synthesizer or get_response_synthesizer(
            llm=llm or MockLLM(), response_mode=response_mode, streaming=streaming, callback_manager=callback_manager
        )
        return cls(corrective, synthesizer, callback_manager=callback_manager)

    def variant(self, *, streaming: Optional[bool] = None, explain: Optional[bool] = None) -> CorrectiveQueryEngine:
        """This engine with another streaming or explain setting, sharing every part (retrievers, scorer, caches).

        A server answers some requests streamed and some not, some with the scorer's
        explanations and some without, from one set of loaded models.
        """
        synthesizer = self._synthesizer
        if streaming is not None and streaming != bool(getattr(synthesizer, "_streaming", False)):
            synthesizer = copy.copy(synthesizer)
            synthesizer._streaming = streaming  # type: ignore[attr-defined]
        return type(self)(self._retriever.variant(explain=explain), synthesizer, self.callback_manager)

    @property
    def scope(self) -> Scope:
        """What this engine's caller may read (``Scope``; unbounded when no filters were given)."""
        return self._retriever.scope

    def scoped(self, filters: ScopeLike) -> CorrectiveQueryEngine:
        """This engine narrowed to ``filters`` as well, for one caller (a server's key, a request's filters).

        The engine returned shares every model, index, cache and answer step with this one; it
        can only narrow the scope, never widen it, and is built once per scope, so that serving
        many callers costs a lookup. Safe to use from concurrent tasks: nothing is mutated. Raises
        ``ScopeError`` for malformed filters, or where a retriever cannot be narrowed.
        """
        retriever = self._retriever.scoped(filters)
        if retriever is self._retriever:
            return self

        def build() -> CorrectiveQueryEngine:
            other = copy.copy(self)
            other._retriever = retriever
            return other

        return self._scoped.get(retriever.scope, build)  # type: ignore[no-any-return]

    @property
    def generator(self) -> Optional[LLM]:
        """The LLM that generates answers, None when the engine has none (it quotes)."""
        llm = getattr(self._synthesizer, "_llm", None)
        return None if llm is None or isinstance(llm, MockLLM) else llm

    def as_chat_engine(
        self, chat_mode: str = "condense_question", llm: Optional[LLM] = None, **kwargs: Any
    ) -> CorrectiveChatEngine:
        """A chat engine whose every turn is condensed with its history and answered by this engine's loop.

        Every chat mode that answers from documents (``condense_question``, ``condense_plus_context``,
        ``context``, ``best``) gives the same ``CorrectiveChatEngine``: a stock context chat
        engine hands the retrieved passages to the LLM and answers outside the loop, so nothing
        would check its answer. ``llm`` condenses the turns (default: this engine's generator;
        without one, the offline rule of ``core/chat.py``); other keywords (``memory``,
        ``chat_history``, ``verbose``) go to ``CorrectiveChatEngine.from_engine``.
        """
        from llama_index_crag.core.chat import CorrectiveChatEngine

        if str(getattr(chat_mode, "value", chat_mode)) not in CHAT_MODES:
            raise ConfigError(
                f"chat_mode={chat_mode!r}: a corrective chat answers through the loop ({', '.join(CHAT_MODES)}); "
                "for an agent, wrap the engine in a QueryEngineTool"
            )
        return CorrectiveChatEngine.from_engine(self, llm=llm, **kwargs)

    @property
    def settings(self) -> CragSettings:
        """The resolved settings, the corrective retriever's."""
        return self._retriever.settings

    @settings.setter
    def settings(self, settings: CragSettings) -> None:
        self._retriever = self._retriever.variant(settings=settings)  # a variant sharing the retriever keeps its own

    @property
    def retriever(self) -> CorrectiveRetriever:
        """The corrective retriever; its ``retriever`` is the primary one."""
        return self._retriever

    @property
    def fallback(self) -> Optional[BaseRetriever]:
        """The retrieval of the INCORRECT branch."""
        return self._retriever.fallback

    @property
    def synthesizer(self) -> BaseSynthesizer:
        """The response synthesizer that generates answers."""
        return self._synthesizer

    @property
    def grader(self) -> RelevanceGrader:
        """The grader that routes each query."""
        return self._retriever.grader

    @property
    def refiner(self) -> StripRefiner:
        """The knowledge-strip refiner of the AMBIGUOUS branch."""
        return self._retriever.refiner

    def _get_prompt_modules(self) -> PromptMixinType:
        """The synthesizer's templates, the quoting templates for web sources, the rewrite prompt, and the
        scorer's prompts where it has any (the LLM judge's)."""
        modules: PromptMixinType = {"response_synthesizer": self._synthesizer, "quoting": self._quoting_prompts}
        if self._retriever.rewriter is not None:
            modules["rewrite"] = self._retriever.rewriter
        if isinstance(self._retriever.grader.scorer, PromptMixin):
            modules["scorer"] = self._retriever.grader.scorer
        return modules

    def retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        """The corrective retriever's nodes for ``query_bundle``: the kept evidence, or the abstention statement."""
        return self._retriever.retrieve(query_bundle)

    async def aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        """Async ``retrieve``."""
        return await self._retriever.aretrieve(query_bundle)

    @dispatcher.span
    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        return drive(self._loop(query_bundle, is_async=False))

    @dispatcher.span
    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        return await adrive(self._loop(query_bundle, is_async=True))

    def _loop(self, query_bundle: QueryBundle, is_async: bool) -> Steps[RESPONSE_TYPE]:
        """The corrective loop for one query; a question that asks several things, part by part (each part's
        loop in its own span, ``core/compound.py``). A single question costs one regular-expression pass more."""
        s = self.settings
        split = split_question(query_bundle.query_str, s.max_parts) if s.enabled and s.split_compound else None
        if split is None or not split.compound:
            return (yield from self._one(query_bundle, is_async))
        streaming = bool(getattr(self._synthesizer, "_streaming", False))
        # Each part is answered whole (its check run), then the parts are put together and streamed in one piece.
        engine = self.variant(streaming=False) if streaming else self
        responses = []
        for number, part in enumerate(split.parts, start=1):
            with step_span("part", part=number, parts=len(split.parts)) as span:
                response = yield from engine._one(QueryBundle(part), is_async)
                crag = (response.metadata or {}).get("crag") or {}
                span.outcome = "abstained" if crag.get("abstained") else str(crag.get("action"))
            responses.append(response)
        return combined(split, responses, s.abstain_text, streaming, is_async)

    def _one(self, query_bundle: QueryBundle, is_async: bool) -> Steps[RESPONSE_TYPE]:
        """The corrective loop for one question: the retriever's steps, then the answer step's."""
        with self.callback_manager.event(
            CBEventType.QUERY, payload={EventPayload.QUERY_STR: query_bundle.query_str}
        ) as query_event:
            with self.callback_manager.event(
                CBEventType.RETRIEVE, payload={EventPayload.QUERY_STR: query_bundle.query_str}
            ) as retrieve_event:
                correction = yield from self._retriever.steps(query_bundle)
                retrieve_event.on_end(payload={EventPayload.NODES: correction.nodes})
            response = yield from self._answer(correction.query_bundle, correction.nodes, correction.trace, is_async)
            query_event.on_end(payload={EventPayload.RESPONSE: response})
        return response

    def _answer(
        self, query_bundle: QueryBundle, context: List[NodeWithScore], trace: CragTrace, is_async: bool
    ) -> Steps[RESPONSE_TYPE]:
        """The answer step: quote the evidence, or generate from it and check the answer; or abstain."""
        s = self.settings
        streaming = bool(getattr(self._synthesizer, "_streaming", False))
        trace.answer_mode = self.answer_mode if s.enabled else "generate"
        response: Optional[RESPONSE_TYPE] = None
        if not trace.abstained and trace.answer_mode == "extract":
            with self.callback_manager.event(
                CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: query_bundle.query_str}
            ) as synthesize_event:
                quoted = yield from self._quote(query_bundle, context, trace)
                if quoted.quotes:
                    trace.answered_by = "extract"
                    response = text_response(quoted.text, context, streaming, is_async)
                elif quoted.withheld:
                    trace.abstain(
                        f"no strip of the graded passages answers the question: the answer model gives the best one "
                        f"{quoted.grade:.3f}, under the quote threshold {quoted.threshold:.3f}{_graded_at(trace)}"
                    )
                else:
                    trace.abstain("the graded passages hold no strip that may be quoted")
                synthesize_event.on_end(payload={EventPayload.RESPONSE: response})
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
        if not trace.abstained and trace.broadened:
            _say_broadened(response, trace.broadened)
        dispatcher.event(trace.action_event())
        return response


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


def _graded_at(trace: CragTrace) -> str:
    """What the quote threshold was set by, for an abstention's reason: the grade of the evidence."""
    grade = evidence_grade(trace.action, trace.top_score, trace.retry_score)
    return "" if grade is None else f" for evidence graded {grade:.3f}"
