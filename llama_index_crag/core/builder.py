"""``CorrectiveRetriever.from_defaults``: the corrective retriever wired from what the user already has.

Given an index, a retriever, nodes or a vector store, it chooses the scorer (``scorers.registry``),
resolves the settings (argument > ``CRAG_*`` environment > calibration file), loads the
calibrated scorer state, and builds the grader, refiner, fallback (with the web where asked) and
rewriter the loop uses. ``CorrectiveQueryEngine.from_defaults`` adds the answer step's synthesizer.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Type, Union

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.callbacks import CallbackManager
from llama_index.core.indices.base import BaseIndex
from llama_index.core.llms import LLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, MetadataMode
from llama_index.core.settings import Settings

from llama_index_crag.core.correction import Broadening
from llama_index_crag.core.fallback import FallbackRetriever
from llama_index_crag.core.grader import RelevanceGrader
from llama_index_crag.core.refiner import StripRefiner
from llama_index_crag.core.rewrite import QueryRewriter
from llama_index_crag.core.settings import CragSettings
from llama_index_crag.errors import ConfigError
from llama_index_crag.scope import UNBOUNDED, Scope, ScopeLike, retriever_scope, scoped_retriever
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.scorers.registry import default_scorer
from llama_index_crag.settings_sources import read_calibration
from llama_index_crag.text.cleaning import clean_node
from llama_index_crag.web.retriever import WebSearchRetriever
from llama_index_crag.web.settings import WebSearchSettings

if TYPE_CHECKING:
    from llama_index_crag.core.retriever import CorrectiveRetriever

logger = logging.getLogger(__name__)


def corrective_retriever(
    cls: Type[CorrectiveRetriever],
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
    """Build the corrective retriever around what the user already has.

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
    scope = Scope.of(filters)
    floor = _broadened(scope, broaden)
    unknown = set(settings) - set(CragSettings.model_fields)
    if unknown:
        raise TypeError(f"unknown settings {sorted(unknown)}; see CragSettings for the names")
    if vector_store is not None:  # a PostgreSQL store: the whole loop reads it (llama_index_crag.stores.postgres)
        from llama_index_crag.core.store_parts import store_parts

        parts = store_parts(
            vector_store,
            embed_model,
            scorer,
            settings=settings,
            calibration_path=calibration_path,
            postprocessors=node_postprocessors,
            retriever=retriever,
            scope=scope,
        )
        retriever, fallback, scorer = parts.retriever, parts.fallback, parts.scorer
        embed_model, node_postprocessors = parts.embed_model, parts.postprocessors
    llm = llm or settings_llm()
    callback_manager = callback_manager or Settings.callback_manager  # every part reports to the same handlers
    if nodes is not None:
        nodes = [clean_node(n) for n in nodes]  # text every tokenizer and codec takes (a lone surrogate is refused)
    elif index is not None:
        nodes = list(index.docstore.docs.values())
    given_scope = UNBOUNDED if retriever is None else retriever_scope(retriever)
    if given_scope is not None:
        scope, floor = given_scope.narrow(scope), given_scope.narrow(floor)
    if nodes is not None and given_scope is None and not scope.bounded:
        # A retriever whose scope cannot be read: searching the nodes around it could return what it never would.
        logger.warning(
            "the scope of %s cannot be read: the fallback searches back through it only; pass filters= "
            "(the same as the retriever's) to add BM25 and sentence windows inside that scope",
            type(retriever).__name__,
        )
        nodes = None
    in_scope = None if nodes is None else scope.keep(nodes)
    if scorer is None:
        # Word statistics come from the scope's own nodes when it is known here; a scope narrowed per request
        # (``scoped``) keeps these: document frequencies of words, no text (docs/scope.md).
        corpus = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in in_scope or []]
        scorer = default_scorer(embed_model, corpus or None)
    calibration_path = calibration_path or os.environ.get("CRAG_CALIBRATION")
    if calibration_path:
        state = read_calibration(calibration_path, scorer.name).get("scorer_state")
        if state is not None:
            scorer.load_state(state)
    resolved = CragSettings.resolve(
        settings,
        calibration_path=calibration_path,
        scorer_name=scorer.name,
        scorer_defaults=scorer.default_thresholds,
    )
    if index is None and retriever is None:
        if in_scope is None:
            raise ValueError("give the engine something to search: index=, retriever= or nodes=")
        from llama_index.core import VectorStoreIndex

        from llama_index_crag.local.models import settings_or_default_embed_model

        index = VectorStoreIndex(list(in_scope), embed_model=embed_model or settings_or_default_embed_model())
    if retriever is None:
        assert index is not None
        retriever = index.as_retriever(similarity_top_k=resolved.similarity_top_k)  # with the index's callback manager
    if given_scope is not None and scope.key != given_scope.key:
        retriever = scoped_retriever(retriever, scope)  # a copy of the given one, narrowed: never replaced
    elif given_scope is None and scope.bounded:
        logger.warning(
            "%s cannot be narrowed to filters=: its results are checked against them, so build it with the same "
            "filters or it may find too few passages inside the scope",
            type(retriever).__name__,
        )
    web_settings = WebSearchSettings.resolve(web)
    broadening = None
    if broaden and nodes is None:
        raise ConfigError(
            "broaden= needs the nodes it may search (index= or nodes=); a store or a bare retriever "
            "cannot be searched around its filters"
        )
    given_fallback = fallback is not None and vector_store is None
    if fallback is None:
        searched = in_scope if not broaden or nodes is None else floor.keep(nodes)
        if searched and any(n.get_content().strip() for n in searched):
            fallback = FallbackRetriever.from_nodes(
                searched,
                sources=fallback_sources,
                similarity_top_k=resolved.similarity_top_k,
                embed_model=embed_model,
                callback_manager=callback_manager,
            )
        else:
            fallback = FallbackRetriever(
                {"primary": retriever}, similarity_top_k=resolved.similarity_top_k, callback_manager=callback_manager
            )
    if broaden:
        broadening = Broadening(tuple(broaden), floor, scoped_retriever(fallback, floor))
    if given_fallback or broaden:
        fallback = scoped_retriever(fallback, scope)  # a given fallback is narrowed too, or the build stops
    if web_settings.enabled:
        fallback = FallbackRetriever.with_web(
            fallback,
            WebSearchRetriever(web_settings, scorer=scorer, strip_min_tokens=resolved.strip_min_tokens),
            similarity_top_k=resolved.similarity_top_k,
            callback_manager=callback_manager,
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
            callback_manager=callback_manager,
        ),
        refiner=StripRefiner(
            scorer,
            threshold=resolved.lower if resolved.strip_threshold is None else resolved.strip_threshold,
            strip_min_tokens=resolved.strip_min_tokens,
            callback_manager=callback_manager,
        ),
        fallback=fallback,
        rewriter=QueryRewriter(llm) if llm is not None else None,
        settings=resolved,
        node_postprocessors=node_postprocessors,
        callback_manager=callback_manager,
        scope=scope,
        broadening=broadening,
    )


def _broadened(scope: Scope, keys: Sequence[str]) -> Scope:
    """``scope`` without its top-level conditions on ``keys`` (the broadening fallback's), or a ``ConfigError``."""
    if isinstance(keys, str):
        raise ConfigError(f"broaden takes a list of filter keys, not the string {keys!r}")
    if not keys:
        return scope
    named = {f.key for f in (scope.filters.filters if scope.filters else []) if not hasattr(f, "filters")}
    top_and = scope.filters is not None and scope.filters.condition in (None, "and")
    missing = sorted(k for k in keys if not top_and or k not in named)
    if missing:
        raise ConfigError(
            f"broaden={list(keys)}: {', '.join(missing)} is not a top-level condition of filters= joined by 'and', "
            "so it cannot be dropped; name in broaden only keys that filters= narrows on"
        )
    return Scope(scope.without(keys))


def settings_llm() -> Optional[LLM]:
    """LlamaIndex's ``Settings.llm`` when one is set; None otherwise (the engine then quotes, never generates)."""
    return getattr(Settings, "_llm", None)
