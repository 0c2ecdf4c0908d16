"""Argument types of ``llama-crag``: a count, a port or a time that cannot be used is refused by argparse, in one
line, before any model loads (``--limit -1`` would otherwise slice from the end, ``--query-timeout 0`` cut off
every query); and its parsers, whose help shows every default."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable, Optional, Sequence, Union

from llama_index_crag.core.settings import MAX_TIMEOUT_S

#: uvicorn's log levels.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _number(text: str, kind: type) -> float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None


def at_least(least: int) -> Callable[[str], int]:
    """A whole number of at least ``least``."""

    def parse(text: str) -> int:
        value = int(_number(text, int))
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}")
        return value

    parse.__name__ = f"a whole number >= {least}"  # what argparse names in its error
    return parse


positive_int = at_least(1)


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    value = int(_number(text, int))
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0 to 65535)")
    return value


def seconds(text: str) -> float:
    """A time in seconds, more than 0 and at most a day."""
    value = float(_number(text, float))
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise argparse.ArgumentTypeError(f"{text} is not a time in seconds (more than 0, at most {MAX_TIMEOUT_S:g})")
    return value


def http_url(text: str) -> str:
    """An http(s) URL with a host (a server's address): ``http://[::1`` or ``localhost:11434`` is refused here
    rather than taken for a server that does not answer."""
    import httpx

    try:
        url = httpx.URL(text)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid URL ({exc})") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL with a host, such as http://localhost:11434")
    return text


http_url.__name__ = "an http(s) URL"


class DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Help that ends each option with ``(default: ...)`` where it has a default to show: not for a flag, a
    repeatable option or one whose default is worked out when the command runs (None: its help says how)."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        default = action.default
        if default is None or isinstance(default, bool) or default in ("", []):
            return action.help
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """``llama-crag``'s parser and, through ``add_subparsers``, every command's: help shows the defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)


class RenamedOption(argparse.Action):
    """An option's former name: still read, into the new one's ``dest``, with a warning that names the new one.

    Add it after the new option, with ``help=argparse.SUPPRESS`` so that ``--help`` shows only the new name.
    """

    def __init__(self, option_strings: Sequence[str], dest: str, renamed_to: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.renamed_to = renamed_to

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Union[str, Sequence[Any], None],
        option_string: Optional[str] = None,
    ) -> None:
        print(f"{parser.prog}: {option_string} is deprecated: use {self.renamed_to}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_store_options(parser: argparse.ArgumentParser, store_help: str) -> None:
    """``--index``, ``--store`` and ``--table``: what a command reads, an index folder or a PostgreSQL store
    (``require_one_store`` checks that exactly one is given)."""
    parser.add_argument("--index", default="", help="index folder written by llama-crag ingest")
    parser.add_argument("--store", default=None, metavar="URL", help=store_help)
    parser.add_argument("--table", default="crag", help="the store's name in PostgreSQL (with --store)")


def require_one_store(args: argparse.Namespace, command: str) -> None:
    """Refuse ``command`` unless exactly one of ``--index`` and ``--store`` is given."""
    from llama_index_crag.errors import ConfigError

    if bool(args.index) == bool(args.store):
        raise ConfigError(f"{command} needs either --index INDEX_DIR or --store postgresql://...")
