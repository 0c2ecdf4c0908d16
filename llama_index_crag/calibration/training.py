"""Training the reading grader on CPU: the bundled MiniLM fine-tuned on pairs made from the user's corpus.

The reader is a cross-encoder: the question and a passage window go through the
encoder together, the token states are mean-pooled (the bundled checkpoint never
trained its pooler) and a linear head gives one logit, "this passage answers".
Only the top layers and the head are trained by default: on two cores that is
about twice the pairs per second of full fine-tuning, and the grader directory
then holds a few megabytes (those layers and the head) on top of the base model,
which it names and checks by a hash of its weights.

Training runs under a hard time budget with a progress bar, checkpoints that a
later run resumes from, positives weighted in the loss, linear warm-up and decay,
and keeps the checkpoint with the best held-out AUROC. At the end it re-measures
the held-out AUROC with the dynamically quantised (int8) model that inference uses.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
from numpy.typing import ArrayLike
from tqdm import tqdm

from llama_index_crag.errors import DatasetError, GraderLoadError
from llama_index_crag.scorers.reader_model import (
    GRADER_FILE,
    GRADER_VERSION,
    WEIGHTS_FILE,
    Reader,
    base_fingerprint,
)

CHECKPOINT_FILE = "checkpoint.pt"
#: A LoRA adapter's learning rate when none is given: LoRA's usual tenfold of full fine-tuning's.
LORA_LEARNING_RATE = 5e-4


@dataclass(frozen=True)
class Pair:
    """A (question, passage) pair: ``label`` 1 when the passage holds the answer; ``kind`` says how it was made."""

    query: str
    passage: str
    label: int
    kind: str
    doc_id: str


@dataclass(frozen=True)
class PairSet:
    """Pairs split by document into training and held-out parts, with the count of each kind."""

    train: List[Pair]
    held_out: List[Pair]

    def counts(self) -> Dict[str, Dict[str, int]]:
        return {
            "train": dict(Counter(p.kind for p in self.train)),
            "held_out": dict(Counter(p.kind for p in self.held_out)),
        }


@dataclass
class TrainingConfig:
    """How the reader is trained; the defaults are the recipe measured in docs/grading.md."""

    max_length: int = 128
    batch_size: int = 16
    learning_rate: float = 5e-5
    head_learning_rate: float = 1e-3
    warmup_share: float = 0.06
    epochs: float = 1.0
    train_layers: int = 6
    minutes: float = 40.0
    eval_every: int = 150
    eval_pairs: int = 800
    checkpoint_every: int = 50
    seed: int = 0
    threads: Optional[int] = None
    #: Stop after this step of the schedule (which stays that of ``epochs``): for equal-step comparisons; resumable.
    max_steps: Optional[int] = None
    #: How token states become one vector for the head: "mean" (the default) or "cls" (the first token's state).
    pooling: str = "mean"
    #: Train a LoRA adapter of this rank on every layer instead of the top ``train_layers`` (0: no adapter).
    lora_rank: int = 0
    #: "cpu" (the point: a grader trained where it will run), or "cuda" where a GPU is at hand.
    device: str = "cpu"


def default_learning_rate(lora_rank: int) -> float:
    """The learning rate when none is given: ``TrainingConfig``'s, or ``LORA_LEARNING_RATE`` with an adapter."""
    return LORA_LEARNING_RATE if lora_rank else TrainingConfig.learning_rate


def auroc(labels: Sequence[int], scores: ArrayLike) -> float:
    """Area under the ROC curve (ties count half)."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(np.asarray(labels), np.asarray(scores)))


def _held_out_sample(pairs: Sequence[Pair], size: int, seed: int) -> List[Pair]:
    rng = random.Random(seed)
    return list(pairs) if len(pairs) <= size else rng.sample(list(pairs), size)


def _by_source(held: Sequence[Pair], scores: np.ndarray) -> Dict[str, float]:
    """Held-out AUROC of each source that has both labels: a labelled pair's source is the part of its ``kind``
    before the colon ("qnli:sentence_entailment"); pairs made from a corpus are "corpus"."""
    groups: Dict[str, List[int]] = {}
    for i, pair in enumerate(held):
        groups.setdefault(pair.kind.split(":")[0] if ":" in pair.kind else "corpus", []).append(i)
    out = {}
    for source, rows in sorted(groups.items()):
        labels = [held[i].label for i in rows]
        if 0 < sum(labels) < len(labels):
            out[source] = round(auroc(labels, scores[rows]), 4)
    return out


# A resumed run may get a new time budget, step limit or thread count; anything else changes what it learns.
_RUN_ONLY = ("minutes", "threads", "max_steps")


def _resumable(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in _RUN_ONLY}


def train_grader(
    pairs: PairSet,
    out: Path | str,
    base: Optional[Path] = None,
    config: Optional[TrainingConfig] = None,
    progress: bool = True,
    corpus: str = "",
    log: Callable[[str], None] = print,
) -> Dict[str, Any]:
    """Train the reader on ``pairs`` into the grader directory ``out``; resume from its checkpoint when one is there.

    Returns the grader description written to ``out/grader.json``.
    """
    import torch

    from llama_index_crag.local.bundled import bundled_embedding_path

    config = config or TrainingConfig()
    base = Path(base or bundled_embedding_path())
    out = Path(out)
    positives = sum(p.label for p in pairs.train)
    negatives = len(pairs.train) - positives
    if not positives or not negatives:  # before anything is written: no empty grader folder is left behind
        raise DatasetError("training the reader needs both positive and negative pairs")
    out.mkdir(parents=True, exist_ok=True)
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    started = time.monotonic()
    budget_s = config.minutes * 60.0

    reader = Reader(base, config.max_length, device=config.device, pooling=config.pooling, lora_rank=config.lora_rank)
    names = reader.trainable(config.train_layers)
    params = [p for p in reader.model.parameters() if p.requires_grad]
    encoder_params = [p for p in reader.encoder.parameters() if p.requires_grad]
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor(negatives / positives, device=config.device))
    steps_per_epoch = math.ceil(len(pairs.train) / config.batch_size)
    total_steps = max(1, int(steps_per_epoch * config.epochs))
    # The head starts from nothing and needs larger steps than the pretrained layers under it.
    optimizer = torch.optim.AdamW(
        [
            {"params": encoder_params, "lr": config.learning_rate},
            {"params": list(reader.head.parameters()), "lr": config.head_learning_rate},
        ],
        weight_decay=0.01,
    )
    warmup = max(1, int(total_steps * config.warmup_share))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (total_steps - s) / max(1, total_steps - warmup)))
    )
    rng = np.random.default_rng(config.seed)
    order = np.concatenate([rng.permutation(len(pairs.train)) for _ in range(math.ceil(config.epochs) or 1)])
    held = _held_out_sample(pairs.held_out, config.eval_pairs, config.seed)
    held_labels = [p.label for p in held]

    def held_scores(encoder: Any = None, model: Optional[Reader] = None) -> np.ndarray:
        return (model or reader).score([p.query for p in held], [p.passage for p in held], encoder=encoder)

    def evaluate(encoder: Any = None) -> float:
        return auroc(held_labels, held_scores(encoder))

    step, best, history, trained_s = 0, -1.0, [], 0.0
    checkpoint = out / CHECKPOINT_FILE
    if checkpoint.exists():
        saved = torch.load(str(checkpoint), weights_only=False, map_location=config.device)
        # Settings added since the checkpoint was written take the value that run had: their defaults.
        saved_config = _resumable({**asdict(TrainingConfig()), **saved["config"]})
        if saved_config != _resumable(asdict(config)) or saved["pairs"] != len(pairs.train):
            raise GraderLoadError(f"{checkpoint} was made with other settings or pairs: remove it to start afresh")
        reader.model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        step, best, history, trained_s = saved["step"], saved["best"], saved["history"], saved["trained_s"]
        log(f"resumed from step {step} of {total_steps} (best held-out AUROC so far {best:.3f})")
        if step and not (out / WEIGHTS_FILE).exists():  # the best weights were deleted: the checkpoint's stand in
            best = evaluate()
            reader.save(out, names)
            log(f"{out / WEIGHTS_FILE} was missing: the checkpoint's weights replace it (held-out AUROC {best:.3f})")
    evaluated = time.monotonic()
    if step == 0:
        best = evaluate()
        history.append({"step": 0, "held_out_auroc": round(best, 4)})
        log(f"untrained reader: held-out AUROC {best:.3f} on {len(held)} pairs")
        reader.save(out, names)
    # The final evaluations (fp32 and int8) fit inside the budget too: stop early enough for them.
    final_s = 2.5 * (time.monotonic() - evaluated)

    def save_checkpoint() -> None:
        torch.save(
            {
                "config": asdict(config),
                "pairs": len(pairs.train),
                "model": reader.model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step,
                "best": best,
                "history": history,
                "trained_s": trained_s + time.monotonic() - started,
            },
            str(checkpoint) + ".tmp",
        )
        Path(str(checkpoint) + ".tmp").replace(checkpoint)

    def remember(score: float, rate: float) -> None:
        nonlocal best
        history.append({"step": step, "held_out_auroc": round(score, 4), "pairs_per_s": round(rate, 2)})
        if score > best:
            best = score
            reader.save(out, names)
        bar.write(f"step {step}: held-out AUROC {score:.3f} (best {best:.3f})")

    bar = tqdm(total=total_steps, initial=step, desc="training reader", unit="step", disable=not progress)
    stopped = "finished"
    window_start, window_pairs = time.monotonic(), 0
    last_step = min(total_steps, config.max_steps or total_steps)
    while step < last_step:
        if time.monotonic() - started + final_s > budget_s:
            stopped = f"time budget of {config.minutes:g} min reached"
            break
        reader.model.train()
        rows = [pairs.train[int(i)] for i in order[step * config.batch_size : (step + 1) * config.batch_size]]
        batch = reader.encode([p.query for p in rows], [p.passage for p in rows])
        labels = torch.tensor([float(p.label) for p in rows], device=config.device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=config.device.startswith("cuda")):
            logits = reader.logits(batch)
        loss = loss_fn(logits.float(), labels)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        step += 1
        window_pairs += len(rows)
        rate = window_pairs / max(time.monotonic() - window_start, 1e-9)
        bar.set_postfix(loss=f"{loss.item():.3f}", pairs_s=f"{rate:.1f}")
        bar.update(1)
        if step % config.eval_every == 0:
            remember(evaluate(), rate)
        if step % config.checkpoint_every == 0:
            save_checkpoint()
    bar.close()
    if stopped == "finished" and step < total_steps:
        stopped = f"step limit of {last_step} reached"
    if history[-1]["step"] != step:  # the last steps since an evaluation count too
        remember(evaluate(), window_pairs / max(time.monotonic() - window_start, 1e-9))
    save_checkpoint()

    # The figures are of what was saved, read back as inference reads it: a plain reader on the CPU.
    final = Reader(base, config.max_length, pooling=config.pooling) if config.lora_rank else reader.to("cpu")
    final.load(out / WEIGHTS_FILE)
    scores = held_scores(model=final)
    fp32 = auroc(held_labels, scores)
    int8 = auroc(held_labels, held_scores(final.quantized_encoder(), model=final))
    description = {
        "version": GRADER_VERSION,
        "kind": "reader",
        "base_model": f"{base.parent.name}/{base.name}",
        "base_fingerprint": base_fingerprint(base),
        "trained_parameters": sorted(names),
        "max_length": config.max_length,
        "config": asdict(config),
        "corpus": corpus,
        "pairs": pairs.counts(),
        "positive_share": round(positives / len(pairs.train), 3),
        "steps": step,
        "total_steps": total_steps,
        "stopped": stopped,
        "held_out_auroc": round(fp32, 4),
        "held_out_auroc_int8": round(int8, 4),
        "held_out_pairs": len(held),
        "held_out_auroc_by_source": _by_source(held, scores),
        "history": history,
        "minutes": round((trained_s + time.monotonic() - started) / 60.0, 2),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    (out / GRADER_FILE).write_text(json.dumps(description, indent=2) + "\n")
    return description
