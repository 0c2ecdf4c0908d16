"""LLM judge: the generator grades all candidates in one structured call (the slow baseline)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import List, Sequence

from llama_index.core.bridge.pydantic import BaseModel, Field
from llama_index.core.llms import LLM
from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
from llama_index.core.prompts.mixin import PromptDictType, PromptMixin, PromptMixinType

from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.templates import checked_template

JUDGE_PROMPT = PromptTemplate(
    "You grade search results. For each numbered passage, answer yes if it contains the answer to the question, "
    "no otherwise.\nQuestion: {query_str}\n\n{context_str}\n\n"
    'Reply with JSON only: {{"relevant": [one "yes" or "no" per passage, in order]}}.\n'
)
#: What the judge fills its prompt with: the question, and the numbered passages.
JUDGE_VARIABLES = ("query_str", "context_str")


class Judgements(BaseModel):
    """One yes/no verdict per passage, in order."""

    relevant: List[str] = Field(description="'yes' or 'no' for each passage, in the order given")


class LLMJudgeScorer(RelevanceScorer, PromptMixin):
    """Asks an LLM whether each passage answers the query, all passages in one call.

    This is what CorrectiveRAGPack and LangGraph's CRAG tutorial do (there one call per
    chunk); batching keeps it to one call per query. Use it as the baseline that the
    trained scorers must beat, or when only an LLM is available. Output is parsed
    through the LLM's structured output; when that fails, yes/no words are read from
    the raw text; a passage with no readable verdict scores 0.5 (undecided).

    Normalisation: yes = 1.0, no = 0.0, unreadable = 0.5.

    A prompt module: ``get_prompts()["judge_prompt"]`` (``scorer:judge_prompt`` of an
    engine grading with it), changed with ``update_prompts``; a template needs
    ``{query_str}`` and ``{context_str}`` (the numbered passages).

    Args:
        llm: The judging LLM (usually the generator).
        max_chars: Each passage is cut to this many characters in the prompt.
        prompt: The judging template.
    """

    normalization = "yes = 1, no = 0, unreadable = 0.5"

    def __init__(self, llm: LLM, max_chars: int = 600, prompt: BasePromptTemplate = JUDGE_PROMPT) -> None:
        self.llm = llm
        self.max_chars = max_chars
        self.prompt = _checked_prompt(prompt)
        model = str(getattr(llm, "model", None) or llm.metadata.model_name)
        # A local model file is named by its file name: the same model on another machine is the same scorer.
        self.name = f"llm-judge:{Path(model).name if Path(model).suffix == '.gguf' else model}"

    def _get_prompts(self) -> PromptDictType:
        return {"judge_prompt": self.prompt}

    def _get_prompt_modules(self) -> PromptMixinType:
        return {}

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        if "judge_prompt" in prompts_dict:
            self.prompt = _checked_prompt(prompts_dict["judge_prompt"])

    def score_texts(self, query: str, texts: Sequence[str]) -> List[float]:
        if not texts:
            return []
        passages = "\n\n".join(f"[{i + 1}] {' '.join(t.split())[: self.max_chars]}" for i, t in enumerate(texts))
        try:
            verdicts = self.llm.structured_predict(
                Judgements, self.prompt, query_str=query, context_str=passages
            ).relevant
        except Exception:
            raw = self.llm.complete(self.prompt.format(query_str=query, context_str=passages)).text
            verdicts = _verdicts_from_text(raw)
        return [_value(verdicts[i]) if i < len(verdicts) else 0.5 for i in range(len(texts))]


def _checked_prompt(prompt: BasePromptTemplate) -> BasePromptTemplate:
    return checked_template(prompt, "the judge prompt", JUDGE_VARIABLES, [(name,) for name in JUDGE_VARIABLES])


def _verdicts_from_text(raw: str) -> List[str]:
    try:
        parsed = json.loads(raw[raw.index("{") : raw.rindex("}") + 1])
        values = parsed.get("relevant", [])
        if isinstance(values, list):
            return [str(v) for v in values]
    except (ValueError, AttributeError):
        pass
    return re.findall(r"\b(yes|no|true|false)\b", raw.lower())


def _value(verdict: str) -> float:
    word = str(verdict).strip().lower()
    if word in ("yes", "true", "1", "relevant"):
        return 1.0
    if word in ("no", "false", "0", "irrelevant"):
        return 0.0
    return 0.5
