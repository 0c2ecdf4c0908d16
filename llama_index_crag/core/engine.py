"""CorrectiveQueryEngine: retrieve, grade, then generate, refine, fall back or abstain."""

from __future__ import annotations

import copy
import logging
from typing import List, Optional, Sequence

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
)
from llama_index.core.callbacks import CallbackManager
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts.mixin import PromptMixin, PromptMixinType
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, QueryBundle

from llama_index_crag.answers.extract import EvidenceQuoter
from llama_index_crag.answers.grounding import GroundednessChecker
from llama_index_crag.answers.policy import default_answer_mode
from llama_index_crag.core.answering import AnswerSteps, QuotingPrompts
from llama_index_crag.core.builder import from_defaults
from llama_index_crag.core.correction import CorrectionSteps, not_incorrect, record
from llama_index_crag.core.driver import (
    Io,
    Loop,
    adrive,
    bind,
    check_when_streamed,
    drive,
    text_response,
)
from llama_index_crag.core.grader import RelevanceGrader, Verdict
from llama_index_crag.core.refiner import StripRefiner
from llama_index_crag.core.rewrite import QueryRewriter
from llama_index_crag.core.settings import CragSettings
from llama_index_crag.core.trace import CragTrace
from llama_index_crag.errors import InvalidQueryError
from llama_index_crag.scorers.bi_encoder import reuse_retrieval_embeddings
from llama_index_crag.text.cleaning import clean_nodes, clean_text, is_blank

logger = logging.getLogger(__name__)


dispatcher = get_dispatcher(__name__)


class CorrectiveQueryEngine(CorrectionSteps, AnswerSteps, BaseQueryEngine):
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
        settings.check_parts(grader, refiner)  # one set of thresholds: the parts grade, the settings are read
        self._retriever = retriever
        self._grader = grader
        self._refiner = refiner
        self._fallback = fallback
        self._rewriter = rewriter
        self._synthesizer = response_synthesizer
        self._postprocessors = list(node_postprocessors or [])
        self._quoting = None
        self._quoting_prompts = QuotingPrompts()
        self.settings = settings
        #: "extract" or "generate": the setting, or when unset, what the generator allows (``default_answer_mode``).
        self.answer_mode = settings.answer_mode or default_answer_mode(getattr(response_synthesizer, "_llm", None))
        self._quoter = EvidenceQuoter(
            grader.scorer,
            max_quotes=settings.max_quotes,
            threshold=refiner.threshold,
            strip_min_tokens=refiner.strip_min_tokens,
            answer_threshold=grader.lower if settings.quote_threshold is None else settings.quote_threshold,
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
        """The synthesizer's templates, the quoting templates for web sources, the rewrite prompt, and the
        scorer's prompts where it has any (the LLM judge's)."""
        modules: PromptMixinType = {"response_synthesizer": self._synthesizer, "quoting": self._quoting_prompts}
        if self._rewriter is not None:
            modules["rewrite"] = self._rewriter
        if isinstance(self._grader.scorer, PromptMixin):
            modules["scorer"] = self._grader.scorer
        return modules

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
            nodes = clean_nodes(nodes)  # a retriever that does not embed can return text no tokenizer takes
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
            record(trace, nodes, grading)
            trace.action = grading.verdict.value
            if grading.verdict is Verdict.CORRECT:
                context = not_incorrect(nodes, grading)
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
            elif quoted.withheld:
                trace.abstain(
                    f"the best strips, read together, grade {quoted.grade:.3f} against the question, under the "
                    f"quote threshold {self._quoter.answer_threshold:.3f}: they are on its subject but do not answer it"
                )
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


def _checked_query(query_bundle: QueryBundle, max_chars: int) -> QueryBundle:
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
