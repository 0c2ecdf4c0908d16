"""In-process llama.cpp generation with the bundled SmolLM2 GGUF (ChatML prompts, schema-bound JSON)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from typing import Any, AsyncIterator, Dict, Generator, Iterator, List, Optional, Sequence, Type

from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.types import Model

from llama_index_crag.deadline import step_deadline
from llama_index_crag.errors import CorrectiveTimeout, MissingDependency

try:
    from llama_index.llms.llama_cpp import LlamaCPP
except ImportError as exc:  # the optional [local] extra
    raise MissingDependency("in-process generation needs llama.cpp: pip install 'llama-index-crag[local]'") from exc

from llama_index_crag.local.bundled import bundled_gguf_path
from llama_index_crag.local.cores import usable_cores

# JSON forbids raw control characters inside strings; llama.cpp's JSON grammars allow any character
# but the quote and the backslash, so a small model can emit a raw newline that no parser accepts.
_GRAMMAR_CHAR = re.compile(r'\[\^"\\\\\]')
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F]'


def json_grammar(schema: Optional[Dict[str, Any]] = None) -> Any:
    """A llama.cpp grammar for JSON (for ``schema`` when given) whose strings hold no raw control characters."""
    from llama_cpp.llama_grammar import JSON_GBNF, LlamaGrammar, json_schema_to_gbnf

    text = JSON_GBNF if schema is None else json_schema_to_gbnf(json.dumps(schema))
    return LlamaGrammar.from_string(_GRAMMAR_CHAR.sub(lambda _: _JSON_CHAR, text), verbose=False)


def close_json_prefix(text: str) -> str:
    """Close a JSON text cut short (its open string, arrays and objects), as grammar-bound output cut at its token cap.

    The grammar keeps every prefix valid, so closing what is open gives JSON, unless
    the cut fell between a key and its value or inside a number or literal: that text
    is returned closed all the same, and fails validation with the parser's message.
    A small model that rambles inside a string (a rewrite longer than the cap) thus
    yields the text it wrote so far rather than an error.
    """
    closers: List[str] = []
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            closers.append("}" if char == "{" else "]")
        elif char in "}]" and closers:
            closers.pop()
    if in_string:
        text = (text[:-1] if escaped else text) + '"'
    text = text.rstrip()
    if text.endswith(","):
        text = text[:-1]
    return text + "".join(reversed(closers))


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
    Calls to the model are serialised: llama.cpp contexts are not thread-safe. Inside a
    step with a time limit (``llama_index_crag.deadline``), a call waits for the model no
    longer than the step may run (``CorrectiveTimeout``) and stops generating at the
    deadline, so an abandoned rewrite does not hold the model for the queries after it.
    The model runs on ``n_threads`` threads, by default as many as the process has cores
    (``usable_cores``): more threads than cores slow llama.cpp down by an order of
    magnitude, so several processes on one machine should share the cores out.
    """

    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def __init__(
        self,
        model_path: Optional[str] = None,
        context_window: int = 4096,
        n_threads: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("temperature", 0.0)
        kwargs.setdefault("max_new_tokens", 128)
        kwargs.setdefault("model_kwargs", {"seed": 0, "n_threads": n_threads or usable_cores()})
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

    @contextlib.contextmanager
    def _turn(self) -> Iterator[Any]:
        """Hold the model, waiting no longer than the running step may run; yields the stopping criteria that end
        its generation at the step's deadline (also set in ``generate_kwargs``, which is the model's own and read
        only by the holder of the lock). A call that ran to the deadline raises ``CorrectiveTimeout`` rather than
        return a cut text."""
        deadline = step_deadline()
        if not self._lock.acquire(timeout=-1 if deadline is None else max(deadline - time.monotonic(), 0.0)):
            raise CorrectiveTimeout()
        stop = self.generate_kwargs["stopping_criteria"] = _stop_at(deadline)
        try:
            yield stop
            if deadline is not None and time.monotonic() >= deadline:  # cut short: not an answer
                raise CorrectiveTimeout()
        finally:
            self.generate_kwargs.pop("stopping_criteria", None)
            self._lock.release()

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
        with self._turn():
            return super().complete(prompt, formatted=formatted, **kwargs)

    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
        lock = self._lock
        with self._turn():  # the stream's own generator takes its stopping criteria now
            inner = super().stream_complete(prompt, formatted=formatted, **kwargs)

        def locked() -> Any:
            with lock:
                yield from inner

        return locked()

    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
        # llama.cpp has no async API: the blocking call runs in a worker thread, off the event loop.
        return await asyncio.to_thread(self.complete, prompt, formatted, **kwargs)

    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
        tokens = await asyncio.to_thread(self.stream_complete, prompt, formatted, **kwargs)
        return _pulled_in_threads(tokens)

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Any:
        return await asyncio.to_thread(self.chat, messages, **kwargs)

    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Any:
        tokens = await asyncio.to_thread(self.stream_chat, messages, **kwargs)
        return _pulled_in_threads(tokens)

    def structured_predict(
        self,
        output_cls: Type[Model],
        prompt: PromptTemplate,
        llm_kwargs: Optional[Dict[str, Any]] = None,
        **prompt_args: Any,
    ) -> Model:
        grammar = json_grammar(output_cls.model_json_schema())
        to_prompt = self.completion_to_prompt or chatml_completion_to_prompt
        text = to_prompt(prompt.format(llm=self, **prompt_args))
        with self._turn() as stop:
            out = self._model(
                prompt=text, grammar=grammar, max_tokens=self.max_new_tokens, temperature=0.0, stopping_criteria=stop
            )
        choice = out["choices"][0]
        if choice.get("finish_reason") == "length":  # cut at max_new_tokens: a valid prefix, closed if it can be
            return output_cls.model_validate_json(close_json_prefix(choice["text"]))
        return output_cls.model_validate_json(choice["text"])

    async def astructured_predict(
        self,
        output_cls: Type[Model],
        prompt: PromptTemplate,
        llm_kwargs: Optional[Dict[str, Any]] = None,
        **prompt_args: Any,
    ) -> Model:
        return await asyncio.to_thread(lambda: self.structured_predict(output_cls, prompt, llm_kwargs, **prompt_args))


def _stop_at(deadline: Optional[float]) -> Any:
    """llama.cpp stopping criteria that end a generation at ``deadline`` (None: none)."""
    if deadline is None:
        return None
    from llama_cpp import StoppingCriteriaList

    return StoppingCriteriaList([lambda _tokens, _logits: time.monotonic() >= deadline])


async def _pulled_in_threads(tokens: Generator[Any, None, None]) -> AsyncIterator[Any]:
    """A blocking token stream as an async one: each token decoded in a worker thread, off the event loop.

    When the reader stops early the stream is closed, so the model's lock is released as
    soon as the token being decoded is done.
    """
    try:
        while (token := await asyncio.to_thread(next, tokens, None)) is not None:
            yield token
    finally:
        with contextlib.suppress(ValueError):  # still decoding in its thread: it closes when collected
            tokens.close()
