"""Forms of the offline grade, fitted on the design halves and read on the check halves of every shared set.

The evidence scorer's grade is a logistic model over its eleven features, fitted on the
(question, candidate) pairs of the three design halves (``llama-crag calibrate --split
design``: the gold passage of a batch with the answer is relevant, every other candidate
is not; each set counts the same, its pairs weighing 1 / its number of batches). This
fits other forms of the grade on the same pairs, with the same weights, and prints for
each set and half what the batch grade (the highest over the top-``k`` candidates) does:

- the AUROC of the batches with the answer against the out-of-corpus ones and against
  the unanswerable ones;
- "caught at the cap": the share of each put under the highest ``lower`` that leaves at
  most ``--cap`` of the batches with the answer under it, chosen on that half's own rows
  (``report_figures.caught_at_cap``: a bound, not a result). It is what a target such as
  "false abstention at most 5% while 90% of out-of-corpus questions abstain" asks of the
  grade.

Forms: ``shipped`` (``EvidenceScorer.DEFAULT_WEIGHTS``, as the engine grades), ``logistic``
(the same form refitted here: how far the shipped fit is from this one), ``mlp`` (one
hidden layer of 8 units, the mean of three seeds, each on a draw of the pairs by weight)
and ``trees`` (gradient-boosted trees of depth 2). A form earns a place only where its
check-half figures hold on every set; the design halves show how much of a gain is fit.
No engine is involved: a minute for the three sets.

    OMP_NUM_THREADS=2 python benchmarks/grader_forms.py
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llama_index_crag.calibration.fit import IN_CORPUS, OUT_OF_CORPUS, UNANSWERABLE, labelled_batches  # noqa: E402
from llama_index_crag.calibration.report_figures import auroc, caught_at_cap  # noqa: E402
from llama_index_crag.scorers.base import fit_logistic  # noqa: E402
from llama_index_crag.scorers.evidence import EvidenceScorer  # noqa: E402

SETS = ("squad2", "clapnq", "scifact")
HALVES = ("design", "check")
OTHERS = (OUT_OF_CORPUS, UNANSWERABLE)
#: A form maps a batch's feature rows (one a candidate) to one score a candidate; the batch's grade is the highest.
Form = Callable[[np.ndarray], np.ndarray]


@dataclass
class Half:
    """One half of one set: each batch's candidate features and relevance labels, and its kind."""

    features: List[np.ndarray]
    labels: List[np.ndarray]
    kinds: np.ndarray


def read_half(folder: Path, half: str, k: int, limit: Optional[int]) -> Half:
    """The labelled top-``k`` batches of one half of the set in ``folder``, as ``llama-crag calibrate`` makes them."""
    labelled = labelled_batches(folder, k=k, limit=limit, split=half, progress=False)
    scorer = EvidenceScorer(corpus=labelled.corpus)
    labelled.prime(scorer)
    batches = [b for b in labelled.batches if b.texts]
    return Half(
        [scorer.features(b.question.question, b.texts) for b in batches],
        [np.asarray(b.gold, dtype=bool) & b.has_answer for b in batches],
        np.asarray([b.kind for b in batches]),
    )


def fit_forms(design: Sequence[Half], seed: int = 0, seeds: int = 3) -> Dict[str, Form]:
    """Each form of the grade, fitted on the pairs of the ``design`` halves, each half counting the same; the
    networks start from seeds ``seed`` to ``seed + seeds - 1``."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.neural_network import MLPClassifier
    from sklearn.preprocessing import StandardScaler

    x = np.concatenate([f for h in design for f in h.features])
    y = np.concatenate([lab for h in design for lab in h.labels]).astype(int)
    weight = np.concatenate([np.full(sum(len(f) for f in h.features), 1.0 / len(h.features)) for h in design])
    shipped = np.asarray(EvidenceScorer.DEFAULT_WEIGHTS)
    refitted = fit_logistic(x, y, weight)
    scaler = StandardScaler().fit(x)
    networks = []
    for start in range(seed, seed + seeds):  # the network takes no sample weights: draw the pairs by weight instead
        drawn = np.random.default_rng(start).choice(len(x), size=len(x), p=weight / weight.sum())
        network = MLPClassifier((8,), alpha=1e-3, max_iter=500, random_state=start)
        networks.append(network.fit(scaler.transform(x[drawn]), y[drawn]))
    trees = HistGradientBoostingClassifier(max_depth=2, learning_rate=0.05, max_iter=200, random_state=seed)
    trees.fit(x, y, sample_weight=weight / weight.mean())
    return {
        "shipped": lambda f: f @ shipped[:-1] + shipped[-1],
        "logistic": lambda f: f @ refitted[:-1] + refitted[-1],
        "mlp": lambda f: np.mean([n.predict_proba(scaler.transform(f))[:, 1] for n in networks], axis=0),
        "trees": lambda f: trees.predict_proba(f)[:, 1],
    }


def measure(half: Half, form: Form, cap: float) -> Dict[str, Optional[float]]:
    """AUROC against each other kind, and what the grade catches of it at the cap, for one half under one form."""
    scores = np.asarray([float(np.max(form(f))) for f in half.features])
    at_cap = caught_at_cap(scores, half.kinds, cap)
    figures: Dict[str, Optional[float]] = {}
    for other in OTHERS:
        figures[f"auroc {other}"] = auroc(scores[half.kinds == IN_CORPUS], scores[half.kinds == other])
        figures[f"caught {other}"] = at_cap["caught"].get(other) if at_cap else None
    return figures


def _pair(first: Optional[float], second: Optional[float], scale: float, digits: int) -> str:
    shown = ["-" if v is None else f"{v * scale:.{digits}f}" for v in (first, second)]
    return " / ".join(shown)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default=str(ROOT.parent / "shared" / "datasets"), help="folder of the sets")
    parser.add_argument("--sets", default=",".join(SETS), help="comma-separated set folders (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="the first N questions of each half")
    parser.add_argument("--k", type=int, default=5, help="candidates a batch (default: %(default)s)")
    parser.add_argument("--cap", type=float, default=0.05, help="share of answering batches under lower (%(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the first network's seed (default: %(default)s)")
    parser.add_argument("--out", default=None, help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    if not 0.0 <= args.cap < 1.0:
        parser.error(f"--cap must be at least 0 and below 1, got {args.cap}")
    names = [s.strip() for s in args.sets.split(",") if s.strip()]
    if not names:
        parser.error("--sets names no set")
    halves = {
        (name, half): read_half(Path(args.datasets) / name, half, args.k, args.limit)
        for name in names
        for half in HALVES
    }
    forms = fit_forms([halves[(name, "design")] for name in names], seed=args.seed)
    results: Dict[str, Dict[str, Dict[str, Dict[str, Optional[float]]]]] = {}
    cap = f"{args.cap:.0%}"
    for name in names:
        sizes = ", ".join(f"{half} {len(halves[(name, half)].features)} batches" for half in HALVES)
        print(f"\n{name} ({sizes}): out of corpus / unanswerable")
        print(f"| form | design AUROC | design caught at {cap} | check AUROC | check caught at {cap} |")
        print("|---|---|---|---|---|")
        results[name] = {}
        for form_name, form in forms.items():
            row = {half: measure(halves[(name, half)], form, args.cap) for half in HALVES}
            results[name][form_name] = row
            cells = [
                _pair(row[half][f"{what} {OUT_OF_CORPUS}"], row[half][f"{what} {UNANSWERABLE}"], scale, digits)
                for half in HALVES
                for what, scale, digits in (("auroc", 1.0, 3), ("caught", 100.0, 1))
            ]
            print(f"| {form_name} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"cap": args.cap, "k": args.k, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
