"""Two graders the issue suggested, tried on this machine against the evidence scorer on the same split.

``cross-encoder``: the bundled all-MiniLM-L6-v2 weights with a fresh one-logit head,
fine-tuned as a cross-encoder on the (question, candidate) pairs of four fifths of a
labelled set's questions (a candidate is positive when it is a gold passage of an
answerable question), then scored on the held-out fifth. The evidence scorer is
refitted on the same four fifths and scored on the same fifth.

``query-likelihood``: the bundled SmolLM2 reads each candidate and the score is how
much more likely the question becomes after it, per question token:
``(log P(question | passage) - log P(question)) / tokens`` (zero-shot, nothing fitted),
on a sample of batches; the evidence scorer with its shipped weights on the same batches.

Both print out-of-corpus and unanswerable AUROC and pairs per second. Run (minutes
on 2 cores):

    OMP_NUM_THREADS=2 python benchmarks/grader_experiments.py cross-encoder --dataset ../shared/datasets/squad2
    python benchmarks/grader_experiments.py query-likelihood --dataset ../shared/datasets/scifact --limit 80
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np
from sklearn.metrics import roc_auc_score

from llama_index_crag.calibration.fit import IN_CORPUS, OUT_OF_CORPUS, UNANSWERABLE, Batch, labelled_batches
from llama_index_crag.scorers.evidence import EvidenceScorer


def held_out_fold(batches: Sequence[Batch], folds: int = 5) -> List[bool]:
    """True for the batches of one fifth of the questions (all batches of a question together)."""
    qids = sorted({b.question.qid for b in batches})
    order = np.random.default_rng(0).permutation(len(qids))
    test = {qids[i] for i in order[: len(qids) // folds]}
    return [b.question.qid in test for b in batches]


def aurocs(batches: Sequence[Batch], scores: Sequence[float]) -> Dict[str, float]:
    """In-corpus against each other kind, by the batch's best candidate score."""
    kinds, values = np.asarray([b.kind for b in batches]), np.asarray(scores)
    result = {}
    for other in (OUT_OF_CORPUS, UNANSWERABLE):
        positive, negative = values[kinds == IN_CORPUS], values[kinds == other]
        if len(positive) and len(negative):
            labels = [1] * len(positive) + [0] * len(negative)
            result[other] = round(float(roc_auc_score(labels, np.concatenate([positive, negative]))), 3)
    return result


def timed(score: Callable[[Batch], List[float]], batches: Sequence[Batch]) -> Tuple[List[float], float]:
    """The best candidate score of each batch, and pairs scored per second."""
    start, pairs, best = time.perf_counter(), 0, []
    for batch in batches:
        best.append(max(score(batch)))
        pairs += len(batch.texts)
    return best, pairs / (time.perf_counter() - start)


def report(name: str, batches: Sequence[Batch], score: Callable[[Batch], List[float]]) -> None:
    best, rate = timed(score, batches)
    print(f"{name}: AUROC {aurocs(batches, best)}, {rate:.1f} pairs/s", flush=True)


def cross_encoder(args: argparse.Namespace) -> None:
    import torch
    from sentence_transformers import CrossEncoder

    from llama_index_crag.local.bundled import bundled_embedding_path

    labelled = labelled_batches(args.dataset, progress=False)
    test_mask = held_out_fold(labelled.batches)
    train = [b for b, t in zip(labelled.batches, test_mask) if not t]
    test = [b for b, t in zip(labelled.batches, test_mask) if t]
    pairs = [(b.question.question, text, float(g and b.has_answer)) for b in train for text, g in zip(b.texts, b.gold)]
    positives = sum(p[2] for p in pairs)
    print(f"{len(train)} training batches ({len(pairs)} pairs, {positives:.0f} positive), {len(test)} held out")

    model = CrossEncoder(str(bundled_embedding_path()), num_labels=1, max_length=args.max_length, device="cpu")
    network, tokenizer = model.model, model.tokenizer
    optimiser = torch.optim.AdamW(network.parameters(), lr=args.lr)
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor((len(pairs) - positives) / max(positives, 1.0)))
    network.train()
    start = time.perf_counter()
    for epoch in range(args.epochs):
        random.Random(epoch).shuffle(pairs)
        for i in range(0, len(pairs), args.batch_size):
            chunk = pairs[i : i + args.batch_size]
            encoded = tokenizer(
                [p[0] for p in chunk],
                [p[1] for p in chunk],
                truncation="only_second",
                max_length=args.max_length,
                padding=True,
                return_tensors="pt",
            )
            loss = loss_fn(network(**encoded).logits.view(-1), torch.tensor([p[2] for p in chunk]))
            loss.backward()
            optimiser.step()
            optimiser.zero_grad()
        print(f"epoch {epoch + 1}: last loss {loss.item():.3f}, {time.perf_counter() - start:.0f} s", flush=True)
    network.eval()
    print(f"trained {len(pairs) * args.epochs / (time.perf_counter() - start):.1f} pairs/s")

    def score(batch: Batch) -> List[float]:
        pairs_ = [(batch.question.question, text) for text in batch.texts]
        logits = model.predict(pairs_, batch_size=32, show_progress_bar=False, activation_fn=torch.nn.Identity())
        return [float(v) for v in logits]

    report("fine-tuned cross-encoder", test, score)
    evidence = EvidenceScorer(corpus=labelled.corpus)
    labelled.prime(evidence)
    rows = np.concatenate([evidence.features(b.question.question, b.texts) for b in train])
    evidence.fit(rows, np.concatenate([np.asarray(b.gold) & b.has_answer for b in train]))
    report(
        "evidence (fitted on the same training questions)",
        test,
        lambda b: evidence.score_texts(b.question.question, b.texts),
    )


def query_likelihood(args: argparse.Namespace) -> None:
    from llama_cpp import Llama

    from llama_index_crag.local.bundled import bundled_gguf_path

    labelled = labelled_batches(args.dataset, progress=False)
    order = np.random.default_rng(0).permutation(len(labelled.batches))[: args.limit]
    batches = [labelled.batches[i] for i in sorted(order)]
    llm = Llama(model_path=str(bundled_gguf_path()), n_ctx=1024, logits_all=True, verbose=False, n_batch=512)

    def log_probability(passage: str, question: str) -> float:
        prefix = llm.tokenize(f"Passage: {passage}\nA question this passage answers:".encode(), add_bos=True)[-700:]
        target = llm.tokenize(f" {question}".encode(), add_bos=False)[:60]
        llm.reset()
        llm.eval(prefix + target)
        logits = np.asarray(llm.scores[len(prefix) - 1 : len(prefix) + len(target) - 1], dtype=np.float64)
        peak = logits.max(axis=1, keepdims=True)
        normaliser = (peak + np.log(np.exp(logits - peak).sum(axis=1, keepdims=True))).ravel()
        return float(np.sum(logits[np.arange(len(target)), target] - normaliser)) / len(target)

    def score(batch: Batch) -> List[float]:
        alone = log_probability("(none)", batch.question.question)
        return [log_probability(text, batch.question.question) - alone for text in batch.texts]

    print(f"{len(batches)} batches of {args.dataset}")
    report("query likelihood (SmolLM2-135M)", batches, score)
    evidence = EvidenceScorer(corpus=labelled.corpus)
    labelled.prime(evidence)
    report("evidence (shipped weights)", batches, lambda b: evidence.score_texts(b.question.question, b.texts))
    llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=["cross-encoder", "query-likelihood"])
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=192)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--limit", type=int, default=80, help="batches for query-likelihood")
    args = parser.parse_args()
    (cross_encoder if args.experiment == "cross-encoder" else query_likelihood)(args)


if __name__ == "__main__":
    main()
