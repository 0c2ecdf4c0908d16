"""The capped, schema-bound query rewrite of the INCORRECT branch."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, List, Optional

from llama_index.core.bridge.pydantic import BaseModel, Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMStructuredPredictEndEvent, LLMStructuredPredictStartEvent
from llama_index.core.llms import LLM
from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
from llama_index.core.prompts.mixin import PromptDictType, PromptMixin, PromptMixinType

from llama_index_crag.errors import RewriteError
from llama_index_crag.local.models import describe_llm
from llama_index_crag.templates import checked_template
from llama_index_crag.text.cleaning import clean_text
from llama_index_crag.text.split import terms

DEFAULT_REWRITE_PROMPT = PromptTemplate(
    "You rewrite search queries so that a document search finds the passages that answer them.\n"
    "Expand abbreviations, add the full names of the people, products and organisations the query "
    "refers to, keep its meaning and its language. Do not answer the question.\n"
    'Reply with JSON only, in the form {{"query": "..."}}.\n'
    "Query: {query_str}\n"
)
#: The variables a rewrite template may use for the query: LlamaIndex's name, and the one this prompt had before.
QUERY_VARIABLES = ("query_str", "query")


class RewrittenQuery(BaseModel):
    """A search query rewritten for better retrieval."""

    query: str = Field(description="The rewritten search query, in the language of the original.")


class QueryRewriter(PromptMixin):
    """Rewrites a query once through the LLM's structured output (``RewrittenQuery``).

    Any failure raises ``RewriteError`` with a reason: the call raised, the output was
    not valid JSON for the schema, the rewrite was empty, it returned the query
    unchanged (retrying the same query cannot change the result), or it kept none of
    the query's words (a small model's noise, such as a run of digits).

    Args:
        llm: The LLM to rewrite with (the engine's generator by default).
        prompt: A template with a ``{query_str}`` variable (``{query}`` is also read); a prompt
            module of the engine (``engine.get_prompts()["rewrite:rewrite_prompt"]``, changed with
            ``update_prompts``, which checks the new template's variables).

    Raises:
        ConfigError: The template has no query variable, or needs one the rewrite cannot fill.
    """

    def __init__(self, llm: LLM, prompt: BasePromptTemplate = DEFAULT_REWRITE_PROMPT) -> None:
        self.llm = llm
        self.prompt = _checked_prompt(prompt)

    def _get_prompts(self) -> PromptDictType:
        return {"rewrite_prompt": self.prompt}

    def _get_prompt_modules(self) -> PromptMixinType:
        return {}

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        if "rewrite_prompt" in prompts_dict:
            self.prompt = _checked_prompt(prompts_dict["rewrite_prompt"])

    def rewrite(self, query: str) -> str:
        """Return the rewritten query or raise ``RewriteError``."""
        try:
            with _ended_on_failure():
                result = self.llm.structured_predict(RewrittenQuery, self.prompt, query_str=query, query=query)
        except Exception as exc:
            raise self._failure(exc) from exc
        return _checked(query, result)

    async def arewrite(self, query: str) -> str:
        """Async ``rewrite``: awaits the LLM."""
        try:
            with _ended_on_failure():
                result = await self.llm.astructured_predict(RewrittenQuery, self.prompt, query_str=query, query=query)
        except Exception as exc:
            raise self._failure(exc) from exc
        return _checked(query, result)

    def _failure(self, exc: Exception) -> RewriteError:
        if isinstance(exc, ValueError):  # the output parser's and pydantic's errors
            return RewriteError(f"the rewrite was not valid JSON for the schema: {exc}")
        return RewriteError(f"the rewrite call to {describe_llm(self.llm)} failed: {type(exc).__name__}: {exc}")


def _checked_prompt(prompt: BasePromptTemplate) -> BasePromptTemplate:
    return checked_template(prompt, "the rewrite prompt", QUERY_VARIABLES, [QUERY_VARIABLES])


#: The structured-prediction start events of the running rewrite that have had no end event yet (their span ids).
_open_starts: ContextVar[Optional[List[Optional[str]]]] = ContextVar("crag_open_structured_predicts", default=None)


class _StartWatcher(BaseEventHandler):
    """Notes, for the rewrite running in this context, each structured-prediction start and end event."""

    @classmethod
    def class_name(cls) -> str:
        return "CragStructuredPredictWatcher"

    def handle(self, event: Any, **kwargs: Any) -> None:
        opened = _open_starts.get()
        if opened is None:
            return
        if isinstance(event, LLMStructuredPredictStartEvent):
            opened.append(event.span_id)
        elif isinstance(event, LLMStructuredPredictEndEvent) and opened:
            opened.pop()


_llm_dispatcher = get_dispatcher("llama_index.core.llms.llm")
if not any(isinstance(h, _StartWatcher) for h in _llm_dispatcher.event_handlers):
    _llm_dispatcher.add_event_handler(_StartWatcher())


@contextmanager
def _ended_on_failure() -> Iterator[None]:
    """End every structured-prediction start event that a failing call left open.

    ``LLM.structured_predict`` emits its start event, runs the program, and emits its end
    event only when the program returns: output that fails to parse (a small model's
    usual failure) raises between the two and leaves a start without its end for every
    tracing tool. The end is emitted here, in the start's span, with no output. An LLM
    whose own ``structured_predict`` emits no start (Ollama's JSON-schema mode) gets none.
    """
    opened: List[Optional[str]] = []
    token = _open_starts.set(opened)
    try:
        yield
    except Exception:
        for span_id in reversed(opened):
            _llm_dispatcher.event(LLMStructuredPredictEndEvent(output=None, span_id=span_id))
        raise
    finally:
        _open_starts.reset(token)


def _checked(query: str, result: object) -> str:
    if not isinstance(result, RewrittenQuery):
        raise RewriteError(f"the rewrite returned {type(result).__name__}, not RewrittenQuery")
    rewritten = " ".join(clean_text(result.query).split())
    if not rewritten:
        raise RewriteError("the rewrite was empty")
    if rewritten.casefold() == " ".join(query.split()).casefold():
        raise RewriteError("the rewrite returned the query unchanged")
    asked = set(terms(query))
    if asked and not asked & set(terms(rewritten)):
        raise RewriteError(f"the rewrite kept none of the query's words: {rewritten[:120]!r}")
    return rewritten
