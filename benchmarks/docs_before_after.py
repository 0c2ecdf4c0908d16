"""``llama-crag eval-docs`` for the working tree and for a git ref, side by side, on a raw-document set.

A change to how documents are read or cut (``stores/readers.py``, ``stores/chunking.py``) moves what every
question of a raw-document set retrieves; this prints CRAG's right / wrong / abstained per kind and truthfulness
with its 95% interval, plain retrieval's answer-in-top-k, and the ingest's time, passages embedded and peak
memory, before and after, for each half asked:

    OMP_NUM_THREADS=1 python benchmarks/docs_before_after.py --ref HEAD~1 --splits check,all

Each side ingests into its own index folder under ``--out`` (reused by a later run: an unchanged folder embeds
nothing, so only the questions are asked again; ``--reuse`` takes the last results as they are). Ingest time is
the machine's as much as the code's: compare it between runs on an idle machine, and the passages embedded always.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.check_halves import checkout  # noqa: E402


def evaluate(tree: Path, dataset: Path, split: str, out: Path, reuse: bool) -> Dict[str, Any]:
    """``llama-crag eval-docs`` with the code of ``tree``; its results (and index folder) stay in ``out``."""
    results = out / "results.json"
    if not (reuse and results.exists()):
        command = [sys.executable, "-m", "llama_index_crag.cli", "eval-docs", "--dataset", str(dataset)]
        command += ["--split", split, "--out", str(out), "--no-progress"]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run(command, check=True, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    return dict(json.loads(results.read_text(encoding="utf-8")))


def _counts(figures: Dict[str, Any]) -> str:
    return f"{figures['right']} / {figures['wrong']} / {figures['abstained']}"


def _truth(figures: Dict[str, Any]) -> str:
    pm = figures.get("truthfulness_pm")
    return f"{100 * figures['truthfulness']:.1f}%" + ("" if pm is None else f" ±{100 * pm:.1f}")


def table(sides: Dict[str, Dict[str, Any]]) -> List[str]:
    """One split's before and after as Markdown rows."""
    before, after = sides["before"], sides["after"]
    lines = ["| figure | before | after |", "|---|---:|---:|"]
    for kind, mine in before["figures"]["crag"]["kinds"].items():
        theirs = after["figures"]["crag"]["kinds"].get(kind)
        lines.append(
            f"| {kind} ({mine['questions']}): right / wrong / abstained | {_counts(mine)} | "
            f"{_counts(theirs) if theirs else 'n/a'} |"
        )
    lines.append(
        f"| all: right / wrong / abstained | {_counts(before['figures']['crag'])} | "
        f"{_counts(after['figures']['crag'])} |"
    )
    lines.append(
        f"| truthfulness, right - wrong | {_truth(before['figures']['crag'])} | {_truth(after['figures']['crag'])} |"
    )
    lines.append(
        f"| plain, top passage quoted: truthfulness | {_truth(before['figures']['plain_top_passage'])} | "
        f"{_truth(after['figures']['plain_top_passage'])} |"
    )
    recall = [s["figures"]["answer_in_plain_top_k"] for s in (before, after)]
    lines.append("| answer in plain top-k | " + " | ".join(f"{r['found']} of {r['answerable']}" for r in recall) + " |")
    for label, key in (("chunks", "chunks"), ("ingest, s", "ingest_s"), ("passages embedded", "embeddings_made")):
        lines.append(f"| {label} | {before['meta'][key]} | {after['meta'][key]} |")
    lines.append(
        "| median chunk, characters | "
        + " | ".join(f"{s['meta']['passage_chars'].get('median', 0):.0f}" for s in (before, after))
        + " |"
    )
    lines.append(
        "| peak memory, MB | " + " | ".join(f"{s['meta']['peak_memory_mb']['end']}" for s in (before, after)) + " |"
    )
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default="HEAD", help="the git ref to compare the working tree with (default HEAD)")
    parser.add_argument(
        "--dataset", default=str(ROOT.parent / "shared" / "datasets" / "pgdocs"), help="a raw-document set"
    )
    parser.add_argument("--splits", default="check,all", help="comma-separated: check, design, all")
    parser.add_argument("--out", default="eval-out/docs-before-after", help="results, index folders, the ref's tree")
    parser.add_argument("--reuse", action="store_true", help="print the last results without asking again")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    trees = {"before": checkout(args.ref, out), "after": ROOT}
    for split in [s.strip() for s in args.splits.split(",") if s.strip()]:
        sides = {
            side: evaluate(tree, Path(args.dataset), split, out / side / split, args.reuse)
            for side, tree in trees.items()
        }
        print(f"\n{Path(args.dataset).name}, {split}: {args.ref} (before) -> working tree (after)\n")
        print("\n".join(table(sides)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
