"""The builders behind ``CorrectiveRetriever.from_defaults``: the corrective retriever's parts wired from what the
user already has.

Given an index, a retriever, nodes or a vector store, it chooses the scorer (``scorers.registry``),
resolves the settings (argument > ``CRAG_*`` environment > calibration file), loads the
calibrated scorer state, and builds the grader, refiner, fallback (with the web where asked) and
rewriter the loop uses. ``CorrectiveQueryEngine.from_defaults`` adds the answer step's synthesizer.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.callbacks import CallbackManager
from llama_index.core.indices.base import BaseIndex
from llama_index.core.llms import LLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, MetadataMode
from llama_index.core.settings import Settings

from llama_index_crag.core.fallback import FallbackRetriever
from llama_index_crag.core.grader import RelevanceGrader
from llama_index_crag.core.loop import Broadening
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

logger = logging.getLogger(__name__)


@dataclass
class Searched:
    """What the loop searches, and inside which scope: the primary retriever (None: built over the index), the
    nodes the fallback and the word statistics are built over (None: not at hand), and the scopes."""

    retriever: Optional[BaseRetriever]
    nodes: Optional[List[BaseNode]]
    scope: Scope
    floor: Scope  #: the scope without the ``broaden`` keys
    given_scope: Optional[Scope]  #: the given retriever's own (None: it cannot be read; unbounded: none given)

    @property
    def in_scope(self) -> Optional[List[BaseNode]]:
        return None if self.nodes is None else self.scope.keep(self.nodes)


def retriever_parts(
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
) -> Dict[str, Any]:
    """The keyword arguments of ``CorrectiveRetriever`` built from what the user already has (what
    ``CorrectiveRetriever.from_defaults`` documents), one small builder per part."""
    unknown = set(settings) - set(CragSettings.model_fields)
    if unknown:
        raise TypeError(f"unknown settings {sorted(unknown)}; see CragSettings for the names")
    scope = Scope.of(filters)
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
        retriever, scorer = parts.retriever, parts.scorer
        embed_model, node_postprocessors = parts.embed_model, parts.postprocessors
    llm = llm or settings_llm()
    callback_manager = callback_manager or Settings.callback_manager  # every part reports to the same handlers
    searched = searched_parts(index, retriever, nodes, scope, broaden)
    if scorer is None:
        scorer = default_scorer(embed_model, _word_corpus(searched.in_scope))
    calibration_path = calibration_path or os.environ.get("CRAG_CALIBRATION")
    resolved = resolved_settings(scorer, settings, calibration_path)
    primary = primary_retriever(index, searched, resolved, embed_model)
    given_fallback = fallback is not None and vector_store is None
    if vector_store is not None:
        fallback = parts.fallback
    fallback, broadening = fallback_parts(
        fallback, given_fallback, primary, searched, broaden, fallback_sources, resolved, embed_model, callback_manager
    )
    web_settings = WebSearchSettings.resolve(web)
    if web_settings.enabled:
        fallback = FallbackRetriever.with_web(
            fallback,
            WebSearchRetriever(web_settings, scorer=scorer, strip_min_tokens=resolved.strip_min_tokens),
            similarity_top_k=resolved.similarity_top_k,
            callback_manager=callback_manager,
        )
    grader, refiner = grading_parts(scorer, resolved, callback_manager)
    return {
        "retriever": primary,
        "grader": grader,
        "refiner": refiner,
        "fallback": fallback,
        "rewriter": QueryRewriter(llm, parts=resolved.split_compound) if llm is not None else None,
        "settings": resolved,
        "node_postprocessors": node_postprocessors,
        "callback_manager": callback_manager,
        "scope": searched.scope,
        "broadening": broadening,
    }


def searched_parts(
    index: Optional[BaseIndex],
    retriever: Optional[BaseRetriever],
    nodes: Optional[Sequence[BaseNode]],
    scope: Scope,
    broaden: Sequence[str],
) -> Searched:
    """The nodes at hand and the scope every path searches inside: ``filters=`` narrowed by a given retriever's
    own filters. Nodes around a retriever whose scope cannot be read are never searched."""
    floor = _broadened(scope, broaden)
    found: Optional[List[BaseNode]] = None
    if nodes is not None:
        found = [clean_node(n) for n in nodes]  # text every tokenizer and codec takes (a lone surrogate is refused)
    elif index is not None:
        found = list(index.docstore.docs.values())
    given_scope = UNBOUNDED if retriever is None else retriever_scope(retriever)
    if given_scope is not None:
        scope, floor = given_scope.narrow(scope), given_scope.narrow(floor)
    if found is not None and given_scope is None and not scope.bounded:
        # A retriever whose scope cannot be read: searching the nodes around it could return what it never would.
        logger.warning(
            "the scope of %s cannot be read: the fallback searches back through it only; pass filters= "
            "(the same as the retriever's) to add BM25 and sentence windows inside that scope",
            type(retriever).__name__,
        )
        found = None
    return Searched(retriever, found, scope, floor, given_scope)


def _word_corpus(in_scope: Optional[List[BaseNode]]) -> Optional[List[str]]:
    """The texts the default scorer's word statistics come from: the scope's own nodes when it is known here; a
    scope narrowed per request (``scoped``) keeps these: document frequencies of words, no text (docs/scope.md)."""
    corpus = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in in_scope or []]
    return corpus or None


def resolved_settings(
    scorer: RelevanceScorer, settings: Mapping[str, Any], calibration_path: Optional[str]
) -> CragSettings:
    """The settings (argument > ``CRAG_*`` environment > calibration file > the scorer's defaults), with the
    calibrated scorer state loaded into ``scorer``."""
    if calibration_path:
        state = read_calibration(calibration_path, scorer.name).get("scorer_state")
        if state is not None:
            scorer.load_state(state)
    return CragSettings.resolve(
        dict(settings),
        calibration_path=calibration_path,
        scorer_name=scorer.name,
        scorer_defaults=scorer.default_thresholds,
    )


def primary_retriever(
    index: Optional[BaseIndex], searched: Searched, resolved: CragSettings, embed_model: Optional[BaseEmbedding]
) -> BaseRetriever:
    """The retriever whose candidates are graded: the given one (narrowed to the scope), or the index's."""
    retriever, scope, given_scope = searched.retriever, searched.scope, searched.given_scope
    if index is None and retriever is None:
        in_scope = searched.in_scope
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
    return retriever


def fallback_parts(
    fallback: Optional[BaseRetriever],
    given_fallback: bool,
    primary: BaseRetriever,
    searched: Searched,
    broaden: Sequence[str],
    sources: Sequence[str],
    resolved: CragSettings,
    embed_model: Optional[BaseEmbedding],
    callback_manager: CallbackManager,
) -> Tuple[BaseRetriever, Optional[Broadening]]:
    """The INCORRECT branch's retrieval (BM25 and sentence windows over the nodes inside the scope, or back
    through the primary retriever), and the opt-in broadening's."""
    from llama_index_crag.local.models import settings_embed_model

    nodes, scope, floor = searched.nodes, searched.scope, searched.floor
    if broaden and nodes is None:
        raise ConfigError(
            "broaden= needs the nodes it may search (index= or nodes=); a store or a bare retriever "
            "cannot be searched around its filters"
        )
    if fallback is None:
        over = searched.in_scope if not broaden or nodes is None else floor.keep(nodes)
        if over and any(n.get_content().strip() for n in over):
            fallback = FallbackRetriever.from_nodes(
                over,
                sources=sources,
                similarity_top_k=resolved.similarity_top_k,
                # The sentences are embedded by the model given (or set in Settings: the model wherever none is
                # passed), else as the primary index embedded its chunks, whose query vector then serves both
                # searches (``fallback_query``).
                embed_model=embed_model or settings_embed_model() or _embed_model_of(primary),
                callback_manager=callback_manager,
                widen_to=resolved.fallback_widen,
            )
        else:
            fallback = FallbackRetriever(
                {"primary": primary}, similarity_top_k=resolved.similarity_top_k, callback_manager=callback_manager
            )
    broadening = Broadening(tuple(broaden), floor, scoped_retriever(fallback, floor)) if broaden else None
    if given_fallback or broaden:
        fallback = scoped_retriever(fallback, scope)  # a given fallback is narrowed too, or the build stops
    return fallback, broadening


def _embed_model_of(retriever: BaseRetriever) -> Optional[BaseEmbedding]:
    model = getattr(retriever, "_embed_model", None)
    return model if isinstance(model, BaseEmbedding) else None


def grading_parts(
    scorer: RelevanceScorer, resolved: CragSettings, callback_manager: CallbackManager
) -> Tuple[RelevanceGrader, StripRefiner]:
    """The grader and the refiner, holding the settings' thresholds (the one set of values)."""
    grader = RelevanceGrader(
        scorer,
        upper=resolved.upper,
        lower=resolved.lower,
        aggregation=resolved.aggregation,
        min_relevant=resolved.min_relevant,
        explain=resolved.explain,
        callback_manager=callback_manager,
    )
    refiner = StripRefiner(
        scorer,
        threshold=resolved.lower if resolved.strip_threshold is None else resolved.strip_threshold,
        strip_min_tokens=resolved.strip_min_tokens,
        callback_manager=callback_manager,
    )
    return grader, refiner


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
