"""The ``llama-crag`` command line: the parser and the entry point; each command lives in the module named for it."""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from typing import ContextManager, Optional, Sequence

from llama_index_crag.arguments import CommandParser
from llama_index_crag.cli import ask, demo, grading, store
from llama_index_crag.errors import CragError
from llama_index_crag.evaluation.command import add_eval_parser
from llama_index_crag.local.cores import torch_on_usable_cores


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``llama-crag`` (every command's help shows its options' defaults)."""
    parser = CommandParser(prog="llama-crag", description="Corrective RAG for LlamaIndex.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_parsers(commands)
    grading.add_parsers(commands)
    store.add_parsers(commands)
    ask.add_parsers(commands)
    add_eval_parser(commands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``llama-crag``: a problem the user can fix (a ``CragError``, a missing optional package
    included, a missing file such as a dataset, an output path that is a file, a folder or read-only) is printed
    as one line and exits 2; anything else is a bug and keeps its traceback.

    Every command but ``serve`` runs torch on the cores this process may use (a container's CPU quota
    included) unless ``OMP_NUM_THREADS`` says otherwise."""
    args = build_parser().parse_args(argv)
    # serve shares the cores out among its workers itself.
    threads: ContextManager[None] = torch_on_usable_cores() if args.command != "serve" else nullcontext()
    try:
        with threads:
            return int(args.run(args))
    except (CragError, FileNotFoundError, FileExistsError, NotADirectoryError) as exc:  # a path the user named
        print(f"llama-crag: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path that cannot be written: a folder, read-only, not ours; not a bug
        if exc.filename is None:
            raise
        print(f"llama-crag: cannot write or read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
