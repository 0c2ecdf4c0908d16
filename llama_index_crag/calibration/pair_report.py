"""The grader measured on labelled (question, passage) pairs held out from training: ``llama-crag grade-pairs``.

Only the held-out part of a pairs file is read (the same stable split ``train-grader``
uses), so a reader trained on that file is measured on questions and articles it never
saw. A scorer with fitted weights (the evidence model and the reader's stacked model) is
cross-validated: its weights are fitted on the other folds' pairs, folds by group (an
article, else a question), and every pair is scored by weights that never saw it.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from llama_index_crag.calibration.labelled import group_folds, group_of, is_held_out, read_rows
from llama_index_crag.calibration.training import auroc
from llama_index_crag.errors import DatasetError
from llama_index_crag.scorers.base import sigmoid
from llama_index_crag.scorers.evidence import EvidenceScorer


def held_out_rows(path: Path | str, limit: Optional[int] = None, seed: int = 0) -> List[Dict[str, Any]]:
    """The rows of ``path`` held out from training (a sample of ``limit`` of them, spread over every source)."""
    rows = [r for r in read_rows(path) if is_held_out(r)]
    if not rows:
        raise DatasetError(f"{path} has no held-out pairs")
    if limit is not None and limit < len(rows):
        picked = np.random.default_rng(seed).choice(len(rows), size=limit, replace=False)
        rows = [rows[int(i)] for i in sorted(picked)]
    return rows


def _by_source(rows: Sequence[Dict[str, Any]], labels: np.ndarray, scores: np.ndarray) -> Dict[str, Any]:
    figures: Dict[str, Any] = {"all": {"pairs": len(rows), "auroc": round(auroc(labels.tolist(), scores), 4)}}
    sources: Dict[str, List[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        sources[str(row.get("source", "labelled"))].append(i)
    for source, index in sorted(sources.items()):
        y = labels[index]
        figures[source] = {
            "pairs": len(index),
            "auroc": round(auroc(y.tolist(), scores[index]), 4) if 0 < y.sum() < len(y) else None,
        }
    return figures


def pair_figures(
    scorer: Any, rows: Sequence[Dict[str, Any]], folds: int = 5, progress: Callable[[Any], Any] = iter
) -> Dict[str, Any]:
    """AUROC of ``scorer`` on ``rows``, overall and by source; fitted scorers cross-validated over ``folds``."""
    labels = np.asarray([int(r["label"]) for r in rows])
    result: Dict[str, Any] = {"scorer": scorer.name}
    if isinstance(scorer, EvidenceScorer):
        groups = [group_of(r) for r in rows]
        if len(set(groups)) < 2:
            # A file of one source holds out a tenth of its articles, which can be a single article (SQuAD's half).
            raise DatasetError(
                f"cross-validating {scorer.name} by article or question needs held-out pairs from two or more; "
                f"all {len(rows)} come from {groups[0]!r}. Grade a file with more articles (or sources)"
            )
        features = np.vstack([scorer.features(r["question"], [r["passage"]]) for r in progress(rows)])
        folds = min(folds, len(set(groups)))
        fold_of = group_folds(groups, folds)
        scores = np.zeros(len(rows))
        for fold in range(folds):
            test = fold_of == fold
            if test.any():
                weights = scorer.fit(features[~test], labels[~test].astype(bool)).weights.copy()
                scores[test] = [sigmoid(float(v)) for v in features[test] @ weights[:-1] + weights[-1]]
        result["protocol"] = f"{folds}-fold cross-validation by article or question"
        result["figures"] = _by_source(rows, labels, scores)
        if "reader" in scorer.feature_names:
            reader = features[:, list(scorer.feature_names).index("reader")]
            result["reader_alone"] = _by_source(rows, labels, reader)
        cosine = features[:, 0]
        result["cosine_alone"] = _by_source(rows, labels, cosine)
    else:
        scores = np.asarray([scorer.score_texts(r["question"], [r["passage"]])[0] for r in progress(rows)])
        result["protocol"] = "as it scores (nothing fitted)"
        result["figures"] = _by_source(rows, labels, scores)
    return result


def pair_table(results: Sequence[Dict[str, Any]]) -> str:
    """The figures as a Markdown table: one row per scorer and source."""
    lines = ["| scorer | pairs of | pairs | AUROC |", "|---|---|---|---|"]
    for result in results:
        for key, label in (("figures", ""), ("reader_alone", " (reader logit alone)"), ("cosine_alone", " (cosine)")):
            if key == "cosine_alone" and result is not results[0]:
                continue
            for source, values in result.get(key, {}).items():
                value = "-" if values["auroc"] is None else f"{values['auroc']:.3f}"
                lines.append(f"| {result['scorer']}{label} | {source} | {values['pairs']} | {value} |")
    return "\n".join(lines)
