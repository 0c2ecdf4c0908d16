"""How often the evidence scorer's ``turned_round`` feature fires on human-labelled pairs, by source and label.

A question turned round is one a person made unanswerable by keeping every word of an answerable one and
negating it ("Which committees do *not* reflect ...?") or swapping a word for its opposite ("largest" for
"smallest"): SQuAD 2.0's annotators wrote many of its unanswerable questions so. The feature fires where the
passage's best sentence (as the scorer picks it) negates nothing for a negated question, or holds only the
opposite of a question's word. A good cue fires often on the pairs that do not answer and seldom on those that
do, on every source: the figures below are the share of each source's pairs it fires on, by label.

    python benchmarks/turned_round.py --pairs-file ../shared/datasets/train/pairs.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path
from typing import Dict, List, Tuple

from llama_index_crag.scorers.answer_type import OPPOSITE, turned_round
from llama_index_crag.scorers.evidence import FEATURES, EvidenceScorer


def may_turn(question: str) -> bool:
    """Whether any passage could turn the question round (only those pairs are scored): a negated question
    (an empty sentence negates nothing), or one with a word that has an opposite."""
    return turned_round(question, "", "") is not None or bool(set(re.findall(r"[a-z]+", question)) & OPPOSITE.keys())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs-file", type=Path, required=True, help="labelled pairs (datasets/train)")
    parser.add_argument("--limit", type=int, default=None, help="read only the first N pairs")
    parser.add_argument("--examples", type=int, default=3, help="pairs to print where it fires on an answer")
    args = parser.parse_args()

    lines = args.pairs_file.read_text(encoding="utf-8").splitlines()[: args.limit]
    rows = [json.loads(line) for line in lines if line.strip()]
    scorer = EvidenceScorer(corpus=list(dict.fromkeys(r["passage"] for r in rows)))
    column = FEATURES.index("turned_round")
    totals: Counter[Tuple[str, int]] = Counter()
    fired: Counter[Tuple[str, int]] = Counter()
    wrong: Dict[str, List[str]] = {}
    for row in rows:
        key = (str(row.get("source", "?")), int(row["label"]))
        totals[key] += 1
        if may_turn(row["question"]) and scorer.features(row["question"], [row["passage"]])[0, column] == 1.0:
            fired[key] += 1
            if key[1] == 1:
                wrong.setdefault(key[0], []).append(row["question"])

    print(f"{len(rows)} pairs of {args.pairs_file}\n")
    print("| source | fires on pairs that do not answer | fires on pairs that answer |")
    print("|---|---:|---:|")
    for source in sorted({s for s, _ in totals}):
        cells = []
        for label in (0, 1):
            n, k = totals[(source, label)], fired[(source, label)]
            cells.append(f"{k} of {n} ({100 * k / n:.1f}%)" if n else "-")
        print(f"| {source} | {cells[0]} | {cells[1]} |")
    for source, questions in sorted(wrong.items()):
        print(f"\nfires on an answering pair of {source}, e.g.:")
        for question in questions[: args.examples]:
            print(f"  {question}")


if __name__ == "__main__":
    main()
