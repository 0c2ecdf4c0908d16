"""The answer model's quote thresholds, one per grader verdict, chosen on the design halves of the shared sets.

Runs ``llama-crag eval --no-generate --systems crag`` on each set's design half with
``CRAG_QUOTE_THRESHOLD=0`` (the best strip is always quoted, and the trace keeps its
probability), then replays thresholds on those rows: a row answered at 0 is answered
when its best strip's probability reaches the threshold of the grader's verdict on its
evidence (correct or ambiguous; evidence the fallback found goes by its own grade, and
is taken for ambiguous in rows that did not record it). It prints each
set's figures for one threshold for every verdict, and chooses the three that give the
best mean truthfulness with every set's false abstention at most
``--max-false-abstention``; ``--write`` stores them in the packaged answer model:

    OMP_NUM_THREADS=2 python benchmarks/quote_threshold.py --write

The check halves are never read here; report them with ``benchmarks/check_halves.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_halves import evaluate, write_half  # noqa: E402

from llama_index_crag.answers.answer_model import META_FILE, PACKAGED_DIR, VERDICTS  # noqa: E402
from llama_index_crag.scorers.evidence import EvidenceScorer  # noqa: E402

#: The band of a fallback's grade that counts as correct: the offline default's ``upper``.
UPPER = EvidenceScorer.DEFAULT_THRESHOLDS["upper"]


def design_rows(dataset: Path, out: Path) -> List[Dict[str, Any]]:
    """CRAG's rows on the design half of ``dataset``, every answer quoted whatever its probability."""
    half = write_half(dataset, "design", out / "halves")
    folder = out / "design" / dataset.name
    evaluate(ROOT, half, folder, out / "cache", [], env={"CRAG_QUOTE_THRESHOLD": "0"})
    results = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    return [r for r in results["rows"] if r["system"] == "crag"]


def replay(rows: List[Dict[str, Any]], thresholds: Dict[str, float]) -> Dict[str, float]:
    """The figures at ``thresholds`` (per verdict): a row answered at 0 abstains when its best strip falls under
    the threshold of its verdict."""

    def abstained(row: Dict[str, Any]) -> bool:
        verdict = row["action"]
        if verdict == "incorrect":
            retry = row.get("retry_score")
            verdict = "ambiguous" if retry is None else ("correct" if retry >= UPPER else "ambiguous")
        return bool(row["abstained"]) or (row.get("quote_grade") or 0.0) < thresholds.get(verdict, 0.0)

    def share(kind: str, test: Any) -> float:
        mine = [r for r in rows if r["kind"] == kind]
        return sum(1 for r in mine if test(r)) / len(mine) if mine else float("nan")

    scores = [0 if abstained(r) else (1 if r["correct"] else -1) for r in rows]
    return {
        "false_abstention": share("answerable", abstained),
        "truthfulness": sum(scores) / len(scores),
        "abstain_out_of_corpus": share("out_of_corpus", abstained),
        "abstain_unanswerable": share("unanswerable", abstained),
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default=str(ROOT.parent / "shared" / "datasets"), help="the shared sets")
    parser.add_argument("--sets", default="squad2,clapnq,scifact", help="comma-separated sets")
    parser.add_argument("--out", default="eval-out/halves", help="rows and halves")
    parser.add_argument("--max-false-abstention", type=float, default=0.05, help="on every set")
    parser.add_argument("--write", action="store_true", help="store the chosen thresholds in the packaged model")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    rows = {name: design_rows(Path(args.datasets) / name, out) for name in args.sets.split(",")}
    grid = [round(0.05 * i, 2) for i in range(15)]
    print("One threshold for every verdict:\n")
    print("| threshold | " + " | ".join(f"{n}: false abst. / truthful. / ooc / unans." for n in rows) + " |")
    print("|---:|" + "---|" * len(rows))
    for t in grid:
        figures = [replay(r, dict.fromkeys(VERDICTS, t)) for r in rows.values()]
        print(f"| {t:.2f} | " + " | ".join(_cells(f) for f in figures) + " |")
    best: Optional[Tuple[float, Dict[str, float]]] = None
    for chosen in itertools.product(grid, repeat=len(VERDICTS)):
        thresholds = dict(zip(VERDICTS, chosen))
        figures = [replay(r, thresholds) for r in rows.values()]
        if all(f["false_abstention"] <= args.max_false_abstention for f in figures):
            mean = sum(f["truthfulness"] for f in figures) / len(figures)
            if best is None or mean > best[0] + 1e-9:
                best = (mean, thresholds)
    if best is None:
        print(f"\nNo thresholds keep every set's false abstention at most {args.max_false_abstention}.")
        return 1
    print(f"\nChosen, per verdict: {best[1]} (best mean truthfulness, {100 * best[0]:.1f}%, with false abstention at ")
    print(f"most {args.max_false_abstention} on each design half):\n")
    for name, r in rows.items():
        print(
            f"- {name}: {_cells(replay(r, best[1]))} (false abstention / truthfulness / out of corpus / unanswerable)"
        )
    if args.write:
        meta = json.loads((PACKAGED_DIR / META_FILE).read_text(encoding="utf-8"))
        meta["thresholds"] = best[1]
        meta["thresholds_chosen_on"] = f"design halves of {', '.join(rows)}: benchmarks/quote_threshold.py"
        (PACKAGED_DIR / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        print(f"\nWrote them to {PACKAGED_DIR / META_FILE}.")
    return 0


def _cells(figures: Dict[str, float]) -> str:
    keys = ("false_abstention", "truthfulness", "abstain_out_of_corpus", "abstain_unanswerable")
    return " / ".join(f"{100 * figures[k]:.1f}" for k in keys)


if __name__ == "__main__":
    raise SystemExit(main())
