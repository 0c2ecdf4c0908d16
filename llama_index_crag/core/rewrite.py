"""The capped, schema-bound query rewrite of the INCORRECT branch."""

from __future__ import annotations

from llama_index.core.bridge.pydantic import BaseModel, Field
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
            result = self.llm.structured_predict(RewrittenQuery, self.prompt, query_str=query, query=query)
        except Exception as exc:
            raise self._failure(exc) from exc
        return _checked(query, result)

    async def arewrite(self, query: str) -> str:
        """Async ``rewrite``: awaits the LLM."""
        try:
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
