"""Which strip the answer step quotes first, by the answer model's probability alone and by its ranker.

For each half of each shared set: every question's dense top-``k`` batch, labelled as
``llama-crag calibrate`` labels it (``calibration.fit.labelled_batches``: in-corpus when a
gold passage was retrieved, out-of-corpus with the gold passages hidden, unanswerable),
is cut into strips as the quoter cuts it and every strip is read by the answer model.
Printed per set and half:

- how often the first strip, and the first two (``max_quotes``), of an in-corpus batch
  hold the answer (SQuAD's and ClapNQ's short answers; SciFact's evidence sentences,
  scored as ``llama-crag eval`` scores a quote), ordered by the probability alone and by
  the ranker (``AnswerModel.ranks``);
- the AUROC of the batch's highest probability, in-corpus batches against the
  out-of-corpus and the unanswerable ones: what the quote decision reads, which the
  ranker does not change (it orders the strips, it does not decide whether one is quoted).

No grader, refinement or decision is involved, so it takes seconds a set; the end-to-end
figures are ``benchmarks/check_halves.py``'s. Choose on ``--half design``; report ``check``:

    OMP_NUM_THREADS=2 python benchmarks/answer_ranking.py --half design
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
from sklearn.metrics import roc_auc_score

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llama_index_crag.answers.extract import (  # noqa: E402
    AnswerModel,
    EvidenceQuoter,  # noqa: E402
    answer_features,
    packaged_answer_model,
)
from llama_index_crag.calibration.fit import IN_CORPUS, OUT_OF_CORPUS, UNANSWERABLE, labelled_batches  # noqa: E402
from llama_index_crag.evaluation.dataset import (  # noqa: E402
    EvalQuestion,
    contains_any,
    load_eval_questions,
    quotes_any,
)
from llama_index_crag.scorers.evidence import EvidenceScorer  # noqa: E402


def measure(folder: Path, half: str, model: AnswerModel, limit: Optional[int], k: int) -> Dict[str, float]:
    """The figures of one half of the set in ``folder``, its first ``limit`` questions."""
    from llama_index.core.schema import NodeWithScore, TextNode

    labelled = labelled_batches(folder, k=k, limit=limit, split=half, progress=False)
    gold = {e.question.qid: e for e in load_eval_questions(folder, half)}
    scorer = EvidenceScorer(corpus=labelled.corpus)
    labelled.prime(scorer)
    quoter = EvidenceQuoter(scorer, answer_threshold=0.0, model=model)
    hits: Dict[str, List[bool]] = {"probability 1": [], "probability 2": [], "ranker 1": [], "ranker 2": []}
    highest: Dict[str, List[float]] = {IN_CORPUS: [], OUT_OF_CORPUS: [], UNANSWERABLE: []}
    for batch in labelled.batches:
        found = quoter.candidates([NodeWithScore(node=TextNode(text=t)) for t in batch.texts])
        if not found:
            highest[batch.kind].append(0.0)
            continue
        features = answer_features(batch.question.question, [f[0] for f in found], quoter.evidence)
        probabilities = model.probabilities(features)
        highest[batch.kind].append(float(probabilities.max()))
        if batch.kind != IN_CORPUS:
            continue
        question = gold[batch.question.qid]
        for name, scores in (("probability", probabilities), ("ranker", model.ranks(features, probabilities))):
            texts = [found[i][0].text for i in np.argsort(-scores, kind="stable")[:2]]
            for quotes in (1, 2):
                hits[f"{name} {quotes}"].append(bool(_answers(texts[:quotes], question)))
    figures = {key: float(np.mean(v)) if v else float("nan") for key, v in hits.items()}
    figures["questions"] = len(hits["ranker 1"])
    answering = highest[IN_CORPUS]
    for other in (OUT_OF_CORPUS, UNANSWERABLE):
        rest = highest[other]
        figures[other] = (
            float(roc_auc_score([1] * len(answering) + [0] * len(rest), answering + rest))
            if answering and rest
            else float("nan")
        )
    return figures


def _answers(texts: List[str], question: EvalQuestion) -> Optional[bool]:
    """Whether ``texts`` quoted together answer: a short answer among them, or one of a claim's evidence sentences
    quoted (as ``llama-crag eval`` scores a quote)."""
    if question.answers:
        return contains_any(" ".join(texts), question.answers)
    return quotes_any(texts, question.gold_context)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default=str(ROOT.parent / "shared" / "datasets"), help="the shared sets")
    parser.add_argument("--sets", default="squad2,clapnq,scifact", help="comma-separated sets")
    parser.add_argument("--half", default="design", choices=("design", "check"), help="the half to measure")
    parser.add_argument("--limit", type=int, default=None, help="the first N questions of each half")
    parser.add_argument("--k", type=int, default=5, help="candidates retrieved per question")
    parser.add_argument("--model", default=None, help="an answer model folder (default: the packaged one)")
    args = parser.parse_args(argv)
    model = packaged_answer_model() if args.model is None else AnswerModel.load(args.model)
    if model.ranker is None:
        parser.error("this answer model has no ranker to compare: train it again (llama-crag train-answers)")
    print(f"{args.half} halves: first strip / first two hold the answer, by probability -> by the ranker; AUROC of")
    print("the highest probability, answering batches against out-of-corpus / unanswerable ones\n")
    print("| set | questions | first strip | first two | AUROC out of corpus / unanswerable |")
    print("|---|---:|---|---|---|")
    for name in [s.strip() for s in args.sets.split(",") if s.strip()]:
        f = measure(Path(args.datasets) / name, args.half, model, args.limit, args.k)
        print(
            f"| {name} | {f['questions']:.0f} | {100 * f['probability 1']:.1f}% -> {100 * f['ranker 1']:.1f}% "
            f"| {100 * f['probability 2']:.1f}% -> {100 * f['ranker 2']:.1f}% "
            f"| {f[OUT_OF_CORPUS]:.3f} / {f[UNANSWERABLE]:.3f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
