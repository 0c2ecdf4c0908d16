"""Training the answer step's network (``answers.extract``) on human-labelled sentence pairs.

Only pairs whose passage is one sentence or a few facts are read (``SENTENCE_KINDS``):
the answer step chooses sentences, not paragraphs. A tenth of each source is held out
by group (``calibration.labelled.is_held_out``: an article or a question never
straddles the two parts) and measured after training, by source.
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
from tqdm import tqdm

from llama_index_crag.answers.extract import (
    ANSWER_FEATURES,
    RANK_FEATURES,
    RANKER,
    AnswerModel,
    Candidate,
    QuoteDecision,
    answer_features,
    asked_names,
    leads,
)
from llama_index_crag.calibration.labelled import is_held_out, read_rows
from llama_index_crag.errors import DatasetError
from llama_index_crag.scorers.evidence import EvidenceScorer
from llama_index_crag.text.patterns import NAME

#: The kinds of pair whose passage is a sentence or a few facts (the pairs file's ``source:kind``); a pairs file
#: without kinds is read whole.
SENTENCE_KINDS = frozenset(
    {
        "qnli:sentence_entailment",
        "qnli:sentence_not_entailment",
        "squad2:sentence_with_answer",
        "squad2:sentence_same_paragraph",
        "halueval:supporting_facts",
        "halueval:facts_without_answer",
        "halueval:similar_question_facts",
    }
)
HIDDEN_UNITS = 8
#: The kinds of pair ``swapped`` makes.
MADE_KINDS = frozenset({"figure_swapped", "name_swapped"})
#: A figure or code in a question (a word with a digit: "2023", "Q2", "EU-2"), and one digit of it.
_DIGITS = re.compile(r"[\w-]*\d[\w-]*")
_DIGIT = re.compile(r"\d")
#: A capitalised name ("Singapore", "McKinsey").


def _sentence_rows(path: Path | str) -> List[Dict[str, Any]]:
    rows = list(read_rows(path))
    kinds = {f"{r.get('source')}:{r.get('kind')}" for r in rows}
    if kinds & SENTENCE_KINDS:
        rows = [r for r in rows if f"{r.get('source')}:{r.get('kind')}" in SENTENCE_KINDS]
    if not rows:
        raise DatasetError(f"{path} holds no labelled pairs")
    return rows


def swapped(rows: Sequence[Dict[str, Any]], seed: int = 0) -> List[Dict[str, Any]]:
    """Negatives made from the positives: the same passage with the figure or the name the question asks about
    replaced by another one ("Q3 2023" where the question names "Q2 2023", "Toronto" where it names "Singapore").

    Human-labelled sentence pairs hardly ever hold a passage that answers a question about another quarter or
    another office, so a network trained on them alone learns that sharing the question's words is answering it;
    these pairs teach it that a figure or name the passage does not state weighs against it. Each keeps its
    source's and group's place (``is_held_out``), so a held-out question's swaps are held out too.
    """
    rng = random.Random(seed)
    names = sorted({n for r in rows for n in NAME.findall(str(r["passage"]))})
    made: List[Dict[str, Any]] = []
    for row in rows:
        if int(row["label"]) != 1:
            continue
        question, passage = str(row["question"]), str(row["passage"])
        codes = [c for c in _DIGITS.findall(question) if c in passage]
        wanted = set(asked_names(question))
        asked = [n for n in NAME.findall(question) if n.casefold() in wanted and n in passage]
        if codes:
            code = rng.choice(codes)
            last = list(_DIGIT.finditer(code))[-1]
            digit = str((int(last.group(0)) + rng.randint(1, 9)) % 10)
            other = code[: last.start()] + digit + code[last.end() :]
            made.append({**row, "passage": passage.replace(code, other), "label": 0, "kind": "figure_swapped"})
        elif asked and names:
            name = rng.choice(asked)
            other = rng.choice(names)
            if other != name and other not in question:
                made.append({**row, "passage": passage.replace(name, other), "label": 0, "kind": "name_swapped"})
    return made


def pair_features(rows: Sequence[Dict[str, Any]], scorer: EvidenceScorer, progress: bool = True) -> np.ndarray:
    """``ANSWER_FEATURES`` of each pair, the passage read as one strip under its title (when the row has one)."""
    found = [
        answer_features(
            str(r["question"]), [Candidate(str(r["passage"]), _graded(r), str(r.get("title") or ""))], scorer
        )
        for r in tqdm(rows, desc="features", disable=not progress)
    ]
    return np.concatenate(found)


def balanced(indices: np.ndarray, sources: Sequence[str], seed: int = 0) -> np.ndarray:
    """``indices`` drawn so that every source gives as many pairs as the largest: HotpotQA's facts are three
    quarters of the pairs, and a network fitted on them as they come learns HotpotQA, not sentences."""
    rng = np.random.default_rng(seed)
    by_source: Dict[str, List[int]] = {}
    for i in indices:
        by_source.setdefault(sources[i], []).append(int(i))
    size = max(len(v) for v in by_source.values())
    return np.concatenate([rng.choice(v, size=size, replace=len(v) < size) for _, v in sorted(by_source.items())])


def question_leads(rows: Sequence[Dict[str, Any]], features: np.ndarray) -> np.ndarray:
    """The ranker's ``RANK_FEATURES`` of each pair: how it leads the other labelled sentences of the same question
    and source (SQuAD's sentence with the answer against the rest of its paragraph, HotpotQA's facts against the
    distractors). A pair made by swapping, or alone with its question, leads nothing (0)."""
    groups: Dict[Any, List[int]] = {}
    for i, row in enumerate(rows):
        if row.get("kind") not in MADE_KINDS:
            groups.setdefault((row.get("source"), str(row["question"])), []).append(i)
    found = np.zeros((len(rows), len(RANK_FEATURES)))
    for members in groups.values():
        found[members] = leads(features[members])
    return found


def _top_first(groups: Dict[Any, List[int]], scores: np.ndarray, labels: np.ndarray) -> Optional[float]:
    """The share of ``groups`` (with an answering pair and another) whose best-scored pair answers."""
    mixed = [m for m in groups.values() if len(set(labels[m])) == 2]
    if not mixed:
        return None
    return round(float(np.mean([labels[m[int(np.argmax(scores[m]))]] for m in mixed])), 4)


def _graded(row: Dict[str, Any]) -> str:
    title = str(row.get("title") or "").strip()
    return f"{title}. {row['passage']}" if title else str(row["passage"])


def train_answer_model(
    pairs_file: Path | str,
    out: Path | str,
    progress: bool = True,
    seed: int = 0,
    max_iter: int = 400,
    threshold: float = 0.5,
) -> Dict[str, Any]:
    """Train the answer network on the sentence pairs of ``pairs_file``, write it to ``out``; its figures.

    ``threshold`` is the probability at which the engine quotes a strip, whatever the grade of its evidence
    (``benchmarks/quote_threshold.py`` fits one that follows the grade; ``quote_threshold`` overrides both)."""
    from sklearn.metrics import roc_auc_score
    from sklearn.neural_network import MLPClassifier

    started = time.perf_counter()
    rows = _sentence_rows(pairs_file)
    made = swapped(rows, seed)
    rows += made
    scorer = EvidenceScorer(corpus=[_graded(r) for r in rows])
    features = pair_features(rows, scorer, progress)
    labels = np.asarray([int(r["label"]) for r in rows])
    held = np.asarray([is_held_out(r) for r in rows])
    if held.all() or not held.any():
        raise DatasetError(f"{pairs_file} gives no held-out or no training pairs")
    train = balanced(np.flatnonzero(~held), [str(r.get("source") or "pairs") for r in rows], seed)

    def network(x: np.ndarray) -> Dict[str, np.ndarray]:
        mean, scale = x[train].mean(axis=0), x[train].std(axis=0)
        scale[scale < 1e-6] = 1.0
        fitted = MLPClassifier(
            hidden_layer_sizes=(HIDDEN_UNITS,),
            alpha=1e-2,
            max_iter=max_iter,
            early_stopping=True,
            random_state=seed,
        ).fit((x[train] - mean) / scale, labels[train])
        layers = (fitted.coefs_[0], fitted.intercepts_[0], fitted.coefs_[1], fitted.intercepts_[1])
        return {"mean": mean, "scale": scale, **dict(zip(("w1", "b1", "w2", "b2"), layers))}

    lead = question_leads(rows, features)
    ranker = network(np.hstack([features, lead]))
    model = AnswerModel({**network(features), **{RANKER + k: v for k, v in ranker.items()}})
    everything_p = model.probabilities(features)
    held_p = everything_p[held]
    all_sources = np.asarray([str(r.get("source") or "pairs") for r in rows])
    sources = all_sources[held]
    ranked = (everything_p + model.read_against(features, lead)) / 2.0
    held_groups: Dict[str, Dict[Any, List[int]]] = {}
    for i in np.flatnonzero(held):
        if rows[i].get("kind") not in MADE_KINDS:
            held_groups.setdefault(all_sources[i], {}).setdefault(str(rows[i]["question"]), []).append(int(i))

    def auroc(scores: np.ndarray, mask: np.ndarray) -> Optional[float]:
        wanted = labels[held][mask]
        return round(float(roc_auc_score(wanted, scores[mask])), 4) if len(set(wanted)) == 2 else None

    everything = np.ones(len(sources), dtype=bool)
    model.info = {
        "trained_on": str(pairs_file),
        "pairs": {"train": int((~held).sum()), "held_out": int(held.sum()), "made_by_swapping": len(made)},
        "held_out_auroc": auroc(held_p, everything),
        "held_out_auroc_by_source": {s: auroc(held_p, sources == s) for s in sorted(set(sources))},
        "held_out_auroc_coverage_alone": auroc(features[held][:, ANSWER_FEATURES.index("coverage")], everything),
        # Of the held-out questions with an answering sentence and another: how often the first one quoted answers.
        "held_out_first_answers": {
            source: {"probability": _top_first(g, everything_p, labels), "ranker": _top_first(g, ranked, labels)}
            for source, g in sorted(held_groups.items())
        },
        "hidden_units": HIDDEN_UNITS,
        "decision": QuoteDecision.constant(threshold).to_dict(),
        "minutes": round((time.perf_counter() - started) / 60.0, 1),
    }
    model.save(out)
    return model.info


def summary(info: Dict[str, Any]) -> str:
    """One line of what ``train_answer_model`` measured."""

    def shown(value: Optional[float]) -> str:
        return "n/a (one label held out)" if value is None else f"{value:.3f}"

    by_source = ", ".join(f"{k} {shown(v)}" for k, v in info["held_out_auroc_by_source"].items())
    first = "; ".join(
        f"{k} {shown(v['probability'])} -> {shown(v['ranker'])}"
        for k, v in info.get("held_out_first_answers", {}).items()
        if v["probability"] is not None
    )
    return (
        f"Answer model trained on {info['pairs']['train']} pairs in {info['minutes']} min: held-out AUROC "
        f"{shown(info['held_out_auroc'])} (the question's words alone "
        f"{shown(info['held_out_auroc_coverage_alone'])}; {by_source})."
        + (f" First strip quoted answers, by probability -> by the ranker: {first}." if first else "")
    )
