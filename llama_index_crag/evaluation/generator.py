"""The generator as the evaluation sees it: every prompt's tokens counted, generation optionally skipped."""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any, Callable, Optional, Tuple

from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen, LLMMetadata
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.llms import LLM
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from llama_index_crag.errors import ConfigError, MissingDependency

SKIPPED_ANSWER = "(generation skipped)"
#: The bundled generator's context window and output budget (``BundledLlamaCPP``'s defaults), which a skipped
#: generation reports when no generator is installed, so that prompts are packed as they would be for it.
BUNDLED_CONTEXT_WINDOW = 4096
BUNDLED_NUM_OUTPUT = 128

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


def token_counter_without_generator() -> Tuple[TokenCounter, str]:
    """The input-token counter for a run with no generator, and what it counts: SmolLM2's vocabulary where its
    GGUF and llama.cpp are installed, else the bundled embedding model's word pieces (figures of another unit)."""
    try:
        return generator_token_counter(), "SmolLM2's vocabulary"
    except (MissingDependency, FileNotFoundError):
        from transformers import AutoTokenizer

        from llama_index_crag.local.bundled import bundled_embedding_path

        pieces = AutoTokenizer.from_pretrained(str(bundled_embedding_path()))
        counter: TokenCounter = lambda text: len(pieces.tokenize(text))  # noqa: E731
        return counter, "MiniLM's word pieces (SmolLM2's vocabulary is not installed)"


class MeteredLLM(CustomLLM):
    """Stands in front of the generator: counts the tokens of each prompt, then generates or skips.

    With ``generate=False`` every prompt is answered with ``SKIPPED_ANSWER`` at once,
    so that figures that do not depend on the answer (abstention, context, input
    tokens, pipeline latency) can be measured over a whole dataset. The prompt is
    still built and packed exactly as for the real generator, whose metadata (context
    window, output budget) it reports; with no generator, the bundled one's.

    Args:
        llm: The real generator, or None where none is installed (``generate=False`` only).
        count_tokens: The tokenizer of the input-token figure.
        generate: False to skip generation.
    """

    generate: bool = True
    _llm: Optional[LLM] = PrivateAttr()
    _count: TokenCounter = PrivateAttr()
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _tokens: int = PrivateAttr(default=0)
    _calls: int = PrivateAttr(default=0)

    def __init__(self, llm: Optional[LLM], count_tokens: TokenCounter, generate: bool = True) -> None:
        if llm is None and generate:
            raise ConfigError("generating answers needs a generator: make local, or skip generation (--no-generate)")
        super().__init__(generate=generate)
        self._llm = llm
        self._count = count_tokens

    @classmethod
    def class_name(cls) -> str:
        return "MeteredLLM"

    @property
    def metadata(self) -> LLMMetadata:
        if self._llm is None:
            return LLMMetadata(context_window=BUNDLED_CONTEXT_WINDOW, num_output=BUNDLED_NUM_OUTPUT, model_name="none")
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
        if not self.generate or self._llm is None:
            return CompletionResponse(text=SKIPPED_ANSWER)
        return self._llm.complete(prompt, formatted=False, **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        response = self.complete(prompt, formatted=formatted, **kwargs)

        def once() -> CompletionResponseGen:
            yield CompletionResponse(text=response.text, delta=response.text)

        return once()
