"""Scope: the metadata filters that bound what a caller may read, on every path that retrieves.

A ``Scope`` wraps LlamaIndex ``MetadataFilters`` (every operator and condition, nested groups
included) and answers one question about a node: may this caller read it? The loop asks it of
every candidate that any retriever returns, so that a retriever that ignores a filter cannot
widen the scope; retrievers that can narrow their own search (a vector index, BM25, the
in-memory sentence windows, PostgreSQL) are narrowed with ``scoped_retriever`` so that the
scope costs no recall. Each leaf filter is evaluated with LlamaIndex's own operator semantics
(``build_metadata_filter_fn``); a comparison that cannot be made (a number against a string)
admits nothing: when in doubt, search less, never more.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, TypeVar, Union

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import BaseNode, NodeWithScore
from llama_index.core.vector_stores.types import (
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
)
from llama_index.core.vector_stores.utils import build_metadata_filter_fn

from llama_index_crag.errors import ScopeError

#: What a caller may give as a scope: LlamaIndex's filters, their JSON as a dict, the ``{key: value}``
#: shorthand (a list value means "one of"), or a ``Scope``.
ScopeLike = Union[None, "Scope", MetadataFilters, MetadataFilter, Mapping[str, Any]]
N = TypeVar("N", BaseNode, NodeWithScore)
#: Scoped variants of one retriever kept per scope (``scoped_retriever``), so a server's callers cost a lookup.
MAX_CACHED_SCOPES = 256


def as_filters(value: ScopeLike) -> Optional[MetadataFilters]:
    """``value`` as LlamaIndex ``MetadataFilters`` (None for no scope), or a ``ScopeError`` naming what is wrong.

    A mapping with a ``"filters"`` list is read as ``MetadataFilters`` JSON (nested groups too); any other
    mapping is the shorthand ``{"tenant": "acme", "year": [2023, 2024]}``: each key must equal its value,
    or be one of a list's values.
    """
    if value is None:
        return None
    if isinstance(value, Scope):
        return value.filters
    if isinstance(value, MetadataFilters):
        return value
    if isinstance(value, MetadataFilter):
        return MetadataFilters(filters=[value])
    if not isinstance(value, Mapping):
        raise ScopeError(f"filters must be MetadataFilters or a JSON object, not {type(value).__name__}")
    if "filters" in value:
        try:
            return MetadataFilters.model_validate(dict(value))
        except Exception as exc:  # pydantic's ValidationError names the field
            raise ScopeError(f"filters: not valid MetadataFilters JSON: {exc}") from exc
    if not value:
        raise ScopeError("filters: an empty object narrows nothing; leave filters out for no scope")
    leaves: List[Union[MetadataFilter, MetadataFilters]] = []
    for key, wanted in value.items():
        if not isinstance(key, str) or not key:
            raise ScopeError(f"filters: a key must be a non-empty string, not {key!r}")
        if isinstance(wanted, (list, tuple)):
            if not wanted or not all(isinstance(v, (str, int, float)) for v in wanted):
                raise ScopeError(f"filters.{key}: a list must hold strings or numbers, at least one")
            leaves.append(MetadataFilter(key=key, value=list(wanted), operator=FilterOperator.IN))
        elif isinstance(wanted, (str, int, float)) and not isinstance(wanted, bool):
            leaves.append(MetadataFilter(key=key, value=wanted, operator=FilterOperator.EQ))
        else:
            raise ScopeError(f"filters.{key}: a value must be a string, a number or a list of them")
    return MetadataFilters(filters=leaves, condition=FilterCondition.AND)


def _leaf(filter_: MetadataFilter) -> Callable[[Mapping[str, Any]], bool]:
    """One filter as a predicate on metadata, with LlamaIndex's semantics; a comparison that raises admits nothing."""
    match = build_metadata_filter_fn(lambda metadata: metadata, MetadataFilters(filters=[filter_]))  # type: ignore

    def admits(metadata: Mapping[str, Any]) -> bool:
        try:
            return bool(match(metadata))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return False

    return admits


def _compile(filters: MetadataFilters) -> Callable[[Mapping[str, Any]], bool]:
    parts = [_compile(f) if isinstance(f, MetadataFilters) else _leaf(f) for f in filters.filters]
    condition = filters.condition or FilterCondition.AND
    if not parts:
        return lambda metadata: True
    if condition == FilterCondition.AND:
        return lambda metadata: all(p(metadata) for p in parts)
    if condition == FilterCondition.OR:
        return lambda metadata: any(p(metadata) for p in parts)
    if condition == FilterCondition.NOT:
        return lambda metadata: not any(p(metadata) for p in parts)
    raise ScopeError(f"filters: unknown condition {condition!r}")


def filter_keys(filters: Optional[MetadataFilters]) -> Set[str]:
    """Every metadata key that ``filters`` names, nested groups included."""
    if filters is None:
        return set()
    keys: Set[str] = set()
    for f in filters.filters:
        keys |= filter_keys(f) if isinstance(f, MetadataFilters) else {f.key}
    return keys


@dataclass(frozen=True)
class Scope:
    """What one caller may read: the nodes whose metadata match ``filters`` (None: every node).

    Args:
        filters: LlamaIndex ``MetadataFilters``; nested groups and every operator are evaluated.
    """

    filters: Optional[MetadataFilters] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "_admits", _compile(self.filters) if self.filters is not None else None)

    @classmethod
    def of(cls, value: ScopeLike) -> Scope:
        """A scope from anything ``as_filters`` reads."""
        return value if isinstance(value, Scope) else cls(as_filters(value))

    @property
    def bounded(self) -> bool:
        """Whether this scope excludes anything at all."""
        return self.filters is not None

    @property
    def keys(self) -> Set[str]:
        """The metadata keys the scope names (a broadening fallback never drops one of them)."""
        return filter_keys(self.filters)

    @property
    def key(self) -> str:
        """A canonical string of the scope, for caches: equal scopes, equal keys."""
        return "" if self.filters is None else json.dumps(self.filters.model_dump(mode="json"), sort_keys=True)

    def describe(self) -> str:
        """The filters as compact JSON, for traces and error messages (no document text)."""
        return "no scope" if self.filters is None else json.dumps(self.filters.model_dump(mode="json"))

    def admits(self, metadata: Mapping[str, Any]) -> bool:
        """Whether a node with this metadata is inside the scope."""
        predicate = self._admits  # type: ignore[attr-defined]
        return True if predicate is None else bool(predicate(metadata or {}))

    def admits_node(self, node: Union[BaseNode, NodeWithScore]) -> bool:
        """Whether ``node`` (or a scored node) is inside the scope."""
        return self.admits((node.node if isinstance(node, NodeWithScore) else node).metadata)

    def keep(self, nodes: Iterable[N]) -> List[N]:
        """The nodes inside the scope, in their order."""
        return list(nodes) if self.filters is None else [n for n in nodes if self.admits_node(n)]

    def narrow(self, other: ScopeLike) -> Scope:
        """This scope and ``other`` both: a request's filters narrow a key's scope and can never widen it."""
        more = as_filters(other)
        if more is None:
            return self
        if self.filters is None:
            return Scope(more)
        if Scope(more).key == self.key:  # the same filters again narrow nothing
            return self
        return Scope(MetadataFilters(filters=[self.filters, more], condition=FilterCondition.AND))

    def without(self, keys: Sequence[str]) -> Optional[MetadataFilters]:
        """``filters`` with every top-level AND leaf on ``keys`` dropped (for the opt-in broadening fallback)."""
        if self.filters is None:
            return None
        if (self.filters.condition or FilterCondition.AND) != FilterCondition.AND:
            return self.filters
        kept = [f for f in self.filters.filters if isinstance(f, MetadataFilters) or f.key not in keys]
        return MetadataFilters(filters=kept, condition=FilterCondition.AND) if kept else None


UNBOUNDED = Scope()


def is_nested(filters: Optional[MetadataFilters]) -> bool:
    """Whether ``filters`` holds a nested group (stores such as LlamaIndex's in-memory one cannot apply it)."""
    return filters is not None and any(isinstance(f, MetadataFilters) for f in filters.filters)


def retriever_scope(retriever: BaseRetriever) -> Optional[Scope]:
    """The scope a retriever already applies, where LlamaIndex exposes it; None where it cannot be known.

    A ``VectorIndexRetriever`` shows its ``filters`` (a restriction to node or document ids cannot be read
    as metadata, so it counts as unknown); a ``BM25Retriever`` built without a weight mask searches all of
    its nodes; our own retrievers say theirs (``scope`` attribute). Anything else is unknown, and the loop
    then never searches around it.
    """
    own = getattr(retriever, "scope", None)
    if isinstance(own, Scope):
        return own
    from llama_index.core.indices.vector_store.retrievers.retriever import VectorIndexRetriever

    if isinstance(retriever, VectorIndexRetriever):
        # ``index.as_retriever()`` names every node of its index: that restricts nothing.
        every = set(retriever._index.index_struct.nodes_dict.values())
        if retriever._doc_ids or (retriever._node_ids and not every.issubset(retriever._node_ids)):
            return None
        return Scope(retriever._filters)
    try:
        from llama_index.retrievers.bm25 import BM25Retriever
    except ImportError:  # pragma: no cover - a dependency of the package
        return None
    if isinstance(retriever, BM25Retriever) and not retriever.corpus_weight_mask:
        return UNBOUNDED
    return None


def scoped_retriever(retriever: BaseRetriever, scope: Scope) -> BaseRetriever:
    """``retriever`` narrowed to ``scope`` (a copy sharing its index and models), or a ``ScopeError``.

    Our retrievers narrow themselves (``scoped``); a ``VectorIndexRetriever`` over LlamaIndex's in-memory
    store searches only the admitted node ids (that store cannot apply nested filters), over any other
    store it passes the filters to the store; a ``BM25Retriever`` masks the nodes outside. Any other
    retriever cannot be narrowed here: give it the filters yourself.
    """
    if not scope.bounded:
        return retriever
    narrow = getattr(retriever, "scoped", None)
    if callable(narrow):
        return narrow(scope)  # type: ignore[no-any-return]
    from llama_index.core.indices.vector_store.retrievers.retriever import VectorIndexRetriever
    from llama_index.core.vector_stores.simple import SimpleVectorStore

    if isinstance(retriever, VectorIndexRetriever):
        narrowed = copy.copy(retriever)
        if isinstance(retriever._vector_store, SimpleVectorStore) or retriever._node_ids:
            nodes = retriever._docstore.docs.values()
            ids = [n.node_id for n in nodes if scope.admits_node(n)]
            if retriever._node_ids:
                allowed = set(retriever._node_ids)
                ids = [i for i in ids if i in allowed]
            narrowed._node_ids = ids
        else:
            narrowed._filters = Scope(retriever._filters).narrow(scope).filters
        return narrowed
    try:
        from llama_index.retrievers.bm25 import BM25Retriever
    except ImportError:  # pragma: no cover - a dependency of the package
        BM25Retriever = None  # type: ignore[assignment,misc]
    if BM25Retriever is not None and isinstance(retriever, BM25Retriever):
        other = copy.copy(retriever)
        mask = [int(scope.admits(entry)) for entry in retriever.corpus]
        if retriever.corpus_weight_mask:
            mask = [a * b for a, b in zip(mask, retriever.corpus_weight_mask)]
        other.corpus_weight_mask = mask if any(mask) else [0] * len(mask)
        return other
    raise ScopeError(
        f"a {type(retriever).__name__} cannot be narrowed to a scope here: build it with the filters yourself "
        "(e.g. index.as_retriever(filters=...)) and pass it as retriever=, or use a retriever that takes filters"
    )


class ScopeCache:
    """Scoped variants of one object, one per scope, built once (bounded; the oldest goes first)."""

    def __init__(self) -> None:
        self._built: Dict[str, Any] = {}

    def get(self, scope: Scope, build: Callable[[], Any]) -> Any:
        key = scope.key
        found = self._built.get(key)
        if found is None:
            found = build()
            if len(self._built) >= MAX_CACHED_SCOPES:
                self._built.pop(next(iter(self._built)))
            self._built[key] = found
        return found
