"""Each answer-check policy's figures from two ``llama-crag eval`` runs, with one generation.

Generation is deterministic (temperature 0) and the check's policy acts only after it,
so the answers of ``--on-ungrounded flag`` are the answers of every policy; only what
happens to a flagged one differs. ``extract`` replaces it with the quoted evidence,
which is what ``--answer-mode extract`` answers from the same graded context;
``abstain`` abstains. This script applies each policy to the flag run's rows (taking the
quotes from the extract run's row of the same query) and prints the figures of plain
RAG, of CRAG per policy, and of CRAG quoting. Given a run made with a real policy
(``--policy-run``), it also says how many of that run's rows the derivation reproduces.

    llama-crag eval --dataset ../shared/datasets/squad2 --limit 40 --systems plain,crag \\
        --answer-mode generate --on-ungrounded flag --out eval-out/squad2-flag
    llama-crag eval --dataset ../shared/datasets/squad2 --limit 40 --systems crag \\
        --answer-mode extract --out eval-out/squad2-extract
    python benchmarks/answer_policies.py --flag eval-out/squad2-flag --extract eval-out/squad2-extract
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from llama_index_crag.evaluation.metrics import apply_policy, summarize

Row = Dict[str, Any]
Key = Tuple[str, str]
FIGURES = (
    ("answered", None),
    ("accuracy", "accuracy"),
    ("wrong answers", "wrong_answers"),
    ("wrong among answered answerable", "wrong_among_answered_answerable"),
    ("abstention, out of corpus", "abstain_out_of_corpus"),
    ("abstention, unanswerable", "abstain_unanswerable"),
    ("false abstention", "false_abstention"),
    ("truthfulness", "truthfulness"),
)


def load_rows(folder: Path, system: str) -> Dict[Key, Row]:
    """The rows of ``system`` in an eval output folder, by (kind, question id)."""
    rows = json.loads((folder / "results.json").read_text(encoding="utf-8"))["rows"]
    return {(r["kind"], r["qid"]): r for r in rows if r["system"] == system}


def _cell(figures: Dict[str, Any], rows: Sequence[Row], key: Optional[str]) -> str:
    if key is None:
        return f"{sum(not r['abstained'] for r in rows)} / {len(rows)}"
    value = figures.get(key)
    return "-" if value is None else f"{value:.1%}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flag", required=True, help="eval output of --answer-mode generate --on-ungrounded flag")
    parser.add_argument("--extract", required=True, help="eval output of --answer-mode extract, same questions")
    parser.add_argument("--policy-run", default=None, help="eval output of a real policy run, to check the derivation")
    args = parser.parse_args(argv)

    flagged, quoted = load_rows(Path(args.flag), "crag"), load_rows(Path(args.extract), "crag")
    missing = set(flagged) - set(quoted)
    if missing:
        raise SystemExit(f"the extract run lacks {len(missing)} of the flag run's queries: use the same --limit")
    columns: Dict[str, List[Row]] = {}
    plain = load_rows(Path(args.flag), "plain")
    if plain:
        columns["plain RAG (generated)"] = list(plain.values())
    columns["CRAG generated, unchecked or flag"] = apply_policy(flagged, quoted, "flag")
    columns["CRAG generated, on_ungrounded=extract"] = apply_policy(flagged, quoted, "extract")
    columns["CRAG generated, on_ungrounded=abstain"] = apply_policy(flagged, quoted, "abstain")
    columns["CRAG quoted (answer_mode=extract)"] = [quoted[k] for k in flagged]
    figures = {name: summarize(rows, [rows[0]["system"]])[rows[0]["system"]] for name, rows in columns.items()}
    flagged_share = sum(r.get("check_outcome") == "flagged" for r in flagged.values())
    checked = sum(r.get("check_outcome") is not None for r in flagged.values())
    print(f"{len(flagged)} queries; the check flagged {flagged_share} of {checked} generated answers.\n")
    print("| figure | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for label, key in FIGURES:
        print(f"| {label} | " + " | ".join(_cell(figures[n], columns[n], key) for n in columns) + " |")
    if args.policy_run:
        real = load_rows(Path(args.policy_run), "crag")
        step = json.loads((Path(args.policy_run) / "results.json").read_text(encoding="utf-8"))["meta"]["answer_step"]
        derived = {(r["kind"], r["qid"]): r for r in apply_policy(flagged, quoted, step["on_ungrounded"])}
        same = [
            k
            for k in real
            if (derived[k]["abstained"], derived[k]["answer"]) == (real[k]["abstained"], real[k]["answer"])
        ]
        policy = step["on_ungrounded"]
        print(f"\nAgainst a real on_ungrounded={policy} run: {len(same)} of {len(real)} rows derived alike.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
