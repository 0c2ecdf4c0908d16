"""The reading grader's model: the bundled MiniLM as a cross-encoder with a mean-pooled linear head (torch only).

It depends on torch, transformers and safetensors alone, so that training can run
where the rest of the library is not installed (a GPU machine, say).
"""

from __future__ import annotations

import copy
import hashlib
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from llama_index_crag.errors import ConfigError, GraderLoadError, MissingDependency

GRADER_VERSION = 1
GRADER_FILE = "grader.json"
WEIGHTS_FILE = "reader.safetensors"
#: How the token states become the head's input: their mean (default), or the first ([CLS]) token's state.
POOLINGS = ("mean", "cls")
#: The encoder's linear layers that a LoRA adapter trains (every layer's attention and feed-forward, not the pooler).
LORA_TARGETS = r".*layer\.\d+\..*(query|key|value|dense)"
#: LoRA's scale is alpha / rank; alpha is twice the rank, so the adapter's update is scaled by 2.
LORA_ALPHA_PER_RANK = 2
#: How a saved adapter's factors are named: the adapted linear layer's name in a plain reader, then the factor.
_SAVED_FACTOR = re.compile(r"(?P<module>.+)\.lora_(?P<factor>[AB])\.weight")
_PEFT_FACTOR = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<factor>[AB])\.default\.weight")


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in blocks (a packaged grader records its weights' hash)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_weights(
    state: Dict[str, Any], path: Path, half: bool = False, metadata: Optional[Dict[str, str]] = None
) -> None:
    """Write tensors to a safetensors file (``half``: as float16), with the file's string ``metadata``."""
    import torch
    from safetensors.torch import save_file

    dtype = torch.float16 if half else torch.float32
    tensors = {n: w.detach().cpu().to(dtype).contiguous() for n, w in state.items()}
    save_file(tensors, str(path), metadata=metadata)


def read_weights(path: Path, device: str = "cpu") -> Tuple[Dict[str, Any], Dict[str, str]]:
    """A safetensors file's tensors and string metadata; a ``GraderLoadError`` for a file that cannot be read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}, handle.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for a damaged header or body
        raise GraderLoadError(f"{path} cannot be read as safetensors weights ({exc}): retrain or reinstall it") from exc


def base_fingerprint(base: Path) -> str:
    """A short hash of the base model's weights: a grader refuses a base other than the one it was trained on."""
    files = sorted(base.glob("*.safetensors")) or sorted(base.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"no model weights in {base}")
    digest = hashlib.sha256()
    for f in files:
        with f.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


class Reader:
    """The cross-encoder: an encoder, mean pooling and a linear head over (question, passage) pairs."""

    def __init__(
        self, base: Path, max_length: int = 128, device: str = "cpu", pooling: str = "mean", lora_rank: int = 0
    ) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        if pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
        if lora_rank < 0:
            raise ConfigError(f"lora_rank must be 0 (no adapter) or more, not {lora_rank}")
        self.base = base
        self.pooling = pooling
        self.max_length = max_length
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(str(base))
        self.encoder = AutoModel.from_pretrained(str(base))
        self.lora_rank = lora_rank
        if lora_rank:  # training only: what is saved is the adapter's factors, which a plain reader adds on load
            try:
                from peft import LoraConfig, get_peft_model
            except ImportError as exc:
                raise MissingDependency("a LoRA adapter needs peft: pip install 'llama-index-crag[train]'") from exc

            adapter = LoraConfig(
                r=lora_rank, lora_alpha=LORA_ALPHA_PER_RANK * lora_rank, lora_dropout=0.1, target_modules=LORA_TARGETS
            )
            self.encoder = get_peft_model(self.encoder, adapter)
        self.head = torch.nn.Linear(self.encoder.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.bias)
        torch.nn.init.normal_(self.head.weight, std=0.02)
        self.model = torch.nn.ModuleDict({"encoder": self.encoder, "head": self.head}).to(device)

    def encode(self, queries: Sequence[str], passages: Sequence[str]) -> Dict[str, Any]:
        batch = self.tokenizer(
            list(queries),
            list(passages),
            truncation="longest_first",  # the passage, unless the question is the longer
            max_length=self.max_length,
            padding=True,
            return_tensors="pt",
        )
        return {k: v.to(self.device) for k, v in batch.items()}

    def logits(self, batch: Dict[str, Any], encoder: Any = None) -> Any:
        states = (encoder or self.encoder)(**batch).last_hidden_state
        if self.pooling == "cls":
            return self.head(states[:, 0]).squeeze(-1)
        mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
        pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.head(pooled).squeeze(-1)

    def trainable(self, layers: int) -> List[str]:
        """Freeze all but the top ``layers`` encoder layers (all of them when ``layers`` covers the model), or, with
        a LoRA adapter, all but the adapter and the head; returns the names of the weights ``save`` writes."""
        if self.lora_rank:
            for name, param in self.model.named_parameters():
                param.requires_grad = name.startswith("head.") or "lora_" in name
            return sorted(self._adapter_state())
        total = self.encoder.config.num_hidden_layers
        names = []
        for name, param in self.model.named_parameters():
            train = name.startswith("head.")
            if ".layer." in name:
                train = train or int(name.split(".layer.")[1].split(".")[0]) >= total - layers
            elif layers >= total:
                train = True
            param.requires_grad = train
            if train:
                names.append(name)
        return names

    def score(
        self, queries: Sequence[str], passages: Sequence[str], batch_size: int = 32, encoder: Any = None
    ) -> np.ndarray:
        """Logits for pairs, in batches, without gradients."""
        import torch

        out: List[np.ndarray] = []
        self.model.eval()
        with torch.inference_mode():
            for i in range(0, len(queries), batch_size):
                batch = self.encode(queries[i : i + batch_size], passages[i : i + batch_size])
                out.append(self.logits(batch, encoder).float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros(0)

    def to(self, device: str) -> Reader:
        """Move the model (training may run on a GPU; int8 inference runs on the CPU)."""
        self.model.to(device)
        self.device = device
        return self

    def quantized_encoder(self) -> Any:
        """The encoder with its linear layers dynamically quantised to int8 (what inference runs, on the CPU)."""

        import torch

        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(self.encoder), {torch.nn.Linear}, dtype=torch.qint8)

    def save(self, out: Path, names: Sequence[str], half: bool = False) -> None:
        """Write the trained weights (``half``: as float16, half the size, for shipping; loading casts back).

        With a LoRA adapter, what is written is the adapter's factors and the head (under a plain reader's
        names, with its scale in the file's metadata), well under a megabyte; ``load`` adds them to the base."""
        state = self._adapter_state() if self.lora_rank else self.model.state_dict()
        scale = {"lora_scale": str(float(LORA_ALPHA_PER_RANK))} if self.lora_rank else None
        save_weights({n: state[n] for n in names}, out / WEIGHTS_FILE, half=half, metadata=scale)

    def _adapter_state(self) -> Dict[str, Any]:
        """With a LoRA adapter: its factors, named after the linear layer they adapt in a plain reader, and the head."""
        state = {}
        for name, weight in self.encoder.state_dict().items():
            found = _PEFT_FACTOR.fullmatch(name)
            if found:
                state[f"encoder.{found['module']}.lora_{found['factor']}.weight"] = weight
        state.update({f"head.{n}": w for n, w in self.head.state_dict().items()})
        return state

    def load(self, path: Path) -> None:
        """Load trained weights over the base model's; float16 weights are cast to the model's float32.

        An adapter's factors are added to the linear layers they adapt (``W + scale * B @ A``), so that the
        reader runs as fast as one trained in full; a factor that fits no layer is refused."""
        weights, metadata = read_weights(path, self.device)
        factors: Dict[str, Dict[str, Any]] = {}  # module -> {"A": down, "B": up}
        for name in list(weights):
            found = _SAVED_FACTOR.fullmatch(name)
            if found:
                factors.setdefault(found["module"], {})[found["factor"]] = weights.pop(name)
        own = self.model.state_dict()
        unknown = set(weights) - set(own)
        if unknown:
            raise GraderLoadError(f"{path} holds weights this reader does not have: {sorted(unknown)[:3]}")
        for name, weight in weights.items():
            if weight.shape != own[name].shape:
                raise GraderLoadError(
                    f"{path} holds {name} of shape {tuple(weight.shape)}, not this reader's {tuple(own[name].shape)}"
                )
        self.model.load_state_dict(weights, strict=False)
        if factors:
            self._add_adapter(path, factors, float(metadata.get("lora_scale", LORA_ALPHA_PER_RANK)), own)

    def _add_adapter(self, path: Path, factors: Dict[str, Dict[str, Any]], scale: float, own: Dict[str, Any]) -> None:
        import torch

        with torch.no_grad():
            for module in sorted(factors):
                down, up = factors[module].get("A"), factors[module].get("B")
                target = own.get(f"{module}.weight")
                if down is None or up is None or target is None:
                    raise GraderLoadError(f"{path} holds an adapter for {module}, which this reader cannot apply")
                if up.shape[1] != down.shape[0] or (up.shape[0], down.shape[1]) != tuple(target.shape):
                    raise GraderLoadError(
                        f"{path} holds an adapter for {module} of shape {tuple(up.shape)} x {tuple(down.shape)}, "
                        f"which does not fit its weight of shape {tuple(target.shape)}"
                    )
                target.add_(up.float() @ down.float(), alpha=scale)
