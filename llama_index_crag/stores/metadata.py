"""A document's own metadata, as ``llama-crag ingest`` reads it: front matter, a sidecar file, the command line.

Applications narrow what a reader may see with LlamaIndex ``MetadataFilters`` (a tenant, a team, a year);
those keys have to be on the documents first. Three places give them:

- YAML front matter at the top of a Markdown file (``---`` lines around it); it is taken out of the text,
  and its ``title`` becomes the document's title;
- a sidecar ``NAME.meta.json`` beside any file (``handbook.html.meta.json`` for ``handbook.html``), one JSON
  object; the sidecar is never read as a document itself;
- ``--metadata KEY=VALUE`` on the command line, for every document of the run.

Where they name the same key the command line wins, then the sidecar, then the front matter: the person who
runs the ingest decides what a folder belongs to (a file dropped into ``acme/`` cannot move itself into
another tenant's scope by its own front matter), and a sidecar is kept apart from the text its authors edit.

A value is a string, a number, a boolean, a date (stored as its ISO text, ``2024-05-01``, so that it stays
JSON and compares as text) or a list of those. A nested object, a null or anything else is refused, key by
key, with a note: filters cannot compare them. The keys ``doc_id`` and ``file_name``, and every key that
begins with ``crag``, are this package's own and are never taken from a document.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from datetime import date, datetime
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from llama_index.core import Document

from llama_index_crag.errors import ConfigError
from llama_index_crag.text.cleaning import clean_text

#: Keys the package sets itself on every document; with every key that begins with ``RESERVED_PREFIX``.
RESERVED_KEYS = ("doc_id", "file_name")
RESERVED_PREFIX = "crag"
#: The name ending of a sidecar: ``handbook.html.meta.json`` holds the metadata of ``handbook.html``.
SIDECAR_SUFFIX = ".meta.json"
#: Files whose YAML front matter is read.
MARKDOWN_SUFFIXES = (".md", ".markdown")
#: The one user key that stays in the text the embedding model and the LLM read.
TITLE = "title"

_OPENING = re.compile(r"---[ \t]*\r?\n")
_CLOSING = re.compile(r"^---[ \t]*\r?$", re.M)
_INTEGER = re.compile(r"[-+]?(0|[1-9][0-9]*)")
_FLOAT = re.compile(r"[-+]?[0-9]+\.[0-9]+")


def is_reserved(key: str) -> bool:
    """Whether ``key`` is one the package sets itself (``doc_id``, ``file_name``, ``crag...``)."""
    return key in RESERVED_KEYS or key.lower().startswith(RESERVED_PREFIX)


def is_sidecar(path: Path) -> bool:
    """Whether ``path`` is a sidecar (``NAME.meta.json``) rather than a document."""
    return path.name.lower().endswith(SIDECAR_SUFFIX) and len(path.name) > len(SIDECAR_SUFFIX)


def sidecar_of(path: Path) -> Path:
    """The sidecar that would hold the metadata of ``path``."""
    return path.with_name(path.name + SIDECAR_SUFFIX)


def document_of(sidecar: Path) -> Path:
    """The file a sidecar describes."""
    return sidecar.with_name(sidecar.name[: -len(SIDECAR_SUFFIX)])


def metadata_value(value: Any) -> Any:
    """``value`` as metadata keeps it, or a ``ValueError`` whose message ends "key ... " in a note.

    Strings, numbers and booleans stay as they are (a string cleaned as document text is); a date or a
    date and time becomes its ISO text; a list keeps its items, each of those kinds. Refused: a nested object,
    a list holding lists or objects, a null, a number that is not finite, anything else.
    """
    if isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("is not a finite number")
        return value
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, (date, datetime)):  # a datetime is a date too: both have isoformat()
        return value.isoformat()
    if isinstance(value, Mapping):
        raise ValueError("is a nested object, which filters cannot use: give each field a key of its own")
    if isinstance(value, (list, tuple)):
        if any(isinstance(item, (list, tuple, Mapping)) for item in value):
            raise ValueError("is a list holding lists or objects, which filters cannot use: list plain values")
        if any(item is None for item in value):
            raise ValueError("is a list holding a null")
        return [metadata_value(item) for item in value]
    if value is None:
        raise ValueError("has no value")
    raise ValueError(f"is a {type(value).__name__}, not a string, number, boolean, date or list of them")


def clean_metadata(raw: Mapping[Any, Any], where: str, notes: List[str], outcome: str = ": ignored") -> Dict[str, Any]:
    """The usable keys of ``raw`` (read from ``where``, e.g. "a.md (front matter)"); a note for each one refused,
    ending in ``outcome``."""
    kept: Dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key.strip():
            notes.append(f"{where}: the key {key!r} is not a name{outcome}")
            continue
        if is_reserved(key):
            notes.append(f"{where}: {key} is reserved (doc_id, file_name and crag* are set by llama-crag){outcome}")
            continue
        try:
            cleaned = metadata_value(value)
            if key == TITLE:
                if isinstance(cleaned, list):
                    raise ValueError("is a list, not a title")
                cleaned = str(cleaned)
        except ValueError as exc:
            notes.append(f"{where}: {key} {exc}{outcome}")
            continue
        kept[key] = cleaned
    return kept


def split_front_matter(text: str) -> Tuple[str, Optional[str]]:
    """``text`` without its front matter, and the front matter (None when the text opens with none).

    Front matter is a first line ``---``, then the YAML, then a line ``---``; a text that opens with ``---``
    but never closes it has none.
    """
    body = text[1:] if text.startswith("\ufeff") else text
    opening = _OPENING.match(body)
    if opening is None:
        return text, None
    closing = _CLOSING.search(body, opening.end())
    if closing is None:
        return text, None
    # the closing line's own line break goes with it; when the YAML is empty the break before it is the opening's
    block = body[opening.end() : max(closing.start() - 1, opening.end())]
    rest = body[closing.end() :]
    return rest[1:] if rest.startswith("\n") else rest, block


def read_front_matter(text: str, name: str, notes: List[str]) -> Tuple[str, Dict[str, Any]]:
    """A Markdown text without its front matter, and the metadata the front matter gives.

    Front matter that is not valid YAML, or not a mapping, is dropped from the text all the same and gives no
    metadata; a note says so.
    """
    import yaml

    body, block = split_front_matter(text)
    if block is None:
        return text, {}
    try:
        loaded = yaml.safe_load(block)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 2})" if mark is not None else ""  # +1: counted from 0, +1: the opening ---
        notes.append(f"{name}: its front matter is not valid YAML{at}: ingested without its metadata")
        return body, {}
    if loaded is None:
        return body, {}
    if not isinstance(loaded, dict):
        notes.append(
            f"{name}: its front matter is a YAML {type(loaded).__name__}, not a mapping of keys: "
            "ingested without its metadata"
        )
        return body, {}
    return body, clean_metadata(loaded, f"{name} (front matter)", notes)


def read_sidecar(path: Path, name: str, notes: List[str]) -> Dict[str, Any]:
    """The metadata of the sidecar ``path`` (``name``: how notes name it); none, with a note, if it is unusable."""
    try:
        loaded = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        reason = f"{exc.msg} at line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        notes.append(f"{name}: not valid JSON ({reason}): its document is ingested without it")
        return {}
    if not isinstance(loaded, dict):
        notes.append(
            f"{name}: a JSON {type(loaded).__name__}, not an object of keys: its document is ingested without it"
        )
        return {}
    return clean_metadata(loaded, name, notes)


def parse_value(text: str) -> Any:
    """A command-line value: ``true``/``false`` a boolean, ``12`` or ``-3`` an integer, ``0.5`` a float, anything
    else the text as written (``007`` and ``1e3`` stay text; there is no list syntax: repeat the key)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if _INTEGER.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return clean_text(text)


def metadata_pair(text: str) -> Tuple[str, Any]:
    """``--metadata KEY=VALUE``: the key and its parsed value; argparse names the option in the error."""
    key, equals, value = text.partition("=")
    key = key.strip()
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    if is_reserved(key):
        raise argparse.ArgumentTypeError(f"{key} is reserved: doc_id, file_name and crag* are set by llama-crag")
    return key, parse_value(value)


def pairs_metadata(pairs: Sequence[Tuple[str, Any]]) -> Dict[str, Any]:
    """Repeated ``--metadata`` pairs as one mapping: a key given more than once holds the list of its values."""
    merged: Dict[str, Any] = {}
    for key, value in pairs:
        if key not in merged:
            merged[key] = value
        elif isinstance(merged[key], list):
            merged[key].append(value)
        else:
            merged[key] = [merged[key], value]
    return merged


def checked_metadata(metadata: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The metadata an ingest is given for all its documents, or a ``ConfigError`` naming every key refused."""
    if not metadata:
        return {}
    if not isinstance(metadata, Mapping):
        raise ConfigError(f"metadata must be a mapping of keys to values, not {type(metadata).__name__}")
    notes: List[str] = []
    kept = clean_metadata(metadata, "metadata", notes, outcome="")
    if notes:
        raise ConfigError("; ".join(notes))
    return kept


def document_with(
    text: str, doc_id: str, base: Dict[str, Any], own: Dict[str, Any], given: Dict[str, Any], notes: List[str]
) -> Document:
    """A document with the package's keys ``base``, then its title and its own keys (``given`` winning over
    ``own``, with a note where it replaces a value), all but the title hidden from the embedding and the LLM.

    The user's keys are sorted, so that the same metadata written in another order hashes the same."""
    user = dict(own)
    for key, value in given.items():
        if key in user and user[key] != value:
            notes.append(f"{doc_id}: its {key}={user[key]!r} is replaced by the ingest's --metadata {key}={value!r}")
        user[key] = value
    metadata = dict(base)
    if TITLE in user:
        metadata[TITLE] = user.pop(TITLE)
    metadata.update(sorted(user.items()))
    hidden = ["doc_id", *sorted(user)]
    return Document(
        text=text,
        id_=doc_id,
        metadata=metadata,
        excluded_embed_metadata_keys=hidden,
        excluded_llm_metadata_keys=list(hidden),
    )


def described(metadata: Mapping[str, Any]) -> str:
    """Metadata as ``--metadata`` would be written for it, for notes."""
    return " ".join(f"{k}={v!r}" for k, v in metadata.items()) or "no --metadata"
