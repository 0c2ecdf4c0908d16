"""The capped, schema-bound query rewrite of the INCORRECT branch."""

from __future__ import annotations

import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Tuple

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
from llama_index_crag.text.compound import may_ask_several
from llama_index_crag.text.split import terms

_REWRITE_INSTRUCTIONS = (
    "You rewrite search queries so that a document search finds the passages that answer them.\n"
    "Expand abbreviations, add the full names of the people, products and organisations the query "
    "refers to, keep its meaning and its language. Do not answer the question.\n"
)
DEFAULT_REWRITE_PROMPT = PromptTemplate(
    _REWRITE_INSTRUCTIONS + "When the query asks several separate things, also write each one as a complete question "
    'of its own in "parts"; otherwise leave "parts" empty.\n'
    'Reply with JSON only, in the form {{"query": "...", "parts": []}}.\n'
    "Query: {query_str}\n"
)
#: The rewrite prompt that asks for no parts (``split_compound=False``: nothing would read them).
QUERY_ONLY_REWRITE_PROMPT = PromptTemplate(
    _REWRITE_INSTRUCTIONS + 'Reply with JSON only, in the form {{"query": "..."}}.\n' + "Query: {query_str}\n"
)
#: The variables a rewrite template may use for the query: LlamaIndex's name, and the one this prompt had before.
QUERY_VARIABLES = ("query_str", "query")


#: The most parts the rewrite's schema lets a model write (a small model repeats one word until its token cap).
MAX_REWRITE_PARTS = 6


class RewrittenQuery(BaseModel):
    """A search query rewritten for better retrieval, and its parts when it asks several things."""

    query: str = Field(description="The rewritten search query, in the language of the original.")
    parts: List[str] = Field(
        default_factory=list,
        description="Each separate thing the query asks, as a complete question of its own; empty for one question.",
        json_schema_extra={"maxItems": MAX_REWRITE_PARTS},
    )


class SearchQuery(BaseModel):
    """A search query rewritten for better retrieval (the schema when no parts are asked for)."""

    query: str = Field(description="The rewritten search query, in the language of the original.")


@dataclass(frozen=True)
class Rewrite:
    """A checked rewrite: the query to search with, and the questions it asks when the model found several.

    ``parts`` holds two or more questions only when they passed ``checked_parts``; ``parts_refused`` says why
    the model's parts were not used (empty when it wrote none, or when they were used).
    """

    query: str
    parts: Tuple[str, ...] = ()
    parts_refused: str = ""
    #: Every part the model wrote, used or refused (``parts`` holds them only when they passed).
    written: Tuple[str, ...] = field(default=())


class QueryRewriter(PromptMixin):
    """Rewrites a query once through the LLM's structured output (``RewrittenQuery``).

    Any failure raises ``RewriteError`` with a reason: the call raised, the output was
    not valid JSON for the schema, the rewrite was empty, it returned the query
    unchanged (retrying the same query cannot change the result), or it kept none of
    the query's words (a small model's noise, such as a run of digits).

    With ``parts`` (the engine's ``split_compound``), the model is also asked for the questions a query asks
    (``RewrittenQuery.parts``, checked by ``checked_parts``) when the query could ask several
    (``text.compound.may_ask_several``: a joining word, a comma, two question marks); otherwise it is asked for
    the query alone (``SearchQuery``, ``QUERY_ONLY_REWRITE_PROMPT``): a small model writes a list when it is
    asked for one, and each token costs time.

    Args:
        llm: The LLM to rewrite with (the engine's generator by default).
        prompt: A template with a ``{query_str}`` variable (``{query}`` is also read); a prompt
            module of the engine (``engine.get_prompts()["rewrite:rewrite_prompt"]``, changed with
            ``update_prompts``, which checks the new template's variables). Default: ``DEFAULT_REWRITE_PROMPT``
            for a query that could ask several things, ``QUERY_ONLY_REWRITE_PROMPT`` otherwise; a prompt of your
            own is used for every query (with the schema that asks for parts where they are asked).
        parts: Ask for the query's parts too.

    Raises:
        ConfigError: The template has no query variable, or needs one the rewrite cannot fill.
    """

    def __init__(self, llm: LLM, prompt: Optional[BasePromptTemplate] = None, parts: bool = True) -> None:
        self.llm = llm
        self.parts = parts
        self.prompt = _checked_prompt(prompt or (DEFAULT_REWRITE_PROMPT if parts else QUERY_ONLY_REWRITE_PROMPT))
        self._own_prompt = prompt is not None

    def _asked(self, query: str, parts: bool) -> Tuple[Any, BasePromptTemplate]:
        """The schema and prompt for ``query``: parts asked only where the caller reads them (``parts``) and of a
        query that could ask several things."""
        several = parts and self.parts and may_ask_several(query)
        if self._own_prompt:
            return (RewrittenQuery if several else SearchQuery), self.prompt
        return (RewrittenQuery, DEFAULT_REWRITE_PROMPT) if several else (SearchQuery, QUERY_ONLY_REWRITE_PROMPT)

    def _get_prompts(self) -> PromptDictType:
        return {"rewrite_prompt": self.prompt}

    def _get_prompt_modules(self) -> PromptMixinType:
        return {}

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        if "rewrite_prompt" in prompts_dict:
            self.prompt = _checked_prompt(prompts_dict["rewrite_prompt"])
            self._own_prompt = True

    def rewrite(self, query: str) -> str:
        """Return the rewritten query or raise ``RewriteError`` (no parts are asked for: nothing would read them)."""
        return self._predict(query, parts=False).query

    async def arewrite(self, query: str) -> str:
        """Async ``rewrite``: awaits the LLM."""
        return (await self._apredict(query, parts=False)).query

    def rewrite_parts(self, query: str) -> Rewrite:
        """The rewritten query, with the questions it asks when the model wrote several that pass
        ``checked_parts``; raises ``RewriteError`` as ``rewrite``. Refused parts do not fail the rewrite."""
        return self._predict(query, parts=True)

    async def arewrite_parts(self, query: str) -> Rewrite:
        """Async ``rewrite_parts``: awaits the LLM."""
        return await self._apredict(query, parts=True)

    def _predict(self, query: str, parts: bool) -> Rewrite:
        schema, prompt = self._asked(query, parts)
        try:
            with _ended_on_failure():
                result = self.llm.structured_predict(schema, prompt, query_str=query, query=query)
        except Exception as exc:
            raise self._failure(exc) from exc
        return _checked(query, result)

    async def _apredict(self, query: str, parts: bool) -> Rewrite:
        schema, prompt = self._asked(query, parts)
        try:
            with _ended_on_failure():
                result = await self.llm.astructured_predict(schema, prompt, query_str=query, query=query)
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


def _checked(query: str, result: object) -> Rewrite:
    if not isinstance(result, (RewrittenQuery, SearchQuery)):
        raise RewriteError(f"the rewrite returned {type(result).__name__}, not RewrittenQuery")
    rewritten = " ".join(clean_text(result.query).split())
    if not rewritten:
        raise RewriteError("the rewrite was empty")
    if rewritten.casefold() == " ".join(query.split()).casefold():
        raise RewriteError("the rewrite returned the query unchanged")
    asked = set(terms(query))
    if asked and not asked & set(terms(rewritten)):
        raise RewriteError(f"the rewrite kept none of the query's words: {rewritten[:120]!r}")
    written = tuple(" ".join(clean_text(str(part)).split()) for part in getattr(result, "parts", None) or [])
    if not written:
        return Rewrite(rewritten)
    parts, refused = checked_parts(query, written)
    return Rewrite(rewritten, parts, refused, written)


#: Two capitalised words joined by "and" or "&": maybe one name ("Procter and Gamble"), which no split may break.
_JOINED_NAME = re.compile(r"\b[A-Z][\w'’.-]*(?:\s+[A-Z][\w'’.-]*)*\s+(?:and|&)\s+[A-Z][\w'’.-]*")


def checked_parts(query: str, parts: Tuple[str, ...]) -> Tuple[Tuple[str, ...], str]:
    """``parts`` when they read as the separate questions ``query`` asks, else none and why not.

    A small model fills the list with the query's words one by one, one phrase repeated, or the query itself;
    a wrong split costs a whole answer, so every part must read as a question of its own: three words or more,
    one of the query's content words at least, not twice the query's length, not another part's words over
    again (nor a part of them), not the whole query. Together the parts must keep what the query asks (half
    its content words at least: a model words a part its own way), and a name the query joins with "and"
    ("Procter and Gamble", "Pride and Prejudice") must stay whole in some part (which also keeps "When were
    Harvard and Yale founded?" asked whole: the safe side).
    """
    kept = [p for p in parts if p]
    if len(kept) < 2:
        return (), "fewer than two parts"
    whole = " ".join(query.split()).casefold()
    asked = set(terms(query))
    seen: List[frozenset] = []
    for part in kept:
        words = frozenset(terms(part))
        if part.casefold().rstrip("?") == whole.rstrip("?"):
            return (), f"a part is the whole query: {part[:80]!r}"
        if len(part) > 2 * len(query) + 100:
            return (), f"a part is longer than the query twice over: {part[:80]!r}"
        if len(part.split()) < 3 or not words & asked:
            return (), f"a part is not a question of the query's: {part[:80]!r}"
        if any(words <= other or other <= words for other in seen):
            return (), f"a part repeats another's words: {part[:80]!r}"
        seen.append(words)
    for name in _JOINED_NAME.findall(query):
        if not any(" ".join(name.split()).casefold() in part.casefold() for part in kept):
            return (), f"the parts break the name {name!r}"
    covered = set().union(*seen) & asked
    if asked and len(covered) < len(asked) / 2:
        return (), f"the parts keep {len(covered)} of the query's {len(asked)} words"
    return tuple(kept), ""
