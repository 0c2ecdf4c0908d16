"""CorrectiveRetriever: retrieve, grade, then refine, rewrite and fall back, or say that the documents do not answer."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks import CallbackManager
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, NodeWithScore, QueryBundle, TextNode
from llama_index.core.settings import Settings

from llama_index_crag.core.builder import corrective_retriever
from llama_index_crag.core.correction import Broadening, CorrectionSteps, not_incorrect, record
from llama_index_crag.core.driver import Io, Steps, adrive, bind, drive
from llama_index_crag.core.grader import RelevanceGrader, Verdict
from llama_index_crag.core.refiner import StripRefiner
from llama_index_crag.core.rewrite import QueryRewriter
from llama_index_crag.core.settings import CragSettings
from llama_index_crag.core.trace import CragTrace, step_span
from llama_index_crag.errors import InvalidQueryError
from llama_index_crag.scope import UNBOUNDED, Scope, ScopeCache, ScopeLike, scoped_retriever
from llama_index_crag.scorers.bi_encoder import reuse_retrieval_embeddings
from llama_index_crag.scorers.language import language_warning
from llama_index_crag.text.cleaning import clean_nodes, clean_text, is_blank

#: Metadata key of every node the retriever returns: the decision trace of the call (``CragTrace.to_dict()``,
#: the dict an engine puts in ``response.metadata["crag"]``), hidden from the LLM and the embedder.
TRACE_KEY = "crag"
#: Metadata key marking the one node returned when the loop abstains (its text says that the documents do not answer).
ABSTAINED_KEY = "crag_abstained"


@dataclass
class Correction:
    """The loop's outcome before the answer step: the checked query, the kept evidence, and the trace."""

    query_bundle: QueryBundle
    nodes: List[NodeWithScore]
    trace: CragTrace


class CorrectiveRetriever(CorrectionSteps, BaseRetriever):
    """A retriever that grades what it found and corrects it: CRAG up to, not including, the answer.

    It retrieves with the primary retriever, grades every candidate, and then keeps the
    candidates not graded incorrect (CORRECT), their relevant knowledge strips
    (AMBIGUOUS), or rewrites the query and grades the fallback's hits (INCORRECT); see
    ``docs/loop.md``. The nodes returned are the kept evidence, scored with their grades,
    so any LlamaIndex consumer (``CondensePlusContextChatEngine``, ``ContextChatEngine``,
    an agent's tool, a workflow step) answers from corrected context.

    When the loop abstains it returns one ``TextNode`` (``metadata["crag_abstained"]`` is
    True) whose text tells the LLM that the documents do not answer the question, and
    why: never the rejected passages. Every node returned carries the call's decision
    trace in ``node.metadata["crag"]`` (hidden from the LLM and the embedder).

    A ``scope`` (``filters=`` of ``from_defaults``, or ``scoped``) bounds every path: the
    retrievers search inside it, and every candidate any of them returns is checked
    against it before anything reads it (``docs/scope.md``).

    Args:
        retriever: The primary retriever (any LlamaIndex retriever).
        grader: Scores and bands the candidates.
        refiner: Knowledge-strip refinement for AMBIGUOUS.
        fallback: The retrieval of the INCORRECT branch (and of ``hybrid``).
        rewriter: The query rewrite of the INCORRECT branch (None: the question's keywords).
        settings: Resolved settings (see ``CragSettings.resolve``).
        node_postprocessors: Run after retrieval and before grading (e.g. a reranker
            whose scores the grader reuses).
        callback_manager: Receives the ``retrieve`` callback events (``Settings.callback_manager`` by default).
        scope: What the caller may read; the retrievers given are expected to search inside it already.
        broadening: The opt-in broadening fallback of the INCORRECT branch (``broaden=`` of ``from_defaults``).
    """

    def __init__(
        self,
        retriever: BaseRetriever,
        grader: RelevanceGrader,
        refiner: StripRefiner,
        fallback: Optional[BaseRetriever],
        rewriter: Optional[QueryRewriter],
        settings: CragSettings,
        node_postprocessors: Optional[Sequence[BaseNodePostprocessor]] = None,
        callback_manager: Optional[CallbackManager] = None,
        scope: Optional[Scope] = None,
        broadening: Optional[Broadening] = None,
    ) -> None:
        self._scope = scope or UNBOUNDED
        self._broadening = broadening
        self._scoped = ScopeCache()
        self._retriever = retriever
        self._grader = grader
        self._refiner = refiner
        self._fallback = fallback
        self._rewriter = rewriter
        self._postprocessors = list(node_postprocessors or [])
        settings.check_parts(grader, refiner)  # one set of thresholds: the parts grade, the settings are read
        self.settings = settings
        super().__init__(callback_manager=callback_manager or Settings.callback_manager)

    #: Build the retriever around what the user already has: the arguments of ``CorrectiveQueryEngine.from_defaults``
    #: but those of its answer step (``core/builder.py`` says how).
    from_defaults = classmethod(corrective_retriever)

    def variant(
        self, *, explain: Optional[bool] = None, settings: Optional[CragSettings] = None
    ) -> CorrectiveRetriever:
        """This retriever with the scorer's explanations on or off, or other settings, sharing every part."""
        other = copy.copy(self)
        if settings is not None:
            other.settings = settings
        if explain is not None and explain != self._grader.explain:
            other._grader = self._grader.model_copy(update={"explain": explain})
            other.settings = other.settings.model_copy(update={"explain": explain})
        return other

    @property
    def scope(self) -> Scope:
        """What this retriever's caller may read (``Scope``; unbounded when no filters were given)."""
        return self._scope

    def scoped(self, filters: ScopeLike) -> CorrectiveRetriever:
        """This retriever narrowed to ``filters`` as well, for one caller: it shares every model, index and cache,
        and can only narrow the scope, never widen it. Built once per scope (a lookup after that).

        Raises ``ScopeError`` where the primary retriever or a fallback source cannot be narrowed.
        """
        scope = self._scope.narrow(filters)
        if scope.key == self._scope.key:
            return self

        def build() -> CorrectiveRetriever:
            other = copy.copy(self)
            other._scope = scope
            other._retriever = scoped_retriever(self._retriever, scope)
            if self._fallback is not None:
                other._fallback = scoped_retriever(self._fallback, scope)
            if self._broadening is not None:
                other._broadening = self._broadening.scoped(filters)
            return other

        return self._scoped.get(scope, build)  # type: ignore[no-any-return]

    @property
    def retriever(self) -> BaseRetriever:
        """The primary retriever, whose candidates are graded."""
        return self._retriever

    @property
    def grader(self) -> RelevanceGrader:
        """The grader that routes each query."""
        return self._grader

    @property
    def refiner(self) -> StripRefiner:
        """The knowledge-strip refiner of the AMBIGUOUS branch."""
        return self._refiner

    @property
    def fallback(self) -> Optional[BaseRetriever]:
        """The retrieval of the INCORRECT branch."""
        return self._fallback

    @property
    def rewriter(self) -> Optional[QueryRewriter]:
        """The LLM query rewrite of the INCORRECT branch; None rewrites with the question's keywords."""
        return self._rewriter

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return self.evidence(drive(self.steps(query_bundle)))

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return self.evidence(await adrive(self.steps(query_bundle)))

    def evidence(self, correction: Correction) -> List[NodeWithScore]:
        """The nodes a downstream LLM reads: the kept evidence, or the abstention statement; each with the trace."""
        trace = correction.trace.to_dict()
        if correction.trace.abstained:
            statement = self.settings.abstain_context.replace("{reason}", correction.trace.abstain_reason or "")
            return [NodeWithScore(node=_traced(TextNode(text=statement, metadata={ABSTAINED_KEY: True}), trace))]
        return [NodeWithScore(node=_traced(n.node.model_copy(), trace), score=n.score) for n in correction.nodes]

    def steps(self, query_bundle: QueryBundle) -> Steps[Correction]:
        """The loop up to the answer step, as steps for a driver (``core/driver.py``); the engine runs it too."""
        query_bundle = checked_query(query_bundle, self.settings.max_query_chars)
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
            scope=self._scope.filters.model_dump(mode="json") if self._scope.filters is not None else None,
        )
        if s.enabled and (warning := language_warning(query_bundle.query_str, self._grader.scorer)):
            trace.warnings.append(warning)
        with trace.timed("retrieve"):
            nodes = yield Io(
                lambda: self._retriever.retrieve(query_bundle), lambda: self._retriever.aretrieve(query_bundle)
            )
            nodes = clean_nodes(nodes)  # a retriever that does not embed can return text no tokenizer takes
            nodes = self._scope.keep(nodes)  # a retriever that ignored the scope cannot widen it
        if not nodes and self._scope.bounded and self._broadening is None:
            trace.action = Verdict.INCORRECT.value if s.enabled else trace.action  # nothing to grade, none to read
            trace.abstain(f"no passage inside the caller's scope matched ({self._scope.describe()})")
            return Correction(query_bundle, [], trace)
        if s.enabled:
            reuse_retrieval_embeddings(self._grader.scorer, self._retriever, query_bundle, nodes)
        with trace.timed("rerank"):
            nodes = yield from self._postprocess(nodes, query_bundle, None)

        context: List[NodeWithScore] = nodes
        if s.enabled:
            with trace.timed("grade"), step_span("grade", candidates=len(nodes)) as span:
                grading = yield Io(
                    bind(self._grader.grade, query_bundle, nodes), bind(self._grader.agrade, query_bundle, nodes)
                )
                span.outcome = grading.verdict.value
                span.sizes["kept"] = sum(label is not Verdict.INCORRECT for label in grading.labels)
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
        return Correction(query_bundle, [] if trace.abstained else context, trace)


def _traced(node: BaseNode, trace: Any) -> BaseNode:
    """``node`` (a copy) with the trace in its metadata, hidden from the LLM and the embedder."""
    node.metadata = {**node.metadata, TRACE_KEY: trace}
    hidden = [TRACE_KEY, ABSTAINED_KEY]
    node.excluded_llm_metadata_keys = [*node.excluded_llm_metadata_keys, *hidden]
    node.excluded_embed_metadata_keys = [*node.excluded_embed_metadata_keys, *hidden]
    return node


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
