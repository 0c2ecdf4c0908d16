"""The LLM-judge CRAG baseline: the generator grades each chunk yes/no, and any "no" sends the query to the fallback."""

from __future__ import annotations

import asyncio
from typing import List, Literal

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import RESPONSE_TYPE, Response
from llama_index.core.bridge.pydantic import BaseModel, Field
from llama_index.core.llms import LLM
from llama_index.core.prompts import PromptTemplate
from llama_index.core.prompts.mixin import PromptMixinType
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, QueryBundle

from llama_index_crag.core.loop import CragTrace, NodeGrade
from llama_index_crag.local.models import describe_llm

# LangGraph's CRAG tutorial grader (CorrectiveRAGPack's asks the same, in free text).
JUDGE_PROMPT = PromptTemplate(
    "You are a grader assessing relevance of a retrieved document to a user question. If the document contains "
    "keyword(s) or semantic meaning related to the question, grade it as relevant. Give a binary score 'yes' or "
    "'no' score to indicate whether the document is relevant to the question.\n\n"
    "Retrieved document: \n\n {document} \n\n User question: {question}"
)
# CorrectiveRAGPack's query transformation (its web search is the fallback retriever here).
REWRITE_PROMPT = PromptTemplate(
    "Your task is to refine a query to ensure it is highly effective for retrieving relevant search results. \n"
    "Analyze the given input to grasp the core semantic intent or meaning. \n"
    "Original Query: \n ------- \n{query_str}\n ------- \n"
    "Your goal is to rephrase or enhance this query to improve its search performance. Ensure the revised query "
    "is concise and directly aligned with the intended search objective. \nRespond with the optimized query only:"
)


class GradeDocument(BaseModel):
    """Binary score for the relevance check on a retrieved document."""

    binary_score: Literal["yes", "no"] = Field(description="Documents are relevant to the question, 'yes' or 'no'")


class LLMJudgeQueryEngine(BaseQueryEngine):
    """CRAG as ``CorrectiveRAGPack`` and LangGraph's CRAG tutorial build it: the anchor to beat.

    Retrieve; ask the LLM, once per chunk, whether the chunk is relevant (structured
    yes/no, as LangGraph's grader; an unparsable reply counts as "no", as the pack's
    ``== "yes"`` test does); keep the "yes" chunks; if any chunk got "no", rewrite the
    query with the LLM and add the fallback's results, ungraded, as the pack adds its
    web results; generate from what is kept. Neither original abstains; this one
    abstains only when nothing at all is left, so that its figures stay comparable.

    The trace in ``response.metadata["crag"]`` has the engine's shape: action
    ``correct`` (all yes), ``ambiguous`` (some no) or ``incorrect`` (all no), the
    stages ``retrieve``, ``grade`` (the judge calls), ``rewrite``, ``fallback`` and
    ``generate``, plus ``judge_calls`` and ``judge_failures``.
    """

    def __init__(
        self,
        retriever: BaseRetriever,
        llm: LLM,
        fallback: BaseRetriever,
        response_synthesizer: BaseSynthesizer,
        abstain_text: str,
    ) -> None:
        self._retriever = retriever
        self._llm = llm
        self._fallback = fallback
        self._synthesizer = response_synthesizer
        self._abstain_text = abstain_text
        super().__init__(callback_manager=response_synthesizer.callback_manager)

    def _get_prompt_modules(self) -> PromptMixinType:
        return {"response_synthesizer": self._synthesizer}

    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        trace = CragTrace(
            query=query_bundle.query_str,
            enabled=True,
            scorer=f"llm-judge:{describe_llm(self._llm)}",
            upper=1.0,
            lower=1.0,
            aggregation="all-yes",
        )
        with trace.timed("retrieve"):
            nodes = self._retriever.retrieve(query_bundle)
        with trace.timed("grade"):
            verdicts = [self._judge(query_bundle.query_str, n) for n in nodes]
        relevant = [n for n, v in zip(nodes, verdicts) if v == "yes"]
        trace.nodes = [
            NodeGrade(node_id=n.node.node_id, score=float(v == "yes"), label=_label(v), source="retriever")
            for n, v in zip(nodes, verdicts)
        ]
        trace.action = "correct" if len(relevant) == len(nodes) else "ambiguous" if relevant else "incorrect"
        context = list(relevant)
        if len(relevant) < len(nodes):
            with trace.timed("rewrite"):
                search = self._rewrite(query_bundle.query_str)
            trace.rewritten_query, trace.rewrites = search, 1
            with trace.timed("fallback"):
                hits = self._fallback.retrieve(QueryBundle(search))
            trace.fallback_sources = sorted({h.node.metadata.get("crag_source", "fallback") for h in hits})
            context += hits
        if not context:
            trace.abstain("nothing was judged relevant and the fallback found nothing")
            response: RESPONSE_TYPE = Response(response=self._abstain_text, source_nodes=[])
        else:
            with trace.timed("generate"):
                response = self._synthesizer.synthesize(query_bundle, context)
        failures = sum(v is None for v in verdicts)
        response.metadata = {
            **(response.metadata or {}),
            "crag": {**trace.to_dict(), "judge_calls": len(nodes), "judge_failures": failures},
        }
        return response

    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        return await asyncio.to_thread(self._query, query_bundle)

    def _judge(self, question: str, node: NodeWithScore) -> str | None:
        """ "yes" or "no"; None when the reply did not parse (then treated as "no")."""
        try:
            grade = self._llm.structured_predict(
                GradeDocument, JUDGE_PROMPT, document=node.node.get_content(), question=question
            )
        except ValueError:
            return None
        return grade.binary_score

    def _rewrite(self, question: str) -> str:
        lines: List[str] = [
            ln.strip().strip("\"'") for ln in self._llm.predict(REWRITE_PROMPT, query_str=question).splitlines()
        ]
        return next((ln for ln in lines if ln), question)


def _label(verdict: str | None) -> str:
    return "correct" if verdict == "yes" else "incorrect"
