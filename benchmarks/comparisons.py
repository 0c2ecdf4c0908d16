"""Comparisons ("Who was born first, Mikhail Kravchuk or Israel Gelfand?"): each side's evidence, split and whole.

From HotpotQA's comparison questions in ``datasets/train`` (HaluEval's rows: a person's question and the
supporting facts of its two Wikipedia articles, written one after the other), each article becomes a document of
its own, and a half of the questions (cut by question, ``--half``) is asked of an index over that half's
articles; the other comparisons' articles are the distractors. A comparison is answered when the answer gives
each side's fact: with ``split_compound`` on, when each part's quotes come from its own side's article; off (the
engine before), when the one answer's quotes come from both. Also printed: the parts answered wrong (quoted, but
not from their own side's article), those that quoted their side and a stray article besides, whole answers that
quoted neither side, how often the split found the two sides, and the median time of each.

    OMP_NUM_THREADS=1 python benchmarks/comparisons.py --half design --limit 120
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llama_index.core import Document, VectorStoreIndex  # noqa: E402

from llama_index_crag import CorrectiveQueryEngine  # noqa: E402
from llama_index_crag.evaluation.raw_docs import collapsed  # noqa: E402
from llama_index_crag.local.models import default_embed_model  # noqa: E402

PAIRS = ROOT.parent / "shared" / "datasets" / "train" / "pairs.jsonl"
#: "<frame>, <A> or <B>?": the form of HotpotQA's comparisons.
COMPARISON = re.compile(r"^(?P<frame>[^,]+),\s*(?P<a>[^,]+?)\s+or\s+(?P<b>[^,?]+?)\s*\?$")
#: Where one article's facts end and the next begin: a sentence's end with no space after it.
SEAM = re.compile(r"(?<=[a-z0-9.!?\"')\]][.!?\"')])(?=[A-Z])|(?<=[a-z0-9)][.!?])(?=[A-Z])")


def words(text: str) -> Set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.casefold()) if len(w) > 2}


def comparisons(path: Path) -> List[Dict[str, Any]]:
    """Every comparison whose supporting facts cut into two articles, each naming its own side only."""
    found = []
    for line in path.open(encoding="utf-8"):
        row = json.loads(line)
        if row.get("source") != "halueval" or row.get("kind") != "supporting_facts":
            continue
        match = COMPARISON.match(row["question"].strip())
        if not match:
            continue
        pieces = [p.strip() for p in SEAM.split(row["passage"]) if p.strip()]
        if len(pieces) != 2:
            continue
        a, b = words(match.group("a")), words(match.group("b"))
        if not a or not b:
            continue
        first, second = words(pieces[0]), words(pieces[1])
        if len(a & first) > len(a & second) and len(b & second) > len(b & first):
            sides = (pieces[0], pieces[1])
        elif len(a & second) > len(a & first) and len(b & first) > len(b & second):
            sides = (pieces[1], pieces[0])
        else:
            continue
        qid = hashlib.sha1(row["question"].encode()).hexdigest()[:10]
        found.append({"qid": qid, "question": row["question"].strip(), "sides": sides})
    return found


def half_of(qid: str) -> str:
    return "design" if int(qid, 16) % 2 == 0 else "check"


def quoted_docs(trace: Dict[str, Any], articles: Dict[str, str]) -> Set[str]:
    """Which of the comparison's ``articles`` (id: text) each quote comes from, by its text ("other": neither); a
    quote may come from a fallback's sentence window or from a copy of the article another comparison shares."""
    found = set()
    for quote in trace.get("quotes") or []:
        text = collapsed(quote["text"])
        found.add(next((name for name, article in articles.items() if text in collapsed(article)), "other"))
    return found


def ask(engine: Any, question: str) -> Tuple[Dict[str, Any], float]:
    started = time.perf_counter()
    response = engine.query(question)
    return dict((response.metadata or {}).get("crag") or {}), (time.perf_counter() - started) * 1000.0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--half", choices=("design", "check"), default="design", help="the half asked")
    parser.add_argument("--limit", type=int, default=120, help="comparisons asked")
    parser.add_argument("--pairs", type=Path, default=PAIRS, help="datasets/train/pairs.jsonl")
    args = parser.parse_args(argv)
    every = [c for c in comparisons(args.pairs) if half_of(c["qid"]) == args.half]
    documents = [
        Document(text=side, doc_id=f"{c['qid']}-{i}", metadata={"title": f"{c['qid']}-{i}"})
        for c in every
        for i, side in enumerate(c["sides"])
    ]
    embed_model = default_embed_model()
    index = VectorStoreIndex.from_documents(documents, embed_model=embed_model)
    on = CorrectiveQueryEngine.from_defaults(index=index, embed_model=embed_model)
    off = CorrectiveQueryEngine.from_defaults(index=index, embed_model=embed_model, split_compound=False)
    asked = every[: args.limit]
    names = ("found", "both", "one", "wrong", "noise", "other_side", "abstained")
    counts = {f"split_{name}": 0 for name in names}
    counts.update({f"whole_{name}": 0 for name in ("both", "one", "wrong", "abstained")})
    ms_on: List[float] = []
    ms_off: List[float] = []
    for c in asked:
        gold = [f"{c['qid']}-0", f"{c['qid']}-1"]
        doc_of = dict(zip(gold, c["sides"]))
        whole, t_off = ask(off, c["question"])
        ms_off.append(t_off)
        got = quoted_docs(whole, doc_of) if not whole.get("abstained") else set()
        counts["whole_both"] += set(gold) <= got
        counts["whole_one"] += len(set(gold) & got) == 1
        counts["whole_abstained"] += bool(whole.get("abstained"))
        counts["whole_wrong"] += bool(got) and not set(gold) & got
        split, t_on = ask(on, c["question"])
        ms_on.append(t_on)
        parts = split.get("parts") or []
        if len(parts) != 2:
            got = quoted_docs(split, doc_of) if not split.get("abstained") else set()
            counts["split_both"] += set(gold) <= got
            counts["split_one"] += len(set(gold) & got) == 1
            counts["split_abstained"] += bool(split.get("abstained"))
            continue
        counts["split_found"] += 1
        sides = [quoted_docs(p["trace"], doc_of) if not p["abstained"] else set() for p in parts]
        right = [gold[i] in sides[i] for i in range(2)]
        counts["split_both"] += all(right)
        counts["split_one"] += sum(right) == 1
        counts["split_other_side"] += sum(gold[1 - i] in s for i, s in enumerate(sides))
        counts["split_wrong"] += sum(bool(s) and gold[i] not in s for i, s in enumerate(sides))
        counts["split_noise"] += sum(gold[i] in s and bool(s - set(gold)) for i, s in enumerate(sides))
        counts["split_abstained"] += all(p["abstained"] for p in parts)
    n = len(asked)
    print(f"HotpotQA comparisons, {args.half} half: {n} asked of {len(every)}, over {len(documents)} articles")
    print(f"- split found the two sides: {counts['split_found']} ({100 * counts['split_found'] / n:.0f}%)")
    for name in ("split", "whole"):
        print(
            f"- {name}: both sides' facts quoted {counts[name + '_both']} ({100 * counts[name + '_both'] / n:.0f}%), "
            f"one side {counts[name + '_one']}, abstained whole {counts[name + '_abstained']}"
        )
    print(
        f"- parts answered wrong (quoted, but not their own side's article): {counts['split_wrong']} of {2 * n}; "
        f"parts that quoted their own side and also an article of neither side: {counts['split_noise']}; "
        f"that also quoted the other side's: {counts['split_other_side']}"
    )
    print(f"- whole answers that quoted neither side's article: {counts['whole_wrong']}")
    print(f"- time, ms (median): split {statistics.median(ms_on):.0f}, whole {statistics.median(ms_off):.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
