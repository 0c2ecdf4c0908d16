"""How a strip that refers back ("It spans 312 metres ...") is best read: alone, after the whole strip before it,
or with its subject (the names in the strip before it, or the title, ``text.strips.subject_of``).

Measured on human labels: the SQuAD 2.0 rows of ``datasets/train`` (the half of SQuAD 2.0 dev that no
evaluation set uses), where each question has the sentence that holds its annotated answer and sentences of the
same paragraph that do not; and, with ``--scifact``, SciFact's claims, each with its abstract and the sentences
the annotators marked as its evidence (the others count as not). Each paragraph or abstract is cut into strips as
the refiner cuts it, every strip is scored in one batch with the evidence scorer (IDF from every passage), and
the figures say how well the answering strip stands out from the others: AUROC over the strips that refer back
and over all, and how often the best-scored strip is one that answers.

    python benchmarks/strip_subjects.py --pairs-file ../shared/datasets/train/pairs.jsonl \
        --scifact ../shared/datasets/scifact
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from sklearn.metrics import roc_auc_score

from llama_index_crag.scorers.evidence import EvidenceScorer
from llama_index_crag.text.strips import Strip, decompose, refers_back, subject_of


def _back(strip: Strip) -> bool:
    return not strip.whole_block and refers_back(strip.text)


#: Each reading of a strip, given the strip, the strip before it ("" for the first) and the paragraph's title.
READINGS: Dict[str, Callable[[Strip, str, str], str]] = {
    "alone": lambda strip, before, title: strip.text,
    "after the whole strip before it": lambda strip, before, title: (
        f"{before or title} {strip.text}" if _back(strip) else strip.text
    ),
    "with the title and the names in the strip before it": lambda strip, before, title: (
        f"{title} {subject_of('', before)} {strip.text}" if _back(strip) else strip.text
    ),
    "with those names, or the title where they are none": lambda strip, before, title: (
        f"{subject_of('', before) or title} {strip.text}" if _back(strip) else strip.text
    ),
    "with its subject: those names, or the title opening the passage (shipped)": lambda strip, before, title: (
        f"{subject_of(title, before)} {strip.text}" if _back(strip) else strip.text
    ),
}


def labelled_paragraphs(rows: List[dict]) -> List[Tuple[str, str, List[Strip], List[Optional[int]]]]:
    """(question, title, strips, label of each strip: 1 answers, 0 does not, None unlabelled) per question."""
    paragraphs: Dict[str, set] = defaultdict(set)
    sentences: Dict[Tuple[str, str], List[dict]] = defaultdict(list)
    for row in rows:
        if row.get("source") != "squad2":
            continue
        if str(row.get("kind", "")).startswith("paragraph"):
            paragraphs[row["title"]].add(row["passage"])
        elif str(row.get("kind", "")).startswith("sentence"):
            sentences[(row["title"], row["question"])].append(row)
    out = []
    for (title, question), found in sentences.items():
        answering = {r["passage"].strip() for r in found if int(r["label"]) == 1}
        others = {r["passage"].strip() for r in found if int(r["label"]) == 0}
        paragraph = next((p for p in sorted(paragraphs[title]) if any(s in p for s in answering | others)), None)
        if paragraph is None:
            continue
        strips = decompose(paragraph, 8, title)
        labels: List[Optional[int]] = [
            1 if any(s in strip.text for s in answering) else 0 if any(s in strip.text for s in others) else None
            for strip in strips
        ]
        if 1 in labels:
            out.append((question, title, strips, labels))
    return out


def scifact_abstracts(folder: Path) -> Tuple[List[str], List[Tuple[str, str, List[Strip], List[Optional[int]]]]]:
    """Every abstract's text (for IDF), and (claim, title, strips, 1 for an evidence strip else 0) per claim."""
    abstracts = {}
    for line in (folder / "corpus.jsonl").read_text(encoding="utf-8").splitlines():
        doc = json.loads(line)
        abstracts[str(doc["doc_id"])] = (str(doc.get("title") or ""), [str(x) for x in doc["sentences"]])
    out = []
    for line in (folder / "questions.jsonl").read_text(encoding="utf-8").splitlines():
        claim = json.loads(line)
        for doc_id, evidence in (claim.get("evidence") or {}).items():
            title, sentences = abstracts[str(doc_id)]
            gold = [sentences[i].strip() for i in evidence["sentences"]]
            strips = decompose(" ".join(sentences), 8, title)
            labels: List[Optional[int]] = [int(any(g in s.text or s.text in g for g in gold)) for s in strips]
            if 1 in labels:
                out.append((str(claim["claim"]), title, strips, labels))
    return [f"{t}. {' '.join(s)}" for t, s in abstracts.values()], out


def measure(
    name: str, scorer: EvidenceScorer, questions: List[Tuple[str, str, List[Strip], List[Optional[int]]]]
) -> None:
    """Print one table: each reading's AUROC (strips that refer back, all) and how often the best strip answers."""
    print(f"\n{name}: {len(questions)} questions, cut into strips as the refiner cuts them")
    print("| reading of a strip that refers back | AUROC, strips that refer back | AUROC, all | best strip answers |")
    print("|---|---:|---:|---:|")
    for reading, read in READINGS.items():
        scored: Dict[str, Tuple[List[int], List[float]]] = {"back": ([], []), "all": ([], [])}
        best = 0
        for question, title, strips, labels in questions:
            texts = [read(s, strips[i - 1].text if i else "", title) for i, s in enumerate(strips)]
            scores = scorer.score_texts(question, texts)
            best += labels[max(range(len(scores)), key=scores.__getitem__)] == 1
            for strip, label, score in zip(strips, labels, scores):
                for part in ("back", "all") if _back(strip) else ("all",):
                    if label is not None:
                        scored[part][0].append(label)
                        scored[part][1].append(score)
        auroc = {k: roc_auc_score(*v) if len(set(v[0])) == 2 else float("nan") for k, v in scored.items()}
        print(
            f"| {reading} | {auroc['back']:.3f} ({len(scored['back'][0])} strips) | {auroc['all']:.3f} | "
            f"{best / max(len(questions), 1):.1%} |"
        )


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs-file", type=Path, required=True)
    parser.add_argument("--scifact", type=Path, default=None, help="a SciFact folder (corpus.jsonl, questions.jsonl)")
    parser.add_argument("--limit", type=int, default=None, help="the first N questions of each set only")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.pairs_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    scorer = EvidenceScorer(corpus=sorted({r["passage"] for r in rows}))
    measure("SQuAD 2.0 (datasets/train)", scorer, labelled_paragraphs(rows)[: args.limit])
    if args.scifact is not None:
        abstracts, claims = scifact_abstracts(args.scifact)
        measure("SciFact", EvidenceScorer(corpus=abstracts), claims[: args.limit])


if __name__ == "__main__":
    main()
