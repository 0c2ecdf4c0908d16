"""The server's API keys and what each may read: ``--api-keys FILE`` (``CRAG_API_KEYS_FILE``), or ``CRAG_API_KEY``.

The keys file is a JSON object from each key to its entry::

    {"k-acme-7Qv1c0mXW2pLr8sT": {"name": "acme", "filters": {"tenant": "acme"}},
     "k-ops-Zr4nY9bKe6uHq3dA": {"name": "ops"}}

``name`` says who the caller is (in the trace and the logs, never the key; the recent queries are
kept per name); ``filters`` (LlamaIndex ``MetadataFilters`` JSON or the ``{key: value}`` shorthand,
as ``llama_index_crag.scope.as_filters`` reads them) bounds every query of the key, and a request's
own filters only narrow it. An entry without ``filters`` reads everything. A file that cannot be
used is refused whole, saying why: the server never starts with a key whose scope it misread.

Keys are compared in constant time: each given key is hashed and compared with every key's hash,
all of them, whichever matches.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

from llama_index_crag.errors import ConfigError, ScopeError
from llama_index_crag.scope import UNBOUNDED, Scope

#: The environment variable naming the keys file when ``--api-keys`` is not given.
KEYS_FILE_ENV = "CRAG_API_KEYS_FILE"
#: The environment variable holding the server's one key with no scope.
KEY_ENV = "CRAG_API_KEY"
#: The shortest key a keys file may hold.
MIN_KEY_CHARS = 16
#: The longest name of a caller.
MAX_NAME_CHARS = 100
#: The name of ``CRAG_API_KEY``'s caller.
SINGLE_KEY_NAME = "default"
#: The fields of an entry.
ENTRY_FIELDS = ("name", "filters")
#: How to make a key, for the messages.
MAKE_KEY = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


@dataclass(frozen=True)
class Caller:
    """Who asks: the name of the key it holds (None: the server has no key) and the scope that key reads."""

    name: Optional[str]
    scope: Scope = UNBOUNDED


#: The caller of a server without keys: everyone, reading everything.
ANYONE = Caller(None)


class KeysFileError(ConfigError):
    """A keys file the server cannot use; the message names the file and what is wrong."""


class _Pairs(dict):  # type: ignore[type-arg]
    """A JSON object as parsed, with its members in order, duplicates kept (``json.loads``'s last one wins)."""

    pairs: List[Tuple[str, Any]]


def _pairs(pairs: List[Tuple[str, Any]]) -> _Pairs:
    found = _Pairs(pairs)
    found.pairs = pairs
    return found


def _repeated(obj: Any) -> Optional[str]:
    """The first member name that appears twice in ``obj`` or any object inside it."""
    if isinstance(obj, _Pairs):
        seen = set()
        for name, value in obj.pairs:
            if name in seen:
                return name
            seen.add(name)
            inner = _repeated(value)
            if inner is not None:
                return inner
    elif isinstance(obj, list):
        for value in obj:
            inner = _repeated(value)
            if inner is not None:
                return inner
    return None


def _plain(obj: Any) -> Any:
    """``obj`` as plain dicts and lists (the members of a ``_Pairs`` in their order)."""
    if isinstance(obj, dict):
        return {name: _plain(value) for name, value in obj.items()}
    if isinstance(obj, list):
        return [_plain(value) for value in obj]
    return obj


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    """The server's keys, each with its caller; ``caller(given)`` is the caller a request's key names, or None."""

    def __init__(self, entries: Iterable[Tuple[str, Caller]], source: str) -> None:
        self._entries = [(_digest(key), caller) for key, caller in entries]
        #: Where the keys came from (a file, or ``CRAG_API_KEY``), for messages; never a key.
        self.source = source
        if not self._entries:
            raise KeysFileError(f"{source} holds no key: a server with keys needs at least one")

    @classmethod
    def single(cls, key: str, source: str = KEY_ENV) -> ApiKeys:
        """One key with no scope (``CRAG_API_KEY``)."""
        return cls([(key, Caller(SINGLE_KEY_NAME))], source)

    @property
    def callers(self) -> List[Caller]:
        """Every key's caller, in the file's order (no key)."""
        return [caller for _, caller in self._entries]

    def caller(self, given: str) -> Optional[Caller]:
        """The caller whose key is ``given``, or None; every key is compared, in constant time, whichever matches."""
        digest = _digest(given)
        found: Optional[Caller] = None
        for known, caller in self._entries:
            if hmac.compare_digest(digest, known) and found is None:
                found = caller
        return found


def parse_api_keys(text: Union[str, bytes], source: str = "the keys file") -> ApiKeys:
    """The keys of a keys file's text, or a ``KeysFileError`` that says what is wrong (never quoting a key)."""
    where = source
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise KeysFileError(f"{where} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    try:
        parsed = json.loads(text, object_pairs_hook=_pairs)
    except json.JSONDecodeError as exc:
        raise KeysFileError(f"{where} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except RecursionError:
        raise KeysFileError(f"{where} is not usable JSON: nested too deep") from None
    if not isinstance(parsed, dict):
        raise KeysFileError(
            f"{where} holds a JSON {type(parsed).__name__}, not an object: write "
            '{"KEY": {"name": "...", "filters": {...}}, ...}'
        )
    assert isinstance(parsed, _Pairs)
    entries: List[Tuple[str, Caller]] = []
    scopes: Dict[str, Scope] = {}
    seen_keys: Dict[str, str] = {}
    for position, (key, entry) in enumerate(parsed.pairs, start=1):
        label = _label(entry, position)
        if key in seen_keys:
            raise KeysFileError(
                f"{where}: one key appears twice (the entries {seen_keys[key]} and {label}): each key must be "
                "written once, or one of its entries would be ignored"
            )
        seen_keys[key] = label
        caller = _entry(key, entry, label, where)
        known = scopes.get(caller.name or "")
        if known is not None and known.key != caller.scope.key:
            raise KeysFileError(
                f"{where}: two entries are named {caller.name!r} with different filters: the recent queries are "
                "kept per name, so one name must have one scope"
            )
        scopes[caller.name or ""] = caller.scope
        entries.append((key, caller))
    return ApiKeys(entries, where)


def _label(entry: Any, position: int) -> str:
    name = entry.get("name") if isinstance(entry, dict) else None
    if isinstance(name, str) and name.strip() and name.isprintable():
        return f"named {name.strip()[:MAX_NAME_CHARS]!r}"
    return f"number {position}"


def _entry(key: str, entry: Any, label: str, where: str) -> Caller:
    if len(key) < MIN_KEY_CHARS:
        raise KeysFileError(
            f"{where}: the key of the entry {label} is {len(key)} characters; a key needs at least "
            f"{MIN_KEY_CHARS} (make one with {MAKE_KEY})"
        )
    if not all("!" <= c <= "~" for c in key):
        raise KeysFileError(
            f"{where}: the key of the entry {label} holds a space, a control character or a character beyond "
            "ASCII: a key travels in an HTTP header, so it is printable ASCII without spaces"
        )
    if not isinstance(entry, dict):
        raise KeysFileError(
            f'{where}: the entry {label} is a JSON {type(entry).__name__}, not an object {{"name": ..., '
            '"filters": ...}'
        )
    repeated = _repeated(entry)
    if repeated is not None:
        raise KeysFileError(
            f"{where}: the entry {label} gives {repeated!r} twice in one object: which one holds would be a guess"
        )
    unknown = [field for field in entry if field not in ENTRY_FIELDS]
    if unknown:
        raise KeysFileError(
            f"{where}: the entry {label} has the unknown field {unknown[0]!r}: an entry holds only "
            f"{' and '.join(ENTRY_FIELDS)} (a misspelt filters would read everything)"
        )
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise KeysFileError(f'{where}: the entry {label} has no "name": every key names its caller')
    name = name.strip()
    if not name.isprintable() or len(name) > MAX_NAME_CHARS:
        raise KeysFileError(
            f"{where}: the entry {label} has a name with a control character or over {MAX_NAME_CHARS} characters "
            "(it is written to the logs)"
        )
    if "filters" not in entry:
        return Caller(name)
    if entry["filters"] is None:
        raise KeysFileError(
            f"{where}: the entry named {name!r} has filters null: leave filters out for a key that reads everything"
        )
    try:
        scope = Scope.of(_plain(entry["filters"]))
    except ScopeError as exc:
        raise KeysFileError(f"{where}: the entry named {name!r}: {exc}") from None
    return Caller(name, scope)


def load_api_keys(path: Union[str, Path]) -> ApiKeys:
    """The keys of the keys file at ``path``, or a ``KeysFileError`` naming the file and what is wrong."""
    where = f"the keys file {str(path)!r}"
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise KeysFileError(f"{where} cannot be read: {exc.strerror or exc}") from None
    return parse_api_keys(raw, where)


def server_keys(keys_file: Optional[str], single_key: Optional[str]) -> Optional[ApiKeys]:
    """The keys a server takes from its options and environment: the keys file (``keys_file``, else
    ``CRAG_API_KEYS_FILE``), or ``CRAG_API_KEY`` as one key with no scope, or None (no key: open).

    Both at once are refused: an unscoped key beside scoped ones is a choice to write into the file, as an entry
    without filters, not one to leave to an environment variable that may have been set for another purpose.
    """
    if keys_file and single_key:
        raise KeysFileError(
            f"both a keys file ({keys_file!r}) and {KEY_ENV} are set: put the unscoped key into the keys file "
            'as an entry without filters ({"KEY": {"name": "admin"}}) and unset ' + KEY_ENV
        )
    if keys_file:
        return load_api_keys(keys_file)
    if single_key:
        return ApiKeys.single(single_key)
    return None
