"""CorrectiveRetriever: retrieve, grade, then refine, rewrite and fall back, or say that the documents do not answer."""

from __future__ import annotations

import copy
from typing import Any, List, Mapping, Optional, Sequence, Union

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.callbacks import CallbackManager
from llama_index.core.indices.base import BaseIndex
from llama_index.core.llms import LLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, NodeWithScore, QueryBundle, TextNode
from llama_index.core.settings import Settings

from llama_index_crag.core.builder import retriever_parts
from llama_index_crag.core.grader import RelevanceGrader
from llama_index_crag.core.loop import Broadening, Correction, Loop, Steps, adrive, drive
from llama_index_crag.core.refiner import StripRefiner
from llama_index_crag.core.rewrite import QueryRewriter
from llama_index_crag.core.settings import CragSettings
from llama_index_crag.scope import UNBOUNDED, Scope, ScopeCache, ScopeLike, scoped_retriever
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.web.settings import WebSearchSettings

#: Metadata key of every node the retriever returns: the decision trace of the call (``CragTrace.to_dict()``,
#: the dict an engine puts in ``response.metadata["crag"]``), hidden from the LLM and the embedder.
TRACE_KEY = "crag"
#: Metadata key marking the one node returned when the loop abstains (its text says that the documents do not answer).
ABSTAINED_KEY = "crag_abstained"


class CorrectiveRetriever(BaseRetriever):
    """A retriever that grades what it found and corrects it: CRAG up to, not including, the answer.

    It retrieves with the primary retriever, grades every candidate, and then keeps the
    candidates not graded incorrect (CORRECT), their relevant knowledge strips
    (AMBIGUOUS), or rewrites the query and grades the fallback's hits (INCORRECT); see
    ``docs/loop.md``; the loop itself is ``core/loop.py``'s, run over this retriever's parts.
    The nodes returned are the kept evidence, scored with their grades,
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
        fallback: Optional[BaseRetriever] = None,
        fallback_sources: Sequence[str] = ("bm25", "sentence_window"),
        web: Union[None, bool, Mapping[str, Any], WebSearchSettings] = None,
        calibration_path: Optional[str] = None,
        callback_manager: Optional[CallbackManager] = None,
        vector_store: Optional[Any] = None,
        filters: ScopeLike = None,
        broaden: Sequence[str] = (),
        **settings: Any,
    ) -> CorrectiveRetriever:
        """Build the corrective retriever around what the user already has (its parts: ``core/builder.py``).

        Give a ``vector_store`` (a ``PGVectorStore`` or ``postgresql://`` URL filled by
        ``llama-crag ingest --store``: retrieval, fallback and word statistics then stay in
        PostgreSQL, see ``docs/postgres.md``), an ``index``, a ``retriever`` or ``nodes`` (an in-memory vector
        index is built over them). The fallback retriever is built over the same nodes (taken
        from ``nodes`` or the index's docstore); with no nodes at hand (a remote vector
        store), the rewritten query goes back through the primary retriever.

        ``scorer`` defaults to the offline ``EvidenceScorer`` (bundled MiniLM plus lexical
        and answer-type evidence, IDF from the same nodes), or to a ``ReaderScorer`` over
        the grader directory in ``CRAG_GRADER`` (``llama-crag train-grader``). Any keyword
        of ``CragSettings`` (``upper``, ``lower``, ``max_rewrites``, ``enabled`` ...)
        may be passed; it wins over ``CRAG_*`` variables and the calibration file.

        ``filters`` (LlamaIndex ``MetadataFilters``, their JSON, or ``{"tenant": "acme"}``) bound every
        path that retrieves: the primary retriever, BM25, sentence windows, the rewrite's search and
        hybrid search only see nodes whose metadata match, and every candidate is checked against them
        (``docs/scope.md``). A given ``retriever=``'s own filters are read and kept. Where a given
        retriever's scope cannot be read (a custom retriever) and no ``filters=`` are given, the
        fallback searches back through that retriever only, never the index around it.

        ``broaden`` (opt-in) names keys of ``filters`` that narrow for relevance, not for access (a
        product line, a year): when the INCORRECT branch's rewrite finds nothing inside the filters,
        it searches once more with those keys' conditions dropped. Only top-level conditions of
        ``filters`` can be named, and a key a caller's ``scoped`` filters name is never dropped.

        ``web`` turns on the web-search source of the fallback (off by default): ``True``,
        a dict of ``WebSearchSettings`` fields, or the settings themselves; ``CRAG_WEB=on``
        and ``CRAG_WEB_*`` variables do the same, and ``CRAG_WEB_FORBIDDEN=true`` forbids
        sending anything whatever the code says.
        """
        return cls(
            **retriever_parts(
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
                broaden=broaden,
                **settings,
            )
        )

    def variant(
        self, *, explain: Optional[bool] = None, settings: Optional[CragSettings] = None
    ) -> CorrectiveRetriever:
        """This retriever with the scorer's explanations on or off, or other settings, sharing every model.

        The settings are the one source of the thresholds: the grader and the refiner of the
        variant are copies holding the new values (``CragSettings.check_parts`` holds them equal).
        """
        other = copy.copy(self)
        other._scoped = ScopeCache()  # its scoped copies hold its own parts
        if explain is not None:
            settings = (settings or self.settings).model_copy(update={"explain": explain})
        if settings is not None:
            other.settings = settings
            other._grader = self._grader.model_copy(
                update={
                    "upper": settings.upper,
                    "lower": settings.lower,
                    "aggregation": settings.aggregation,
                    "min_relevant": settings.min_relevant,
                    "explain": settings.explain,
                }
            )
            threshold = settings.lower if settings.strip_threshold is None else settings.strip_threshold
            other._refiner = self._refiner.model_copy(
                update={"threshold": threshold, "strip_min_tokens": settings.strip_min_tokens}
            )
            settings.check_parts(other._grader, other._refiner)
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

    @property
    def loop(self) -> Loop:
        """The corrective loop over this retriever's parts (without an answer step: the engine adds its own)."""
        return Loop(
            retriever=self._retriever,
            grader=self._grader,
            refiner=self._refiner,
            fallback=self._fallback,
            rewriter=self._rewriter,
            settings=self.settings,
            scope=self._scope,
            broadening=self._broadening,
            postprocessors=tuple(self._postprocessors),
        )

    def steps(self, query_bundle: QueryBundle) -> Steps[Correction]:
        """The loop up to the answer step, as steps for a driver (``drive``, ``adrive``)."""
        return self.loop.correct(query_bundle)


def _traced(node: BaseNode, trace: Any) -> BaseNode:
    """``node`` (a copy) with the trace in its metadata, hidden from the LLM and the embedder."""
    node.metadata = {**node.metadata, TRACE_KEY: trace}
    hidden = [TRACE_KEY, ABSTAINED_KEY]
    node.excluded_llm_metadata_keys = [*node.excluded_llm_metadata_keys, *hidden]
    node.excluded_embed_metadata_keys = [*node.excluded_embed_metadata_keys, *hidden]
    return node
