"""Compound questions: two questions about two documents, joined as people join them, asked whole and alone.

From one half of a shared set (the check half by default: the rules of ``text/compound.py`` were written on the
sample corpus and pgdocs' design half), pairs of answerable questions whose gold passages lie in different
documents are joined ("When was the university founded, and who designed the cathedral?"), and pairs of an
answerable question and an out-of-corpus one (the other half's question, its document not indexed) give the
partial case. The engine (offline default, answers quoted) answers:

- each question alone: a pair counts when both are right;
- the joined question with ``split_compound`` on: a pair counts when each part's answer holds its gold answer;
- the joined question with it off (the engine before): when the one answer holds both.

A partial pair counts when the answerable part is right and the other abstained on. Also printed: how often the
split found the two parts, and the mean time of a joined question against its two parts alone.

    OMP_NUM_THREADS=1 python benchmarks/compound_questions.py --dataset ../shared/datasets/squad2 --pairs 40
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llama_index.core import VectorStoreIndex  # noqa: E402

from llama_index_crag import CorrectiveQueryEngine  # noqa: E402
from llama_index_crag.datasets import Question, load_documents, load_questions  # noqa: E402
from llama_index_crag.evaluation.dataset import contains_any  # noqa: E402
from llama_index_crag.local.models import default_embed_model  # noqa: E402


def joined(first: str, second: str) -> str:
    """Two questions as one: "When was X founded, and who designed Y?"."""
    second = second.strip()
    return f"{first.strip().rstrip('?').rstrip()}, and {second[:1].lower()}{second[1:]}"


def pairs_of(questions: List[Question], count: int, rng: random.Random) -> List[Tuple[Question, Question]]:
    """``count`` pairs of answerable questions whose gold documents differ."""
    answerable = [q for q in questions if q.answerable and q.answers and q.relevant_doc_ids]
    found: List[Tuple[Question, Question]] = []
    for _ in range(count * 20):
        if len(found) >= count:
            break
        a, b = rng.sample(answerable, 2)
        if set(a.relevant_doc_ids) & set(b.relevant_doc_ids) or (a, b) in found:
            continue
        found.append((a, b))
    return found


def ask(engine: Any, question: str) -> Tuple[Any, float]:
    started = time.perf_counter()
    response = engine.query(question)
    return response, (time.perf_counter() - started) * 1000.0


def right(response: Any, question: Question) -> bool:
    crag = (response.metadata or {}).get("crag") or {}
    return not crag.get("abstained") and bool(contains_any(str(response), tuple(question.answers)))


def part_right(response: Any, index: int, question: Question) -> Optional[bool]:
    """Whether part ``index`` of a split answer holds ``question``'s answer; None when it was not split so."""
    parts = ((response.metadata or {}).get("crag") or {}).get("parts") or []
    if len(parts) != 2:
        return None
    part = parts[index]
    return not part["abstained"] and bool(contains_any(part["answer"], tuple(question.answers)))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True, help="a shared set's folder")
    parser.add_argument("--half", default="check", help="the half asked (default: check)")
    parser.add_argument("--pairs", type=int, default=40, help="answerable pairs (and as many partial ones, halved)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    other = "design" if args.half == "check" else "check"
    rng = random.Random(args.seed)
    embed_model = default_embed_model()
    documents = load_documents(args.dataset, args.half)
    index = VectorStoreIndex.from_documents(documents, embed_model=embed_model)
    on = CorrectiveQueryEngine.from_defaults(index=index, embed_model=embed_model)
    off = CorrectiveQueryEngine.from_defaults(index=index, embed_model=embed_model, split_compound=False)
    questions = load_questions(args.dataset, args.half)
    pairs = pairs_of(questions, args.pairs, rng)
    outside = [q for q in load_questions(args.dataset, other) if q.answerable and q.answers]
    counts: Dict[str, int] = {"alone": 0, "split": 0, "whole": 0, "found": 0, "first": 0, "second": 0}
    ms_alone: List[float] = []
    ms_joined: List[float] = []
    for a, b in pairs:
        (ra, ta), (rb, tb) = ask(on, a.question), ask(on, b.question)
        both_alone = right(ra, a) and right(rb, b)
        rj, tj = ask(on, joined(a.question, b.question))
        first, second = part_right(rj, 0, a), part_right(rj, 1, b)
        rw, _ = ask(off, joined(a.question, b.question))
        counts["alone"] += both_alone
        counts["found"] += first is not None
        counts["first"] += bool(first)
        counts["second"] += bool(second)
        counts["split"] += bool(first and second)
        counts["whole"] += right(rw, a) and right(rw, b)
        ms_alone.append(ta + tb)
        ms_joined.append(tj)
    partial = {"pairs": 0, "answered_and_abstained": 0}
    for a, _ in pairs[: max(1, len(pairs) // 2)]:
        stranger = rng.choice(outside)
        response, _ = ask(on, joined(a.question, stranger.question))
        parts = ((response.metadata or {}).get("crag") or {}).get("parts") or []
        partial["pairs"] += 1
        if len(parts) == 2 and part_right(response, 0, a) and parts[1]["abstained"]:
            partial["answered_and_abstained"] += 1
    n = len(pairs)
    print(f"{Path(args.dataset).name}, {args.half} half, {n} pairs of answerable questions of different documents")
    print(f"- both right asked alone: {counts['alone']} ({100 * counts['alone'] / n:.0f}%)")
    print(
        f"- both right asked joined, split: {counts['split']} ({100 * counts['split'] / n:.0f}%); "
        f"first part {counts['first']}, second {counts['second']}; split found both parts in {counts['found']}"
    )
    print(f"- both right asked joined, not split (before): {counts['whole']} ({100 * counts['whole'] / n:.0f}%)")
    if counts["alone"]:
        print(f"- joined and split / alone: {counts['split'] / counts['alone']:.2f}")
    print(
        f"- partial pairs (answerable + out of corpus): answered the first and abstained on the second in "
        f"{partial['answered_and_abstained']} of {partial['pairs']}"
    )
    print(
        f"- time, ms (median): joined {statistics.median(ms_joined):.0f}, its two parts alone "
        f"{statistics.median(ms_alone):.0f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
