"""CorrectiveQueryEngine: the corrective retriever's evidence, answered by quoting or generating, or an abstention."""

from __future__ import annotations

import copy
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any, List, Mapping, Optional, Sequence, Tuple, Union

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.callbacks import CallbackManager
from llama_index.core.indices.base import BaseIndex
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.llms import LLM, MockLLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts.mixin import PromptMixin, PromptMixinType
from llama_index.core.response_synthesizers import BaseSynthesizer, ResponseMode, get_response_synthesizer
from llama_index.core.schema import BaseNode, NodeWithScore, QueryBundle

from llama_index_crag.answers.extract import AnswerModel, EvidenceQuoter
from llama_index_crag.answers.grounding import GroundednessChecker
from llama_index_crag.answers.policy import default_answer_mode
from llama_index_crag.core.builder import settings_llm
from llama_index_crag.core.grader import RelevanceGrader
from llama_index_crag.core.loop import Answering, Loop, adrive, drive
from llama_index_crag.core.prompts import QuotingPrompts
from llama_index_crag.core.refiner import StripRefiner
from llama_index_crag.core.retriever import CorrectiveRetriever
from llama_index_crag.core.settings import CragSettings
from llama_index_crag.errors import ConfigError
from llama_index_crag.scope import Scope, ScopeCache, ScopeLike
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.web.settings import WebSearchSettings

if TYPE_CHECKING:
    from llama_index_crag.core.chat import CorrectiveChatEngine

logger = logging.getLogger(__name__)


dispatcher = get_dispatcher(__name__)
#: The chat modes ``as_chat_engine`` answers (all through the loop).
CHAT_MODES = ("condense_question", "condense_plus_context", "context", "best")


class CorrectiveQueryEngine(BaseQueryEngine):
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
    The decision trace is in ``response.metadata["crag"]``. The loop itself is
    ``core/loop.py``'s, run over this engine's parts (``loop``); the sync and async paths
    run the same loop, only the driver that performs its I/O differs.
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
        self._quoting: Optional[Tuple[Tuple[int, ...], BaseSynthesizer]] = None
        self._quoting_prompts = QuotingPrompts()
        self._scoped = ScopeCache()
        super().__init__(callback_manager=callback_manager or response_synthesizer.callback_manager)
        self._answer_parts()

    def _answer_parts(self) -> None:
        """The answer step's parts and the loop over all the parts, built from the retriever's settings and parts
        (again when the settings change)."""
        settings, grader, refiner = self._retriever.settings, self._retriever.grader, self._retriever.refiner
        #: "extract" or "generate": the setting, or when unset, what the generator allows (``default_answer_mode``).
        self.answer_mode = settings.answer_mode or default_answer_mode(getattr(self._synthesizer, "_llm", None))
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
        self._loop = self._built_loop()

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
        if streaming is not None:
            synthesizer = self._answering().streamed(streaming).synthesizer
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
            other._loop = other._built_loop()  # over the narrowed retriever's parts
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
        # The grader, refiner, quoter and checker are built again from the new settings (a variant sharing the
        # old retriever keeps its own).
        self._retriever = self._retriever.variant(settings=settings)
        self._answer_parts()
        self._scoped = ScopeCache()

    @property  # type: ignore[override]
    def callback_manager(self) -> CallbackManager:
        """Receives the query's, the retrieval's and the answer's callback events."""
        return self._callback_manager

    @callback_manager.setter
    def callback_manager(self, callback_manager: CallbackManager) -> None:
        self._callback_manager = callback_manager
        loop: Optional[Loop] = getattr(self, "_loop", None)  # None while BaseQueryEngine.__init__ sets the first
        if loop is not None and loop.answering is not None:  # the loop built with the parts sends them here now
            self._loop = replace(loop, answering=replace(loop.answering, callback_manager=callback_manager))

    @property
    def loop(self) -> Loop:
        """The corrective loop over this engine's parts (``core/loop.py``): the retriever's, and the answer step.

        Built with the parts (again when ``settings`` or the scope changes), so a query runs it at once.
        """
        return self._loop

    def _built_loop(self) -> Loop:
        """The loop over the retriever's parts and this engine's answer step."""
        return replace(self._retriever.loop, answering=self._answering())

    def _answering(self) -> Answering:
        return Answering(
            mode=self.answer_mode,
            synthesizer=self._synthesizer,
            quoter=self._quoter,
            checker=self._checker,
            callback_manager=self.callback_manager,
            quoting=self._quoting_synthesizer,
        )

    @property
    def quoter(self) -> EvidenceQuoter:
        """What quotes the evidence (``answer_mode="extract"``, and beside an answer that fails its check)."""
        return self._quoter

    @property
    def checker(self) -> GroundednessChecker:
        """The check of a generated answer against its evidence."""
        return self._checker

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
        return drive(self._loop.run(query_bundle, is_async=False))

    @dispatcher.span
    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        return await adrive(self._loop.run(query_bundle, is_async=True))

    def _quoting_synthesizer(self) -> BaseSynthesizer:
        """The synthesizer with the quoted-source templates, for contexts that hold web pages."""
        templates = self._quoting_prompts.get_prompts()
        key = tuple(id(v) for v in templates.values())
        if self._quoting is None or self._quoting[0] != key:  # built again after update_prompts
            quoting = copy.copy(self._synthesizer)
            prompts = quoting.get_prompts()
            quoting.update_prompts({k: v for k, v in templates.items() if k in prompts})
            self._quoting = (key, quoting)
        return self._quoting[1]
