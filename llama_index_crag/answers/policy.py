"""Which way the engine answers by default, and what an answer that fails its check becomes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Tuple, get_args

from llama_index.core.llms import MockLLM

from llama_index_crag.answers.grounding import AnswerCheck
from llama_index_crag.local.bundled import BUNDLED_GGUF

#: The answer step's choices (``CragSettings.answer_mode`` and ``on_ungrounded``), named once for every caller.
AnswerMode = Literal["extract", "generate"]
OnUngrounded = Literal["flag", "extract", "abstain"]
ANSWER_MODES: Tuple[str, ...] = get_args(AnswerMode)
ON_UNGROUNDED: Tuple[str, ...] = get_args(OnUngrounded)

#: What the engine did with a checked answer: kept it, kept it flagged, replaced it by the quotes, or abstained.
Outcome = Literal["kept", "flagged", "extract", "abstain"]


def is_bundled_generator(llm: Any) -> bool:
    """Whether ``llm`` is the bundled 135M SmolLM2 in llama.cpp (a GGUF of the user's own is not)."""
    if llm is None or not hasattr(llm, "class_name"):
        return False
    return llm.class_name() == "BundledLlamaCPP" and Path(str(getattr(llm, "model_path", ""))).name == BUNDLED_GGUF


def default_answer_mode(llm: Any) -> AnswerMode:
    """``extract`` with no generator (none, or a ``MockLLM``) or only the bundled small model, else ``generate``.

    The bundled model's answers are wrong more often than right even from the right
    passage (docs/evaluation.md), so offline the engine quotes the passage instead; any
    real LLM (an Ollama model, a GGUF of your own) generates, and its answers are checked.
    """
    if llm is None or isinstance(llm, MockLLM) or is_bundled_generator(llm):
        return "extract"
    return "generate"


def outcome_of(check: AnswerCheck, policy: str) -> Outcome:
    """The outcome of ``policy`` (``on_ungrounded``) for a check: only a grounded answer is kept unmarked."""
    if check.grounded:
        return "kept"
    return {"flag": "flagged", "extract": "extract", "abstain": "abstain"}[policy]  # type: ignore[return-value]
