"""A trained grader directory made ready to ship: ``llama-crag pack-grader``.

The packed directory holds the trained layers and head as float16 (half the size;
loading casts them back to float32), the SHA-256 of those weights (a damaged file is
refused, not used), the stacked model and three-band thresholds fitted by
``llama-crag calibrate --scorer reader:DIR`` (so the grader works before any calibration
on the user's data), whether inference runs int8 or float32, and a NOTICE with the
licence of the data the weights were trained on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from llama_index_crag.errors import ConfigError
from llama_index_crag.scorers.reader_model import GRADER_FILE, WEIGHTS_FILE, file_sha256, read_weights, save_weights
from llama_index_crag.settings_sources import read_calibration

NOTICE_FILE = "NOTICE"


def pack_grader(
    grader: Path | str,
    out: Path | str,
    calibration: Optional[Path | str] = None,
    quantize: bool = False,
    notice: Optional[str] = None,
) -> Dict[str, Any]:
    """Write ``grader`` (a ``train-grader`` directory) to ``out`` as a shippable grader; returns its description."""
    from llama_index_crag.scorers.reader import load_reader

    grader, out = Path(grader), Path(out)
    if out.resolve() == grader.resolve():
        raise ConfigError(f"pack-grader would overwrite its input {grader}: name another --out")
    _, _, info = load_reader(grader, quantize=False)  # refuses a grader that would not load
    fitted: Dict[str, Any] = {}
    if calibration is not None:  # checked whole before anything is written
        data = read_calibration(calibration, None)  # the same checks the engine makes
        scorer = str(data.get("scorer", ""))
        if not scorer.startswith("reader:"):
            raise ConfigError(f"{calibration} was fitted for scorer {scorer!r}, not for a reader")
        if not isinstance(data.get("scorer_state"), dict):
            raise ConfigError(f"{calibration} holds no fitted stack (scorer_state): calibrate with --scorer reader:DIR")
        thresholds = data["thresholds"]
        if not 0.0 <= thresholds["lower"] <= thresholds["upper"] <= 1.0:
            raise ConfigError(f"{calibration}: thresholds must satisfy 0 <= lower <= upper <= 1, got {thresholds}")
        fitted["stack"] = data["scorer_state"]
        fitted["thresholds"] = {k: thresholds[k] for k in ("upper", "lower", "strip_threshold") if k in thresholds}
        fitted["calibration"] = {k: data.get(k) for k in ("dataset", "created", "samples", "achieved")}
    out.mkdir(parents=True, exist_ok=True)
    weights, metadata = read_weights(grader / WEIGHTS_FILE)  # full weights, or an adapter and head
    save_weights(weights, out / WEIGHTS_FILE, half=True, metadata=metadata or None)
    packed = {k: v for k, v in info.items() if k not in ("history",)}
    packed["history"] = info.get("history", [])[-5:]
    packed["weights_dtype"] = "float16"
    packed["weights_sha256"] = file_sha256(out / WEIGHTS_FILE)
    packed["quantize"] = quantize
    packed.update(fitted)
    (out / GRADER_FILE).write_text(json.dumps(packed, indent=2) + "\n", encoding="utf-8")
    if notice:
        (out / NOTICE_FILE).write_text(notice, encoding="utf-8")
    return packed
