"""The answer steps of the corrective loop: generate, quote the evidence, check a generated answer.

``AnswerSteps`` is mixed into ``CorrectiveQueryEngine``; each step is a generator that yields
its I/O to the engine's driver (``core/driver.py``), as the rest of the loop does, in its own
instrumentation span.
"""

from __future__ import annotations

import copy
import time
from typing import Any, AsyncGenerator, Callable, Generator, List, Optional, Sequence, Tuple

from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.mixin import PromptDictType, PromptMixin, PromptMixinType
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, QueryBundle

from llama_index_crag.answers.answer_model import evidence_place
from llama_index_crag.answers.extract import EvidenceQuoter, QuotedAnswer
from llama_index_crag.answers.grounding import AnswerCheck, GroundednessChecker
from llama_index_crag.answers.policy import outcome_of
from llama_index_crag.core.driver import Io, bind, text_response
from llama_index_crag.core.grader import Verdict
from llama_index_crag.core.prompts import QUOTED_QA_TEMPLATE, QUOTED_REFINE_TEMPLATE, quote_sources
from llama_index_crag.core.settings import CragSettings
from llama_index_crag.core.trace import CragTrace, step_span
from llama_index_crag.errors import GenerationError
from llama_index_crag.local.models import describe_llm
from llama_index_crag.web.retriever import is_web

#: What LlamaIndex's synthesizers answer when the LLM returned no text.
_SYNTHESIZER_EMPTY = "Empty Response"


class QuotingPrompts(PromptMixin):
    """The generator's templates when web pages are among the sources (every source quoted, sources as data).

    A prompt module of the engine: ``engine.get_prompts()`` lists them as
    ``quoting:text_qa_template`` and ``quoting:refine_template``, and ``update_prompts``
    changes them.
    """

    def __init__(self) -> None:
        self.text_qa_template: BasePromptTemplate = QUOTED_QA_TEMPLATE
        self.refine_template: BasePromptTemplate = QUOTED_REFINE_TEMPLATE

    def _get_prompts(self) -> PromptDictType:
        return {"text_qa_template": self.text_qa_template, "refine_template": self.refine_template}

    def _get_prompt_modules(self) -> PromptMixinType:
        return {}

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        if "text_qa_template" in prompts_dict:
            self.text_qa_template = prompts_dict["text_qa_template"]
        if "refine_template" in prompts_dict:
            self.refine_template = prompts_dict["refine_template"]


class AnswerSteps:
    """Generation, quoting and the answer check, for ``CorrectiveQueryEngine``."""

    _synthesizer: BaseSynthesizer
    _quoting_prompts: QuotingPrompts
    _quoting: Optional[Tuple[Tuple[int, ...], BaseSynthesizer]]
    _quoter: EvidenceQuoter
    _checker: GroundednessChecker
    settings: CragSettings

    def _generate(
        self, query_bundle: QueryBundle, context: List[NodeWithScore], trace: CragTrace
    ) -> Generator[Io, Any, RESPONSE_TYPE]:
        """The synthesizer's answer from the corrected context (web pages quoted between source tags)."""
        synthesizer, sources = self._synthesizer, context
        if any(is_web(n) for n in context):
            context = sorted(context, key=is_web)
            synthesizer, sources = self._quoting_synthesizer(), quote_sources(context)
        with trace.timed("generate"):
            try:
                response = yield Io(
                    bind(synthesizer.synthesize, query_bundle, sources),
                    bind(synthesizer.asynthesize, query_bundle, sources),
                )
            except Exception as exc:
                raise self._generation_error(exc) from exc
        response.source_nodes = list(context)
        tokens = getattr(response, "response_gen", None)
        if tokens is not None:  # streamed: the generator is called as the tokens are read
            response.response_gen = _named_failures(tokens, self._generation_error)  # type: ignore[union-attr]
        return response

    def _generation_error(self, exc: BaseException) -> GenerationError:
        """What a failing generator raises: a ``GenerationError`` that names the model and its server."""
        llm = getattr(self._synthesizer, "_llm", None)
        return GenerationError(
            f"the generator {describe_llm(llm) if llm is not None else ''} failed: {type(exc).__name__}: {exc}"
        )

    def _quote(
        self, query_bundle: QueryBundle, context: List[NodeWithScore], trace: CragTrace
    ) -> Generator[Io, Any, QuotedAnswer]:
        """The best strips of the context, quoted with their sources (recorded in the trace)."""
        question = query_bundle.query_str
        with trace.timed("extract"), step_span("quote", passages=len(context)) as span:
            place = evidence_place(
                evidence_grade(trace.action, trace.top_score, trace.retry_score), trace.upper, trace.lower
            )
            quoted = yield Io(
                bind(self._quoter.quote, question, context, place),
                bind(self._quoter.aquote, question, context, place),
            )
            span.outcome = "quoted" if quoted.quotes else "withheld" if quoted.withheld else "none"
            span.sizes.update(quotes=len(quoted.quotes), withheld=len(quoted.withheld))
        trace.quotes = quoted.to_list()
        trace.quote_check = quoted.check()
        return quoted

    def _check(
        self,
        query_bundle: QueryBundle,
        context: List[NodeWithScore],
        response: RESPONSE_TYPE,
        trace: CragTrace,
        is_async: bool,
    ) -> Generator[Io, Any, Optional[RESPONSE_TYPE]]:
        """Check a generated answer against its context and apply ``on_ungrounded``; None means abstain."""
        question, answer = query_bundle.query_str, str(getattr(response, "response", None) or "")
        if answer.strip() == _SYNTHESIZER_EMPTY:
            answer = ""
        evidence = context_texts(context)
        with trace.timed("check"), step_span("check", passages=len(evidence)) as span:
            try:
                check = yield Io(
                    bind(self._checker.check, answer, evidence, question),
                    bind(self._checker.acheck, answer, evidence, question),
                )
            except Exception as exc:
                check = AnswerCheck("error", None, reason=f"the check failed: {type(exc).__name__}: {exc}")
            span.outcome = check.status if check.grounded is None else "grounded" if check.grounded else "ungrounded"
        policy = self.settings.on_ungrounded
        outcome = outcome_of(check, policy)
        trace.grounded = check.grounded
        trace.answer_check = {**check.to_dict(), "policy": policy, "outcome": outcome}
        if outcome == "kept":
            return response
        quoted = yield from self._quote(query_bundle, context, trace)
        if outcome == "flagged":
            return response
        if outcome == "extract" and quoted.quotes:
            trace.answered_by = "extract"
            return text_response(quoted.text, context, False, is_async)
        unsupported = ", ".join(check.unsupported[:5])
        withheld = (
            f"; the answer model gives its best strip {quoted.grade:.3f}, under the quote threshold "
            f"{quoted.threshold:.3f}, so they were not given instead"
            if quoted.withheld and quoted.grade is not None
            else ""
        )
        trace.abstain(
            f"the generated answer failed its check against the sources ({check.reason}"
            + (f"; unsupported: {unsupported}" if unsupported else "")
            + ")"
            + withheld
        )
        return None

    def _stream_check(
        self, query_bundle: QueryBundle, context: List[NodeWithScore], response: RESPONSE_TYPE
    ) -> Callable[[str, Optional[str]], None]:
        """What runs when a streamed answer ends: check the finished text and record it in the response's trace.

        A streamed answer was already sent, so ``on_ungrounded`` cannot replace it: an
        ungrounded one is flagged, with the quoted evidence beside it in the trace.
        """

        def finish(answer: str, cut: Optional[str]) -> None:
            crag = response.metadata["crag"]  # type: ignore[index]
            started = time.perf_counter()
            if cut is not None:
                check = AnswerCheck("incomplete", None, reason=f"the stream ended before the answer did: {cut}")
            else:
                try:
                    check = self._checker.check(answer, context_texts(context), query_bundle.query_str)
                except Exception as exc:
                    check = AnswerCheck("error", None, reason=f"the check failed: {type(exc).__name__}: {exc}")
            outcome = outcome_of(check, "flag")
            if outcome != "kept":
                try:
                    bands = crag["thresholds"]
                    grade = evidence_grade(crag["action"], crag.get("top_score"), crag.get("retry_score"))
                    place = evidence_place(grade, bands["upper"], bands["lower"])
                    quoted = self._quoter.quote(query_bundle.query_str, context, place)
                    crag["quotes"] = quoted.to_list()
                    crag["quote_check"] = quoted.check()
                except Exception as exc:
                    crag["quotes"] = []
                    check.reason = f"{check.reason}; the evidence could not be quoted: {type(exc).__name__}: {exc}"
            crag["grounded"] = check.grounded
            crag["answer_check"] = {
                **check.to_dict(),
                "policy": self.settings.on_ungrounded,
                "outcome": outcome,
                "streamed": True,
            }
            elapsed = round((time.perf_counter() - started) * 1000.0, 3)
            timings = crag["timings_ms"]
            timings["check"] = elapsed
            timings["crag_ms"] = round(timings.get("crag_ms", 0.0) + elapsed, 3)

        return finish

    def _quoting_synthesizer(self) -> BaseSynthesizer:
        """The synthesizer with the quoted-source templates, for contexts that hold web pages."""
        templates = self._quoting_prompts.get_prompts()
        key = tuple(id(v) for v in templates.values())
        if self._quoting is None or self._quoting[0] != key:  # built again after update_prompts
            quoting = copy.copy(self._synthesizer)
            prompts = quoting.get_prompts()
            quoting.update_prompts({k: v for k, v in templates.items() if k in prompts})
            self._quoting = (key, quoting)
        return self._quoting[1]


def evidence_grade(action: str, top_score: Optional[float], retry_score: Optional[float]) -> Optional[float]:
    """The grader's grade of the evidence an answer comes from: the retrieved passages' top score, or for evidence
    the fallback found (action "incorrect"), its own grade."""
    if action == Verdict.INCORRECT.value and retry_score is not None:
        return retry_score
    return top_score


def context_texts(context: Sequence[NodeWithScore]) -> List[str]:
    """The passage texts an answer was generated from, as the generator saw them."""
    return [n.node.get_content() for n in context]


def _named_failures(tokens: Any, error: Callable[[BaseException], GenerationError]) -> Any:
    """A streamed answer's tokens, a failure of the generator while they are read raised as ``error`` makes it (a
    ``GenerationError``, as an answer that is not streamed raises), sync or async as ``tokens`` are."""
    if hasattr(tokens, "__aiter__"):

        async def named_async() -> AsyncGenerator[str, None]:
            try:
                async for token in tokens:
                    yield token
            except GenerationError:
                raise
            except Exception as exc:
                raise error(exc) from exc

        return named_async()

    def named() -> Generator[str, None, None]:
        try:
            yield from tokens
        except GenerationError:
            raise
        except Exception as exc:
            raise error(exc) from exc

    return named()
