"""The demo's 40 questions counted against the sample corpus's answer key, for each way of answering.

An answer is right when it holds one of the question's answer strings (normalised, as
``llama-crag eval`` counts); an answered question is wrong otherwise, and an answered
unanswerable question is wrong. Runs the engine twice over the same index: quoting
(``answer_mode="extract"``, no generator) and generating with the bundled SmolLM2 with
``on_ungrounded="flag"``. The generation is deterministic (temperature 0), and a flagged
answer's trace holds the quotes the ``extract`` policy answers with, so the other policies
are the same run's answers with their outcome applied: ``before`` (no check), ``flag``,
``extract`` and ``abstain``.

    OMP_NUM_THREADS=2 python benchmarks/bench_answers.py [--limit N] [--out answers.json] [--quoted-only]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Dict, List

from llama_index.core import VectorStoreIndex

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.answers.extract import Quote, QuotedAnswer
from llama_index_crag.datasets import load_documents, load_questions
from llama_index_crag.evaluation.dataset import contains_any
from llama_index_crag.local.models import default_embed_model


def _run(engine: CorrectiveQueryEngine, questions: List[Any]) -> List[Dict[str, Any]]:
    rows = []
    for q in questions:
        started = time.perf_counter()
        response = engine.query(q.question)
        crag = response.metadata["crag"]
        rows.append(
            {
                "qid": q.qid,
                "answerable": q.answerable,
                "answers": list(q.answers),
                "answer": str(response),
                "ms": (time.perf_counter() - started) * 1000.0,
                **{k: crag[k] for k in ("action", "abstained", "answered_by", "grounded", "quotes", "rewrite_source")},
                "unsupported": (crag.get("answer_check") or {}).get("unsupported", []),
            }
        )
    return rows


def _policy(row: Dict[str, Any], policy: str) -> Dict[str, Any]:
    """The answer ``policy`` gives from a flagged run's row (``before``: no check at all)."""
    if row["abstained"] or row["answered_by"] != "generate" or row["grounded"] or policy in ("before", "flag"):
        flagged = policy == "flag" and row["grounded"] is False
        return {"answered": not row["abstained"], "answer": row["answer"], "flagged": flagged}
    if policy == "abstain":
        return {"answered": False, "answer": "", "flagged": False}
    quoted = QuotedAnswer([Quote(**q) for q in row["quotes"]])
    return {"answered": bool(quoted.quotes), "answer": quoted.text, "flagged": False}


def count(rows: List[Dict[str, Any]], policy: str) -> Dict[str, int]:
    answered = right = wrong = flagged_wrong = 0
    for row in rows:
        outcome = _policy(row, policy)
        if not outcome["answered"]:
            continue
        answered += 1
        ok = row["answerable"] and bool(contains_any(outcome["answer"], tuple(row["answers"])))
        right += ok
        wrong += not ok
        flagged_wrong += (not ok) and outcome["flagged"]
    return {"answered": answered, "right": right, "wrong": wrong, "wrong_flagged": flagged_wrong}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write every row as JSON here")
    parser.add_argument("--quoted-only", action="store_true", help="only the offline default: no generator, minutes")
    args = parser.parse_args()
    from llama_index_crag.local.llamacpp import BundledLlamaCPP

    questions = load_questions()[: args.limit]
    index = VectorStoreIndex.from_documents(load_documents(), embed_model=default_embed_model())
    quoting = CorrectiveQueryEngine.from_defaults(index=index)
    runs = {"extract": _run(quoting, questions)}
    if not args.quoted_only:
        generating = CorrectiveQueryEngine.from_defaults(
            index=index, llm=BundledLlamaCPP(), answer_mode="generate", on_ungrounded="flag"
        )
        runs["generate"] = _run(generating, questions)
    print(f"{len(questions)} questions ({sum(q.answerable for q in questions)} answerable)\n")
    print("| answers | answered | right | wrong | wrong and flagged | p50 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    table = [("extract (quoted, the offline default)", "extract", "before")]
    table += [
        (f"generate, on_ungrounded={p}" if p != "before" else "generate, no check", "generate", p)
        for p in ("before", "flag", "extract", "abstain")
    ]
    for label, run, policy in [t for t in table if t[1] in runs]:
        c = count(runs[run], policy)
        times = sorted(r["ms"] for r in runs[run])
        print(
            f"| {label} | {c['answered']} | {c['right']} | {c['wrong']} | {c['wrong_flagged']} | "
            f"{times[len(times) // 2]:.0f} |"
        )
    if "generate" in runs:
        keyword = sum(r["rewrite_source"] == "keyword" for r in runs["generate"])
        llm = sum(r["rewrite_source"] == "llm" for r in runs["generate"])
        print(f"\nRewrites while generating: {llm} by the LLM, {keyword} by keywords (the LLM's failed).")
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1, default=str))


if __name__ == "__main__":
    main()
