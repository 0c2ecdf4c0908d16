"""The reading grader trained on a GPU: is the CPU budget what limits it, or the synthetic pairs?

``llama-crag train-grader`` trains on the user's CPU in tens of minutes. This script runs
the same training loop (``calibration/training.py``, ``device="cuda"``) on a GPU machine
where only torch and transformers are installed, on many more pairs and epochs, so that
its figures show what the recipe reaches when compute is not the limit.

    # here: pairs from the corpus, and the base model in half precision (small enough to copy)
    python benchmarks/train_reader_gpu.py export --corpus ../shared/datasets/scifact --pairs 100000 --out .gpu
    # there (torch, transformers, safetensors, scikit-learn, tqdm): train; weights come back in 15 MB parts
    python benchmarks/train_reader_gpu.py train --data .gpu --out $OUT/grader --epochs 2 --max-length 192
    # here: a grader directory for grade-report / calibrate / CRAG_GRADER
    python benchmarks/train_reader_gpu.py import --parts DIR --out graders/scifact-gpu
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import shutil
import sys
import types
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parent.parent
PART_BYTES = 15 * 1024 * 1024


def export(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from llama_index_crag.calibration.pairs import make_pairs
    from llama_index_crag.local.bundled import bundled_embedding_path

    out = Path(args.out)
    base = out / "base"
    base.mkdir(parents=True, exist_ok=True)
    source = bundled_embedding_path()
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, base / f.name)
    weights = load_file(str(source / "model.safetensors"))
    save_file({k: v.to(torch.float16) for k, v in weights.items()}, str(base / "model.safetensors"))
    pairs = make_pairs(args.corpus, count=args.pairs, claims=args.claims, seed=args.seed, progress=True)
    with gzip.open(out / "pairs.jsonl.gz", "wt") as handle:
        for split in ("train", "held_out"):
            for p in getattr(pairs, split):
                handle.write(json.dumps({"split": split, **asdict(p)}) + "\n")
    print(f"{len(pairs.train)} training and {len(pairs.held_out)} held-out pairs, {pairs.counts()}; base in {base}")


def train(args: argparse.Namespace) -> None:
    # Only the training loop and the model are imported: the package's other dependencies may be absent here.
    package = types.ModuleType("llama_index_crag")
    package.__path__ = [str(REPO / "llama_index_crag")]
    sys.modules["llama_index_crag"] = package
    import torch
    from safetensors.torch import load_file, save_file

    from llama_index_crag.calibration.training import Pair, PairSet, TrainingConfig, train_grader

    data = Path(args.data)
    rows: Dict[str, List[Any]] = {"train": [], "held_out": []}
    packed = data / "pairs.jsonl.xz"  # xz when gzip's is too large to copy over
    with lzma.open(packed, "rt") if packed.exists() else gzip.open(data / "pairs.jsonl.gz", "rt") as handle:
        for line in handle:
            row = json.loads(line)
            rows[row.pop("split")].append(Pair(**row))
    base = data / "base"
    weights = load_file(str(base / "model.safetensors"))
    full = Path("/tmp/reader-base")
    shutil.copytree(base, full, dirs_exist_ok=True)
    save_file({k: v.to(torch.float32) for k, v in weights.items()}, str(full / "model.safetensors"))
    config = TrainingConfig(
        max_length=args.max_length,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        epochs=args.epochs,
        minutes=args.minutes,
        eval_every=args.eval_every,
        eval_pairs=2000,
        checkpoint_every=10**9,
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    out = Path(args.out)
    info = train_grader(PairSet(rows["train"], rows["held_out"]), out, base=full, config=config, corpus=args.corpus)
    trained = load_file(str(out / "reader.safetensors"))
    (out / "checkpoint.pt").unlink(missing_ok=True)
    (out / "reader.safetensors").unlink()
    pieces = {}
    for name, tensor in trained.items():  # half precision, large tensors cut by rows, in parts that fit
        half = tensor.to(torch.float16).contiguous()
        rows_per = max(1, PART_BYTES // 2 // max(1, half[0].numel() if half.dim() else 1))
        chunks = torch.split(half, rows_per) if half.dim() and half.numel() * 2 > PART_BYTES else [half]
        pieces.update({f"{name}@{i}": c.contiguous() for i, c in enumerate(chunks)})
    part, size, index = {}, 0, 0
    for name, tensor in pieces.items():
        if size + tensor.numel() * 2 > PART_BYTES and part:
            save_file(part, str(out.parent / f"part{index}.safetensors"))
            part, size, index = {}, 0, index + 1
        part[name] = tensor
        size += tensor.numel() * 2
    if part:
        save_file(part, str(out.parent / f"part{index}.safetensors"))
    shutil.move(str(out / "grader.json"), str(out.parent / "grader.json"))
    keys = ("steps", "total_steps", "held_out_auroc", "held_out_auroc_int8", "minutes")
    print(json.dumps({k: info[k] for k in keys}))


def import_(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file, save_file

    from llama_index_crag.local.bundled import bundled_embedding_path
    from llama_index_crag.scorers.reader_model import base_fingerprint

    parts = Path(args.parts)
    import torch

    pieces: Dict[str, Dict[int, Any]] = {}
    for f in sorted(parts.glob("part*.safetensors")):
        for key, value in load_file(str(f)).items():
            name, index = key.rsplit("@", 1)
            pieces.setdefault(name, {})[int(index)] = value
    weights = {name: torch.cat([chunks[i] for i in sorted(chunks)]).float() for name, chunks in pieces.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "reader.safetensors"))
    info = json.loads((parts / "grader.json").read_text())
    base = bundled_embedding_path()
    # Every weight is in the file (all layers were trained): the base only lends its tokenizer and configuration.
    info.update(base_model=f"{base.parent.name}/{base.name}", base_fingerprint=base_fingerprint(base))
    (out / "grader.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"Wrote {out}: {len(weights)} tensors; held-out AUROC {info['held_out_auroc']} ", end="")
    print(f"(int8 {info['held_out_auroc_int8']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    e = commands.add_parser("export")
    e.add_argument("--corpus", required=True)
    e.add_argument("--pairs", type=int, default=100_000)
    e.add_argument("--claims", type=float, default=0.5)
    e.add_argument("--seed", type=int, default=7)
    e.add_argument("--out", default=".gpu")
    e.set_defaults(run=export)
    t = commands.add_parser("train")
    t.add_argument("--data", default=".gpu")
    t.add_argument("--out", required=True)
    t.add_argument("--corpus", default="")
    t.add_argument("--epochs", type=float, default=2.0)
    t.add_argument("--max-length", type=int, default=192)
    t.add_argument("--batch-size", type=int, default=32)
    t.add_argument("--lr", type=float, default=4e-5)
    t.add_argument("--minutes", type=float, default=7.0)
    t.add_argument("--eval-every", type=int, default=500)
    t.set_defaults(run=train)
    i = commands.add_parser("import")
    i.add_argument("--parts", required=True)
    i.add_argument("--out", required=True)
    i.set_defaults(run=import_)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
