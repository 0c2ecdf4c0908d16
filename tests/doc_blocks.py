"""The fenced code blocks of README.md and docs/*.md, their markers, and how a shell block is prepared to run.

Every block fenced as ``python``, ``bash``, ``sh`` or ``console`` runs in ``tests/test_docs_examples.py``. The line
before its fence is a marker that says what the block needs::

    <!-- example: needs=index,llm -->
    <!-- example: slow needs=my-docs limit="train-grader --minutes 0.3; grade-report --limit 10" -->
    <!-- example: skip reason="needs a paid key" -->

Words of a marker:

- ``standalone``: needs nothing but the package.
- ``needs=a,b``: the context the runner provides (see ``NEEDS``).
- ``slow``: runs under ``-m slow`` only (a training run, a full evaluation, a fresh virtualenv).
- ``limit="CMD --flag value; CMD2 --flag value"``: before running, each command line of the block whose
  command is ``CMD`` (a ``llama-crag`` subcommand, or a script's file name such as ``bench_engine.py``) gets
  ``--flag value``, replacing the value it gave. Only for long runs, and visible here.
- ``env="NAME=value ..."``: variables set for the block (for example what ``make test`` passes to pytest).
- ``continues``: runs after the previous block of the same kind in the same file, in its namespace (Python) or
  its folder (shell), and needs what that one made.
- ``check=NAME``: after the block, the runner checks what it did (``CHECKS`` in the test module).
- ``skip reason="..."``: cannot run here at all. Only for what no loopback fake can stand in for.

Fences such as ``text``, ``json`` or ``promql`` are output, data or another language, and are not run.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = {"python": "python", "bash": "shell", "sh": "shell", "console": "shell"}
FLAGS = {"standalone", "slow", "continues", "skip"}
OPTIONS = {"needs", "limit", "env", "check", "reason"}
NEEDS = {
    # Python: names defined before the block runs.
    "index": "`index`: a VectorStoreIndex over the sample corpus with the bundled MiniLM; `CorrectiveQueryEngine`",
    "llm": "`llm`: LlamaIndex's MockLLM (a fixed, local stand-in for your LLM)",
    "engine": "`engine`: CorrectiveQueryEngine.from_defaults(index=index, llm=llm)",
    # Loopback servers speaking the real protocols.
    "ollama": "an Ollama API on 127.0.0.1:11434 (tests/ollama_server.py, the bundled SmolLM2 as `qwen2.5:3b`)",
    "searxng": "a SearxNG JSON API behind HTTP_PROXY on loopback: any host name reaches it, nothing leaves",
    "postgres": "PostgreSQL with pgvector on 127.0.0.1:5432 (tests/pg_server.py): role crag, database rag, "
    "PGHOSTADDR=127.0.0.1 so that the docs' host names connect there; for Python blocks the sample corpus is "
    "ingested into it",
    "server": "`llama-crag serve --llm none` on 127.0.0.1:8000 over the sample corpus",
    "hub-model": "a Hugging Face cache (HF_HOME, offline) holding a MiniLM cross-encoder stand-in under the "
    "model id the block names, and crag-calibration.json fitted for it",
    # Files in the block's folder.
    "my-docs": "my-docs/: the sample corpus as text files",
    "my-questions": "my-questions/: the sample corpus and its labelled questions (corpus.jsonl, questions.jsonl)",
    "my-corpus": "my-corpus/: the sample corpus alone (corpus.jsonl)",
    "my-app": "my_app.py: builds CorrectiveQueryEngine.from_defaults over the sample corpus, prints its scorer",
    "fresh-venv": "a new virtualenv first on PATH, where pip finds this checkout's wheel as llama-index-crag",
}
_MARKER = re.compile(r"^<!--\s*example:(.*?)-->\s*$")
_FENCE = re.compile(r"^```([\w+-]*)\s*$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass
class Block:
    """One fenced block: where it is, its language, its code, and its marker's words."""

    path: Path
    line: int  # the line of the first code line (1-based), so errors point into the Markdown
    lang: str
    code: str
    marker: Optional[str]
    options: Dict[str, str] = field(default_factory=dict)
    flags: set = field(default_factory=set)

    @property
    def kind(self) -> str:
        return RUNNABLE[self.lang]

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def needs(self) -> List[str]:
        return [n for n in self.options.get("needs", "").split(",") if n]

    @property
    def slow(self) -> bool:
        return "slow" in self.flags

    def limits(self) -> Dict[str, List[Tuple[str, str]]]:
        """``limit="eval --limit 5 --top-k 3; calibrate --limit 20"`` as {command: [(flag, value), ...]}."""
        found: Dict[str, List[Tuple[str, str]]] = {}
        for part in filter(None, (p.strip() for p in self.options.get("limit", "").split(";"))):
            command, *words = shlex.split(part)
            if len(words) % 2:
                raise ValueError(f"{self.where}: limit {part!r} must be flag-value pairs")
            found[command] = list(zip(words[::2], words[1::2]))
        return found

    def env(self) -> Dict[str, str]:
        return dict(item.split("=", 1) for item in shlex.split(self.options.get("env", "")))


def parse_marker(text: str) -> Tuple[set, Dict[str, str]]:
    flags, options = set(), {}
    for word in shlex.split(text):
        if "=" in word:
            key, value = word.split("=", 1)
            options[key] = value
        else:
            flags.add(word)
    return flags, options


def blocks(path: Path) -> List[Block]:
    """Every fenced block of ``path`` (runnable or not), with the marker on the line before its fence."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        previous = lines[i - 1] if i else ""
        marker = _MARKER.match(previous)
        block = Block(path, i + 2, fence.group(1), "\n".join(lines[i + 1 : end]) + "\n", marker and marker.group(1))
        if marker:
            block.flags, block.options = parse_marker(marker.group(1))
        found.append(block)
        i = end + 1
    return found


def runnable_blocks() -> List[Block]:
    return [b for path in DOC_FILES for b in blocks(path) if b.lang in RUNNABLE]


def problems(block: Block) -> List[str]:
    """What is wrong with a runnable block's marker (empty when it can run)."""
    if block.marker is None:
        return [f"{block.where}: a runnable ```{block.lang} block needs an <!-- example: ... --> marker before it"]
    found = [f"{block.where}: unknown marker word {w!r}" for w in block.flags - FLAGS]
    found += [f"{block.where}: unknown marker option {k!r}" for k in set(block.options) - OPTIONS]
    found += [f"{block.where}: unknown need {n!r}" for n in block.needs if n not in NEEDS]
    if ("skip" in block.flags) != bool(block.options.get("reason", "").strip()):
        found.append(f'{block.where}: a skip is written skip reason="why it cannot run here", and only so')
    if not (block.flags or block.options):
        found.append(f"{block.where}: an empty marker; say standalone, or what the block needs")
    return found


def skip_reason(block: Block) -> Optional[str]:
    return block.options.get("reason") if "skip" in block.flags else None


def _logical_lines(code: str) -> List[Tuple[int, str, int]]:
    """(first line offset, the line with continuations joined, physical lines it spans)."""
    physical = code.splitlines()
    found, i = [], 0
    while i < len(physical):
        start, text = i, physical[i]
        while text.rstrip().endswith("\\") and i + 1 < len(physical):
            i += 1
            text = text.rstrip()[:-1] + " " + physical[i].strip()
        found.append((start, text, i - start + 1))
        i += 1
    return found


def command_key(words: List[str]) -> Optional[str]:
    """``llama-crag eval ...`` -> ``eval``; ``python benchmarks/bench_engine.py ...`` -> ``bench_engine.py``."""
    while words and _ASSIGNMENT.match(words[0]):
        words = words[1:]
    if not words:
        return None
    if words[0] == "llama-crag":
        return words[1] if len(words) > 1 else None
    if Path(words[0]).name.startswith("python") and len(words) > 1:
        return Path(words[1]).name
    return None


def _with_flags(words: List[str], flags: List[Tuple[str, str]]) -> List[str]:
    words = list(words)
    for flag, value in flags:
        if flag in words:
            words[words.index(flag) + 1] = value
        else:
            words += [flag, value]
    return words


def _quote(word: str) -> str:
    if _ASSIGNMENT.match(word):
        name, value = word.split("=", 1)
        return f"{name}={shlex.quote(value)}"
    return shlex.quote(word)


def shell_script(block: Block) -> str:
    """The block as bash, line for line (so ``$LINENO`` is the Markdown line): a console block's ``$`` lines
    only, the marker's limits applied, and ``llama-crag serve`` run until it has answered one query."""
    code = block.code
    if block.lang == "console":
        code = "\n".join(line[2:] if line.startswith("$ ") else "" for line in code.splitlines()) + "\n"
    limits = block.limits()
    used = set()
    out: List[str] = []
    physical = code.splitlines()
    for start, text, span in _logical_lines(code):
        body, _, comment = text.partition(" #")
        try:
            words = shlex.split(body)
        except ValueError:
            words = []
        key = command_key(words)
        changed = False
        if key in limits:
            words = _with_flags(words, limits[key])
            used.add(key)
            changed = True
        if key == "serve":
            words = ["crag_serve", *words]
            changed = True
        if changed:
            out.append(" ".join(_quote(w) for w in words))
            out += [""] * (span - 1)
        else:
            out += physical[start : start + span]
    unused = set(limits) - used
    if unused:
        raise ValueError(f"{block.where}: limit names {sorted(unused)}, which no line of the block runs")
    return "\n".join(out) + "\n"
