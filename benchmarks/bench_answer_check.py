"""The answer check alone on HaluEval: does it tell a right answer from a hallucinated one, given the facts?

Each HaluEval row of the training pairs holds a question, its supporting facts, a right
answer and a hallucinated one. Only rows held out from training (the reader's split,
``calibration.labelled.is_held_out``) are used. Each answer is checked against the facts;
the AUROC says how well the check's score ranks right answers above hallucinated ones,
and the rates say what the grounded/not-grounded verdict does with each.

    OMP_NUM_THREADS=1 python benchmarks/bench_answer_check.py [--pairs ../shared/datasets/train/pairs.jsonl]
        [--with-grader] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from sklearn.metrics import roc_auc_score

from llama_index_crag.answers.grounding import GroundednessChecker
from llama_index_crag.calibration.labelled import is_held_out
from llama_index_crag.scorers.evidence import EvidenceScorer

DEFAULT_PAIRS = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "train" / "pairs.jsonl"


def held_out_rows(path: Path, limit: int | None) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            if row.get("source") == "halueval" and row.get("right_answer") and is_held_out(row):
                rows.append(row)
    return rows[:limit] if limit else rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS)
    parser.add_argument("--with-grader", action="store_true", help="also score each sentence with the evidence scorer")
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    rows = held_out_rows(args.pairs, args.limit)
    scorer = EvidenceScorer(corpus=[r["passage"] for r in rows]) if args.with_grader else None
    checker = GroundednessChecker(scorer, use_scorer=args.with_grader)
    scores, labels, grounded, times = [], [], [], []
    for row in rows:
        for answer, label in ((row["right_answer"], 1), (row["hallucinated_answer"], 0)):
            started = time.perf_counter()
            check = checker.check(answer, [row["passage"]], row["question"])
            times.append((time.perf_counter() - started) * 1000.0)
            scores.append(check.score if check.score is not None else 0.0)
            labels.append(label)
            grounded.append(check.grounded is True)
    s, y, g = np.array(scores), np.array(labels), np.array(grounded)
    how = "with" if args.with_grader else "without"
    print(f"HaluEval held-out rows: {len(rows)} ({len(y)} answers), check {how} the grader")
    print(f"AUROC (right above hallucinated): {roc_auc_score(y, s):.3f}")
    print(f"right answers grounded: {g[y == 1].mean():.3f}; hallucinated answers flagged: {1 - g[y == 0].mean():.3f}")
    print(f"check time per answer: p50 {np.percentile(times, 50):.2f} ms, p95 {np.percentile(times, 95):.2f} ms")


if __name__ == "__main__":
    main()
