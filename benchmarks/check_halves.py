"""Each shared set's check-half figures, for the working tree and for a git ref, side by side.

Every threshold, weight and rule is chosen on the design halves; this prints what the
change does on the check halves of all three sets at once, so that a change that lifts
one set and costs another is seen before it ships:

    OMP_NUM_THREADS=2 python benchmarks/check_halves.py --ref origin/main
    python benchmarks/check_halves.py --ref HEAD~3 --sets squad2,clapnq --half design

The halves are written by this tree's ``datasets.Halves`` into plain dataset folders,
and ``llama-crag eval --no-generate --systems crag`` runs on them in each tree, so a ref
from before ``--split`` existed is measured the same way. Rows are kept in ``--out``:
run it again and only what changed is asked again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llama_index_crag.core.settings import MAX_TIMEOUT_S  # noqa: E402
from llama_index_crag.datasets import Halves, load_questions, read_jsonl  # noqa: E402
from llama_index_crag.evaluation.harness import LIFTED_LIMITS  # noqa: E402

#: The correction path's time limits, lifted for every tree evaluated as ``llama-crag eval`` lifts them (at most a
#: day, as the engine allows), through the environment so that a tree from before eval lifted them gets them too.
LIFTED = {f"CRAG_{name.upper()}": f"{MAX_TIMEOUT_S:g}" for name in LIFTED_LIMITS}
#: The figures compared, each with its label and its key in results.json.
FIGURES: List[Tuple[str, str]] = [
    ("false abstention, answerable (lower is better)", "false_abstention"),
    ("... of it with the question's document retrieved (n/a: a tree before the figure)", "false_abstention_retrieved"),
    ("truthfulness, correct - wrong", "truthfulness"),
    ("out-of-corpus abstention", "abstain_out_of_corpus"),
    ("unanswerable abstention", "abstain_unanswerable"),
    ("wrong among answered answerable (lower is better)", "wrong_among_answered_answerable"),
    ("accuracy, answerable", "accuracy_answerable"),
]


def write_half(dataset: Path, half: str, out: Path) -> Path:
    """The ``half`` of ``dataset`` as a dataset folder of its own (rows as they are, fields kept)."""
    halves = Halves.of(dataset, half)
    folder = out / f"{dataset.name}-{half}"
    folder.mkdir(parents=True, exist_ok=True)
    documents = [r for r in read_jsonl(dataset / "corpus.jsonl") if halves.keeps_document(str(r["doc_id"]))]
    kept = {q.qid for q in load_questions(dataset, half)}
    questions = [r for r in read_jsonl(dataset / "questions.jsonl") if str(r["qid"]) in kept]
    for name, rows in (("corpus.jsonl", documents), ("questions.jsonl", questions)):
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        if not (folder / name).exists() or (folder / name).read_text(encoding="utf-8") != text:
            (folder / name).write_text(text, encoding="utf-8")
    return folder


def checkout(ref: str, out: Path) -> Path:
    """A worktree of ``ref`` under ``out`` (made once, moved to ``ref`` each run).

    ``ref`` is read in this repository, not in the worktree: there ``HEAD~1`` would be counted from wherever the
    worktree's last run left it."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    tree = out / "ref-tree"
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True)
    else:
        subprocess.run(["git", "-C", str(tree), "checkout", "-q", "--detach", commit], check=True)
    return tree


def evaluate(
    tree: Path, dataset: Path, out: Path, cache: Path, extra: List[str], env: Optional[Dict[str, str]] = None
) -> Dict[str, Any]:
    """CRAG's figures on ``dataset`` with the code of ``tree`` (and ``env`` set); its rows stay in ``out``.

    The correction path's time limits are lifted (``LIFTED``, unless the environment sets them), as ``llama-crag
    eval`` now does by default, for a ref from before that too: under load the bundled model's rewrites ran past
    their limit (a median of 15 s on SQuAD's check half with two evaluations sharing 2 cores, 0.7 s alone) and
    the question's keywords were searched instead, so a comparison measured the machine's load as well."""
    env = {**LIFTED, **os.environ, **(env or {}), "PYTHONPATH": str(tree)}
    command = [
        sys.executable,
        "-m",
        "llama_index_crag.cli",
        "eval",
        "--dataset",
        str(dataset),
        "--systems",
        "crag",
        "--no-generate",
        "--no-progress",
        "--cache-dir",
        str(cache),
        "--out",
        str(out),
        *extra,
    ]
    subprocess.run(command, check=True, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    return dict(results["figures"]["crag"])  # with its "intervals" (llama-crag eval gives them)


def percent(value: Optional[float], plus_minus: Optional[float] = None) -> str:
    if value is None:
        return "n/a"
    return f"{100.0 * value:.1f}%" + ("" if plus_minus is None else f" ±{100.0 * plus_minus:.1f}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default="HEAD", help="the git ref to compare the working tree with (default HEAD)")
    parser.add_argument("--datasets", default=str(ROOT.parent / "shared" / "datasets"), help="the shared sets")
    parser.add_argument("--sets", default="squad2,clapnq,scifact", help="comma-separated sets (default: all three)")
    parser.add_argument("--half", default="check", choices=("check", "design"), help="the half to report")
    parser.add_argument("--out", default="eval-out/halves", help="rows, halves and the ref's worktree")
    args, extra = parser.parse_known_args(argv)
    out = Path(args.out).resolve()
    cache = (out / "cache").resolve()
    trees = {"before": checkout(args.ref, out), "after": ROOT}
    table: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for name in [s.strip() for s in args.sets.split(",") if s.strip()]:
        half = write_half(Path(args.datasets) / name, args.half, out / "halves")
        table[name] = {side: evaluate(tree, half, out / side / name, cache, extra) for side, tree in trees.items()}
        print(f"{name} done", file=sys.stderr, flush=True)
    print(f"CRAG, {args.half} halves, offline default, answers quoted: {args.ref} (before) -> working tree (after)\n")
    sets = list(table)
    print("| figure | " + " | ".join(f"{s} before | {s} after" for s in sets) + " |")
    print("|---|" + "---:|" * (2 * len(sets)))
    for label, key in FIGURES:
        cells = [
            percent(table[s][side].get(key), table[s][side]["intervals"].get(key))
            for s in sets
            for side in ("before", "after")
        ]
        print(f"| {label} | " + " | ".join(cells) + " |")
    queries = [f"{s}: {sum(table[s]['after']['queries'].values())} queries" for s in sets]
    print(f"\n{'; '.join(queries)}. ± is half a 95% interval over the half's questions.")
    (out / "check-halves.json").write_text(json.dumps({"ref": args.ref, "half": args.half, "figures": table}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
