"""The generator as the evaluation sees it: every prompt's tokens counted, generation optionally skipped."""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any, Callable, Tuple

from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen, LLMMetadata
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.llms import LLM
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from llama_index_crag.errors import MissingDependency

SKIPPED_ANSWER = "(generation skipped)"

TokenCounter = Callable[[str], int]


@lru_cache(maxsize=1)
def generator_token_counter() -> TokenCounter:
    """Counts tokens with the bundled SmolLM2's vocabulary (its GGUF loaded without weights).

    One tokenizer for every system and mode, so generator input figures compare
    whether or not generation ran.
    """
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise MissingDependency(
            "counting generator tokens needs llama.cpp: pip install 'llama-index-crag[local]'"
        ) from exc
    from llama_index_crag.local.bundled import bundled_gguf_path

    vocab = Llama(model_path=str(bundled_gguf_path()), vocab_only=True, verbose=False)
    return lambda text: len(vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True))


class MeteredLLM(CustomLLM):
    """Stands in front of the generator: counts the tokens of each prompt, then generates or skips.

    With ``generate=False`` every prompt is answered with ``SKIPPED_ANSWER`` at once,
    so that figures that do not depend on the answer (abstention, context, input
    tokens, pipeline latency) can be measured over a whole dataset. The prompt is
    still built and packed exactly as for the real generator, whose metadata (context
    window, output budget) it reports.

    Args:
        llm: The real generator.
        count_tokens: The tokenizer of the input-token figure.
        generate: False to skip generation.
    """

    generate: bool = True
    _llm: LLM = PrivateAttr()
    _count: TokenCounter = PrivateAttr()
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _tokens: int = PrivateAttr(default=0)
    _calls: int = PrivateAttr(default=0)

    def __init__(self, llm: LLM, count_tokens: TokenCounter, generate: bool = True) -> None:
        super().__init__(generate=generate)
        self._llm = llm
        self._count = count_tokens

    @classmethod
    def class_name(cls) -> str:
        return "MeteredLLM"

    @property
    def metadata(self) -> LLMMetadata:
        # Prompts arrive as plain text; the real generator applies its own chat template.
        return self._llm.metadata.model_copy(update={"is_chat_model": False, "is_function_calling_model": False})

    def take(self) -> Tuple[int, int]:
        """Prompt tokens and calls since the last ``take``, and reset both."""
        with self._lock:
            taken = (self._tokens, self._calls)
            self._tokens = self._calls = 0
        return taken

    def _meter(self, prompt: str) -> None:
        tokens = self._count(prompt)
        with self._lock:
            self._tokens += tokens
            self._calls += 1

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        self._meter(prompt)
        if not self.generate:
            return CompletionResponse(text=SKIPPED_ANSWER)
        return self._llm.complete(prompt, formatted=False, **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        response = self.complete(prompt, formatted=formatted, **kwargs)

        def once() -> CompletionResponseGen:
            yield CompletionResponse(text=response.text, delta=response.text)

        return once()
