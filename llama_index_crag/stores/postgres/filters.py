"""A scope (LlamaIndex ``MetadataFilters``) as a parameterised SQL condition over the store's JSONB metadata.

The condition admits exactly the rows whose metadata ``Scope.admits``, which evaluates each filter as
LlamaIndex's ``build_metadata_filter_fn`` does, in Python:

- a key that is missing (or JSON ``null``) admits only ``NE`` and ``NIN`` (and ``IS_EMPTY``);
- a comparison Python cannot make (a number against a string, ``in`` on a number) admits nothing;
- numbers compare as numbers, and a JSON boolean as the number 1 or 0 (``True == 1`` in Python);
  strings compare by code point (``COLLATE "C"``), lists element by element;
- ``IN``/``NIN`` test ``value in filter_value`` (with a string filter value, as a substring), ``CONTAINS``
  tests ``filter_value in value`` (substring of a string, element of a list, key of an object),
  ``ANY``/``ALL`` test each of the filter's values (each character of a string) that way.

Every value travels as a query parameter (psycopg ``sql`` composition, named placeholders); the SQL text
holds only the translator's own constants. What cannot be translated exactly raises ``ScopeError`` when a
retriever is built, never at query time and never as a condition that admits more: an ordering comparison
(``GT``...) with a list, a number whose magnitude reaches 2**53 (PostgreSQL compares JSON numbers as
``float8`` here, exact below that), a case-insensitive match on a value that is not ASCII (Python's Unicode
case mapping is not PostgreSQL's), or a value of another type than LlamaIndex's filters allow.

On the chunks table, the keys LlamaIndex's layout writes beside the node's own metadata (``doc_id``,
``ref_doc_id``, ...) are read from the node's own metadata inside ``_node_content``, so that a filter on
them means what it means in memory; other keys are read from ``metadata_`` directly, where a filter on a
string value also gives the GIN index (``jsonb_path_ops``) a containment test to search with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Union

from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters

from llama_index_crag.errors import MissingDependency, ScopeError
from llama_index_crag.scope import Scope

try:  # the [postgres] extra; the translator itself needs only the composition module
    from psycopg import sql
except ImportError:  # pragma: no cover - checked where the store connects
    sql = None  # type: ignore[assignment]

#: Keys that LlamaIndex's node layout writes into the chunks' ``metadata_`` beside (and over) the node's own.
LAYOUT_KEYS = frozenset({"_node_content", "_node_type", "document_id", "doc_id", "ref_doc_id"})
#: Numbers are compared as ``float8``: exact for every float, and for integers below this magnitude.
MAX_EXACT_NUMBER = 2**53
#: At most this many values of an ``IN`` on strings get a containment test each, for the GIN index.
MAX_HINTED_VALUES = 32
#: Non-ASCII characters whose Python ``lower()`` holds ASCII (found by scanning every code point; a test checks).
ASCII_FOLDS = {"\u0130": "i\u0307", "\u212a": "k"}

Number = Union[int, float]


@dataclass(frozen=True)
class SqlScope:
    """A scope compiled for one table: ``clause`` (a boolean SQL expression) and the values it names."""

    clause: Any  # psycopg.sql.Composable
    params: Dict[str, Any] = field(default_factory=dict)
    bounded: bool = False


def scope_sql(scope: Optional[Scope], table: str = "chunks", column: str = "metadata_", prefix: str = "s") -> SqlScope:
    """``scope`` as a condition on the JSONB ``column`` of ``table`` (``chunks`` or ``windows``), or a
    ``ScopeError`` naming the filter that cannot be applied exactly.

    The placeholders are named ``<prefix><n>``: give the query's own parameters other names.
    """
    if table not in ("chunks", "windows"):
        raise ValueError(f"table must be 'chunks' or 'windows', not {table!r}")
    if sql is None:
        raise MissingDependency("the PostgreSQL store needs psycopg: pip install 'llama-index-crag[postgres]'")
    if scope is None or scope.filters is None:
        return SqlScope(sql.SQL("TRUE"))
    compiler = _Compiler(sql.Identifier(*column.split(".")), layout=table == "chunks", prefix=prefix)
    clause = compiler.group(scope.filters)
    return SqlScope(clause, compiler.params, bounded=True)


class _Compiler:
    def __init__(self, column: Any, layout: bool, prefix: str) -> None:
        self.column = column
        self.layout = layout
        self.prefix = prefix
        self.params: Dict[str, Any] = {}
        self._aliases = 0

    # --- values and names --------------------------------------------------------------------------------------

    def param(self, value: Any, cast: str) -> Any:
        name = f"{self.prefix}{len(self.params)}"
        self.params[name] = value
        return sql.SQL("{}::" + cast).format(sql.Placeholder(name))

    def alias(self) -> Any:
        self._aliases += 1
        return sql.Identifier(f"_{self.prefix}e{self._aliases}")

    # --- groups ------------------------------------------------------------------------------------------------

    def group(self, filters: MetadataFilters) -> Any:
        if not isinstance(filters, MetadataFilters):
            raise ScopeError(f"filters: expected MetadataFilters, not {type(filters).__name__}")
        parts = [self.group(f) if isinstance(f, MetadataFilters) else self.leaf(f) for f in filters.filters]
        condition = filters.condition or FilterCondition.AND
        if not parts:  # as Scope.admits: an empty group admits everything, whatever its condition
            return sql.SQL("TRUE")
        if condition == FilterCondition.AND:
            return sql.SQL("({})").format(sql.SQL(" AND ").join(parts))
        if condition == FilterCondition.OR:
            return sql.SQL("({})").format(sql.SQL(" OR ").join(parts))
        if condition == FilterCondition.NOT:
            return sql.SQL("(NOT ({}))").format(sql.SQL(" OR ").join(parts))
        raise ScopeError(f"filters: unknown condition {condition!r}")

    # --- one filter --------------------------------------------------------------------------------------------

    def leaf(self, f: MetadataFilter) -> Any:
        if not isinstance(f, MetadataFilter):
            raise ScopeError(f"filters: expected a MetadataFilter, not {type(f).__name__}")
        if not isinstance(f.key, str):
            raise ScopeError(f"filters: a key must be a string, not {f.key!r}")
        value = _checked_value(f)
        try:
            op = FilterOperator(f.operator)
        except ValueError:
            raise ScopeError(f"filters.{f.key}: unknown operator {f.operator!r}") from None
        key = self.param(f.key, "text")
        if self.layout and f.key in LAYOUT_KEYS:  # the node's own value, not the layout's copy
            j = sql.SQL("((({} ->> '_node_content')::jsonb -> 'metadata') -> {})").format(self.column, key)
        else:
            j = sql.SQL("({} -> {})").format(self.column, key)
        exact = self._operator(op, j, value, f)
        hint = self._hint(op, f.key, value)
        if hint is not None:  # a necessary condition the GIN index can search with; the exact test decides
            return sql.SQL("({} AND {})").format(hint, exact)
        return exact

    def _operator(self, op: FilterOperator, j: Any, value: Any, f: MetadataFilter) -> Any:
        if op == FilterOperator.IS_EMPTY:
            return sql.SQL("({} OR {} = '\"\"'::jsonb OR {} = '[]'::jsonb)").format(_absent(j), j, j)
        if op == FilterOperator.EQ:
            return self.eq(j, value)
        if op == FilterOperator.NE:
            return sql.SQL("({} OR NOT {})").format(_absent(j), self.eq(j, value))
        if op in _ORDER:
            return self.order(j, op, value, f)
        if op == FilterOperator.IN:
            return self.inside(j, value)
        if op == FilterOperator.NIN:
            if isinstance(value, list):
                return sql.SQL("({} OR NOT {})").format(_absent(j), self.inside(j, value))
            if isinstance(value, str):  # ``value not in "..."``: defined for a string value only
                return sql.SQL("({} OR coalesce(strpos({}, {}) = 0, false))").format(
                    _absent(j), self.param(value, "text"), _text(j)
                )
            return _absent(j)  # ``in`` a number or None raises: only a missing key is admitted
        if op == FilterOperator.CONTAINS:
            return self.contains(j, value)
        if op == FilterOperator.TEXT_MATCH:
            if not isinstance(value, str):
                return sql.SQL("FALSE")
            return sql.SQL("coalesce(strpos({}, {}) > 0, false)").format(_text(j), self.param(value, "text"))
        if op == FilterOperator.TEXT_MATCH_INSENSITIVE:
            if not isinstance(value, str):
                return sql.SQL("FALSE")
            if not value.isascii():
                raise ScopeError(
                    f"filters.{f.key}: a case-insensitive match on {value!r} cannot be applied in PostgreSQL exactly "
                    "(its case mapping of non-ASCII letters is not Python's): match the case (text_match) or store "
                    "the value lower-cased under another key"
                )
            folded = _text(j)
            for char, fold in ASCII_FOLDS.items():
                folded = sql.SQL("replace({}, {}, {})").format(folded, _chars(char), _chars(fold))
            return sql.SQL('coalesce(strpos(lower({} COLLATE "C"), {}) > 0, false)').format(
                folded, self.param(value.lower(), "text")
            )
        if op in (FilterOperator.ANY, FilterOperator.ALL):
            return self.any_all(j, value, every=op == FilterOperator.ALL)
        raise ScopeError(f"filters.{f.key}: the operator {op.value!r} cannot be applied in PostgreSQL")

    # --- the operators -----------------------------------------------------------------------------------------

    def eq(self, j: Any, value: Any) -> Any:
        """``j == value`` in Python (never NULL)."""
        if value is None:
            return sql.SQL("FALSE")  # a None value is absent, and absent admits only NE/NIN
        if isinstance(value, str):
            return self.eq_scalar(j, self.param(value, "text"), text=True)
        if isinstance(value, list):
            if not value:
                return sql.SQL("coalesce({} = '[]'::jsonb, false)").format(j)
            text = isinstance(value[0], str)
            values = self.param(list(value) if text else [float(v) for v in value], "text[]" if text else "float8[]")
            e, u = self.alias(), self.alias()
            return sql.SQL(
                "(CASE WHEN jsonb_typeof({j}) = 'array' THEN CASE WHEN jsonb_array_length({j}) = {n} THEN "
                "coalesce((SELECT bool_and({same}) FROM jsonb_array_elements({j}) WITH ORDINALITY AS {e}(value, i) "
                "JOIN unnest({values}) WITH ORDINALITY AS {u}(x, i) USING (i)), false) "
                "ELSE false END ELSE false END)"
            ).format(
                j=j,
                n=self.param(len(value), "int"),
                same=self.eq_scalar(sql.SQL("{}.value").format(e), sql.SQL("{}.x").format(u), text=text),
                e=e,
                values=values,
                u=u,
            )
        return self.eq_scalar(j, self.param(float(value), "float8"), text=False)

    @staticmethod
    def eq_scalar(j: Any, x: Any, text: bool) -> Any:
        """``j == x`` for an SQL text (``text``) or float8 ``x``; JSON ``true``/``false`` equal 1 and 0."""
        return sql.SQL("coalesce({} = {}, false)").format(_text(j) if text else _number(j), x)

    def order(self, j: Any, op: FilterOperator, value: Any, f: MetadataFilter) -> Any:
        if value is None:
            return sql.SQL("FALSE")  # ``x > None`` raises
        if isinstance(value, list):
            raise ScopeError(
                f"filters.{f.key}: {op.value!r} with a list compares lists element by element, which "
                "PostgreSQL cannot do as Python does: compare with a number or a string"
            )
        if isinstance(value, str):
            return sql.SQL('coalesce({} COLLATE "C" {} {}, false)').format(
                _text(j), sql.SQL(_ORDER[op]), self.param(value, "text")
            )
        return sql.SQL("coalesce({} {} {}, false)").format(
            _number(j), sql.SQL(_ORDER[op]), self.param(float(value), "float8")
        )

    def inside(self, j: Any, value: Any) -> Any:
        """``j in value`` in Python (never NULL)."""
        if isinstance(value, list):
            if not value:
                return sql.SQL("FALSE")
            if isinstance(value[0], str):
                return sql.SQL("coalesce({} = ANY({}), false)").format(_text(j), self.param(list(value), "text[]"))
            return sql.SQL("coalesce({} = ANY({}), false)").format(
                _number(j), self.param([float(v) for v in value], "float8[]")
            )
        if isinstance(value, str):  # a substring of the filter's string
            return sql.SQL("coalesce(strpos({}, {}) > 0, false)").format(self.param(value, "text"), _text(j))
        return sql.SQL("FALSE")  # ``in`` a number or None raises

    def contains(self, j: Any, value: Any) -> Any:
        """``value in j`` in Python: a substring of a string, an element of a list, a key of an object."""
        e = self.alias()
        element = sql.SQL("{}.value").format(e)
        if value is None:
            member = sql.SQL("jsonb_typeof({}) = 'null'").format(element)
        elif isinstance(value, list):
            member = self.eq(element, value)
        elif isinstance(value, str):
            member = self.eq_scalar(element, self.param(value, "text"), text=True)
        else:
            member = self.eq_scalar(element, self.param(float(value), "float8"), text=False)
        in_list = sql.SQL("EXISTS (SELECT 1 FROM jsonb_array_elements({}) AS {}(value) WHERE {})").format(j, e, member)
        if isinstance(value, str):
            needle = self.param(value, "text")
            return sql.SQL(
                "(CASE jsonb_typeof({j}) WHEN 'string' THEN strpos({j} #>> '{{}}', {needle}) > 0 "
                "WHEN 'array' THEN {in_list} WHEN 'object' THEN jsonb_exists({j}, {needle}) ELSE false END)"
            ).format(j=j, needle=needle, in_list=in_list)
        # A number or None is never a key of a JSON object (keys are strings), and ``x in "..."`` raises for them;
        # a list cannot be a key (unhashable) nor a substring.
        return sql.SQL("(CASE jsonb_typeof({}) WHEN 'array' THEN {} ELSE false END)").format(j, in_list)

    def any_all(self, j: Any, value: Any, every: bool) -> Any:
        """``any(v in j for v in value)`` (or ``all``); iterating a string iterates its characters."""
        if isinstance(value, str):
            value = sorted(set(value))
        if not isinstance(value, list):
            return sql.SQL("FALSE")  # iterating a number or None raises
        if not value:
            return sql.SQL("(NOT {})").format(_absent(j)) if every else sql.SQL("FALSE")
        e, x = self.alias(), self.alias()
        element = sql.SQL("{}.value").format(e)
        if isinstance(value[0], str):
            values = self.param(sorted(set(value)), "text[]")
            in_list = sql.SQL("EXISTS (SELECT 1 FROM jsonb_array_elements({j}) AS {e}(value) WHERE {same})").format(
                j=j, e=e, same=self.eq_scalar(element, sql.SQL("{}.x").format(x), text=True)
            )
            in_text = sql.SQL("strpos({} #>> '{{}}', {}.x) > 0").format(j, x)
            quantified = _quantified(every, values, x, in_list, in_text)
            keys = sql.SQL("jsonb_exists_all({}, {})" if every else "jsonb_exists_any({}, {})").format(j, values)
            return sql.SQL(
                "(CASE jsonb_typeof({j}) WHEN 'string' THEN {text} WHEN 'array' THEN {list} "
                "WHEN 'object' THEN {keys} ELSE false END)"
            ).format(j=j, text=quantified["text"], list=quantified["list"], keys=keys)
        values = self.param(sorted({float(v) for v in value}), "float8[]")
        in_list = sql.SQL("EXISTS (SELECT 1 FROM jsonb_array_elements({j}) AS {e}(value) WHERE {same})").format(
            j=j, e=e, same=self.eq_scalar(element, sql.SQL("{}.x").format(x), text=False)
        )
        # ``1 in "..."`` raises; a number is never an object's key: only a list can hold them.
        return sql.SQL("(CASE jsonb_typeof({}) WHEN 'array' THEN {} ELSE false END)").format(
            j, _quantified(every, values, x, in_list, None)["list"]
        )

    # --- the GIN index -----------------------------------------------------------------------------------------

    def _hint(self, op: FilterOperator, key: str, value: Any) -> Optional[Any]:
        """A containment test implied by the filter, for the GIN index on ``metadata_`` (strings only: a JSON
        number can be written in more than one way, and ``true`` equals 1)."""
        if self.layout and key in LAYOUT_KEYS:
            return None
        from psycopg.types.json import Jsonb

        if op == FilterOperator.EQ and isinstance(value, str):
            return sql.SQL("{} @> {}").format(self.column, self.param(Jsonb({key: value}), "jsonb"))
        if op == FilterOperator.IN and isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) > MAX_HINTED_VALUES:
                return None
            tests = [
                sql.SQL("{} @> {}").format(self.column, self.param(Jsonb({key: v}), "jsonb"))
                for v in sorted(set(value))
            ]
            return sql.SQL("({})").format(sql.SQL(" OR ").join(tests))
        return None


_ORDER = {
    FilterOperator.GT: ">",
    FilterOperator.GTE: ">=",
    FilterOperator.LT: "<",
    FilterOperator.LTE: "<=",
}


def _quantified(every: bool, values: Any, x: Any, in_list: Any, in_text: Optional[Any]) -> Dict[str, Any]:
    """``any``/``all`` of the filter's ``values`` (unnested as ``x``) by membership in a list and in a string."""
    forms = {"list": in_list, **({"text": in_text} if in_text is not None else {})}
    if every:
        return {
            name: sql.SQL("NOT EXISTS (SELECT 1 FROM unnest({}) AS {}(x) WHERE NOT ({}))").format(values, x, test)
            for name, test in forms.items()
        }
    return {
        name: sql.SQL("EXISTS (SELECT 1 FROM unnest({}) AS {}(x) WHERE {})").format(values, x, test)
        for name, test in forms.items()
    }


def _absent(j: Any) -> Any:
    """The key is missing or JSON ``null`` (Python's ``metadata.get(key)`` is None)."""
    return sql.SQL("(coalesce(jsonb_typeof({}), 'null') = 'null')").format(j)


def _text(j: Any) -> Any:
    """The JSON value as text where it is a string; NULL otherwise."""
    return sql.SQL("(CASE WHEN jsonb_typeof({j}) = 'string' THEN {j} #>> '{{}}' END)").format(j=j)


def _number(j: Any) -> Any:
    """The JSON value as float8 where it is a number, 1 or 0 where it is a boolean (as in Python); NULL otherwise."""
    return sql.SQL(
        "(CASE jsonb_typeof({j}) WHEN 'number' THEN ({j})::float8 "
        "WHEN 'boolean' THEN CASE WHEN {j} = 'true'::jsonb THEN 1::float8 ELSE 0::float8 END END)"
    ).format(j=j)


def _chars(text: str) -> Any:
    """A constant string of the translator's as ``chr()`` calls (no literal non-ASCII text in the SQL)."""
    return sql.SQL(" || ").join(sql.SQL("chr({})").format(sql.Literal(ord(c))) for c in text)


def _checked_value(f: MetadataFilter) -> Any:
    """The filter's value, if it is one LlamaIndex's filters allow and PostgreSQL compares exactly."""
    value: Any = f.value
    if value is None or isinstance(value, str):
        return _checked_text(f, value) if isinstance(value, str) else None
    if _is_number(value):
        return _checked_number(f, value)
    if isinstance(value, (list, tuple)):
        items: Sequence[Any] = list(value)
        if all(isinstance(v, str) for v in items):
            return [_checked_text(f, v) for v in items]
        if all(_is_number(v) for v in items):
            return [_checked_number(f, v) for v in items]
        raise ScopeError(f"filters.{f.key}: a list value must hold only strings or only numbers")
    raise ScopeError(
        f"filters.{f.key}: a value of type {type(value).__name__} cannot be compared: use a string, a number, "
        "or a list of them"
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _checked_number(f: MetadataFilter, value: Number) -> Number:
    if not math.isfinite(value) or abs(value) >= MAX_EXACT_NUMBER:
        raise ScopeError(
            f"filters.{f.key}: the number {value!r} cannot be compared exactly in PostgreSQL "
            f"(finite numbers below 2**53 in magnitude can)"
        )
    return value


def _checked_text(f: MetadataFilter, value: str) -> str:
    if "\x00" in value:
        raise ScopeError(f"filters.{f.key}: a value with a NUL character cannot be stored or compared")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ScopeError(f"filters.{f.key}: {value!r} is not valid Unicode text") from None
    return value
