"""CorrectiveChatEngine: each chat turn condensed with its history and answered by the corrective loop, checked."""

from __future__ import annotations

import copy
import re
from typing import TYPE_CHECKING, Any, List, Optional

from llama_index.core.chat_engine import CondenseQuestionChatEngine
from llama_index.core.chat_engine.types import StreamingAgentChatResponse
from llama_index.core.llms import LLM, ChatMessage, MessageRole
from llama_index.core.memory import BaseMemory, ChatMemoryBuffer

from llama_index_crag.text.split import terms

if TYPE_CHECKING:
    from llama_index_crag.core.engine import CorrectiveQueryEngine

#: Tokens of history kept for condensing when the LLM does not say its window (the newest turns are kept).
DEFAULT_HISTORY_TOKENS = 3000
#: A turn that leans on the one before: it opens with a conjunction, or points back at something.
_FOLLOW_UP = re.compile(
    r"^\s*(and|or|but|also|what about|how about)\b"
    r"|\b(it|its|they|them|their|that one|this one|those|these|the (first|second|third|last|other|same) ones?)\b",
    re.IGNORECASE,
)


def offline_condense(history: List[ChatMessage], message: str) -> str:
    """A standalone question without an LLM: the message, after the last question when it leans on it."""
    previous = next((m.content for m in reversed(history) if m.role == MessageRole.USER and m.content), None)
    if previous and (_FOLLOW_UP.search(message) or len(terms(message)) <= 2):
        return f"{previous} {message}"
    return message


class CorrectiveChatEngine(CondenseQuestionChatEngine):
    """A chat engine whose every turn is a ``CorrectiveQueryEngine`` query.

    The turn is condensed with the conversation into a standalone question (by the LLM, as
    LlamaIndex's ``CondenseQuestionChatEngine`` does; without one, by ``offline_condense``),
    and that question runs the whole loop: grade, correct or abstain, quote or generate,
    check. A chat answer is therefore quoted, checked, flagged or abstained exactly as a
    query's, and its trace is in the response's ``sources[0].raw_output.metadata["crag"]``.
    The history kept for condensing is bounded by tokens (the newest turns kept).

    Build it with ``engine.as_chat_engine()``.
    """

    def __init__(
        self,
        engine: CorrectiveQueryEngine,
        memory: BaseMemory,
        llm: Optional[LLM],
        verbose: bool = False,
    ) -> None:
        from llama_index.core.chat_engine.condense_question import DEFAULT_PROMPT

        super().__init__(
            engine.variant(streaming=False),
            DEFAULT_PROMPT,
            memory,
            llm,  # type: ignore[arg-type]
            verbose=verbose,
            callback_manager=engine.callback_manager,
        )
        self._streamed = engine.variant(streaming=True)

    @classmethod
    def from_engine(
        cls,
        engine: CorrectiveQueryEngine,
        llm: Optional[LLM] = None,
        memory: Optional[BaseMemory] = None,
        chat_history: Optional[List[ChatMessage]] = None,
        verbose: bool = False,
    ) -> CorrectiveChatEngine:
        """The chat engine over ``engine``; ``llm`` condenses (default: the engine's generator, if it has one)."""
        llm = llm or engine.generator
        window = llm.metadata.context_window - 256 if llm is not None else DEFAULT_HISTORY_TOKENS
        memory = memory or ChatMemoryBuffer.from_defaults(chat_history=chat_history or [], token_limit=window)
        return cls(engine, memory, llm, verbose=verbose)

    def _condense_question(self, chat_history: List[ChatMessage], last_message: str) -> str:
        if self._llm is None:
            return offline_condense(chat_history, last_message)
        return super()._condense_question(chat_history, last_message)

    async def _acondense_question(self, chat_history: List[ChatMessage], last_message: str) -> str:
        if self._llm is None:
            return offline_condense(chat_history, last_message)
        return await super()._acondense_question(chat_history, last_message)

    def _streaming(self) -> CondenseQuestionChatEngine:
        """This chat (the same memory) answering through the streaming engine."""
        streamed = copy.copy(self)
        streamed._query_engine = self._streamed
        return streamed

    def stream_chat(self, message: str, chat_history: Optional[List[ChatMessage]] = None) -> Any:
        return CondenseQuestionChatEngine.stream_chat(self._streaming(), message, chat_history)

    async def astream_chat(
        self, message: str, chat_history: Optional[List[ChatMessage]] = None
    ) -> StreamingAgentChatResponse:
        return await CondenseQuestionChatEngine.astream_chat(self._streaming(), message, chat_history)
