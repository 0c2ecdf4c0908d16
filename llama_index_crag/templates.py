"""Prompt templates checked for the variables their caller fills, so that a wrong one fails when it is set."""

from __future__ import annotations

from typing import Sequence, Set, TypeVar

from llama_index.core.prompts import BasePromptTemplate

from llama_index_crag.errors import ConfigError

Template = TypeVar("Template", bound=BasePromptTemplate)


def checked_template(template: Template, what: str, fills: Sequence[str], needs: Sequence[Sequence[str]]) -> Template:
    """``template`` if its caller can fill it, else a ``ConfigError`` naming the variables it needs.

    A LlamaIndex template that names a variable nobody fills fails (or is sent with
    the literal ``{name}`` in it) only when the prompt is first used, deep inside a
    query; checking when it is set says what is wrong where it was done.

    Args:
        template: The template as given (its partials and variable mappings count).
        what: The prompt's name for the message ("the rewrite prompt").
        fills: Every variable the caller passes when it formats the template.
        needs: Groups of alternatives: the template must use at least one variable of each
            group (``[("query_str", "query")]``: the query under either name).

    Raises:
        ConfigError: The template is not a prompt template, lacks a needed variable, or
            uses one the caller does not fill.
    """
    if not isinstance(template, BasePromptTemplate):
        raise ConfigError(
            f"{what} must be a LlamaIndex prompt template (PromptTemplate), not {type(template).__name__}"
        )
    renamed = template.template_var_mappings or {}
    given = [*fills, *template.kwargs, *(template.function_mappings or {})]
    filled: Set[str] = {renamed.get(name, name) for name in given}
    used = set(template.template_vars)
    wanted = " and ".join(" or ".join(f"{{{name}}}" for name in group) for group in needs)
    missing = [group for group in needs if not used & {renamed.get(name, name) for name in group}]
    unknown = sorted(used - filled)
    if missing or unknown:
        found = ", ".join(f"{{{name}}}" for name in sorted(used)) or "no variable"
        extra = f"; it cannot fill {', '.join(f'{{{name}}}' for name in unknown)}" if unknown else ""
        raise ConfigError(
            f"{what} needs {wanted} and no other variable; the template has {found}{extra} "
            "(write literal braces as {{ and }})"
        )
    return template
