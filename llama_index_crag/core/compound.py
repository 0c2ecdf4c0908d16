"""A compound question's parts, each answered by the loop, put back together as one response.

Each part (``text/compound.py`` finds them) is retrieved, graded, corrected and answered or abstained on by the
engine's loop alone, so a part the documents answer is answered even when another is not: "When was the
university founded?" is quoted from its passage, and "Who designed the cathedral?" says the documents do not
answer it. The response's text numbers the parts; its sources are every answered part's, each marked with its
part (``PART_KEY``); its trace is the first answered part's at the top (so what reads a trace's action and
scores keeps working) with ``parts``: each part's question, answer, whether it abstained, its action and sources,
and its whole trace; and ``split``: how many parts, how many past the cap were dropped.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.schema import NodeWithScore

from llama_index_crag.core.driver import text_response
from llama_index_crag.text.compound import Split

#: The metadata key that says which part of a compound question a source answered (1 for the first).
PART_KEY = "crag_part"
#: What an abstained part says in place of an answer.
PART_NOT_ANSWERED = "The documents I can search do not answer this part."


def combined(
    split: Split, responses: Sequence[RESPONSE_TYPE], abstain_text: str, streaming: bool, is_async: bool
) -> RESPONSE_TYPE:
    """One response for ``split``'s question from each part's (non-streamed) response."""
    traces: List[Dict[str, Any]] = [dict((r.metadata or {}).get("crag") or {}) for r in responses]
    answered = [i for i, t in enumerate(traces) if not t.get("abstained")]
    sources: List[NodeWithScore] = []
    lines: List[str] = []
    parts: List[Dict[str, Any]] = []
    for number, (part, response, trace) in enumerate(zip(split.parts, responses, traces), start=1):
        abstained = bool(trace.get("abstained"))
        mine = [] if abstained else [_marked(n, number) for n in response.source_nodes]
        sources.extend(mine)
        answer = PART_NOT_ANSWERED if abstained else str(getattr(response, "response", None) or "").strip()
        lines.append(f"{number}. {part}\n{answer}")
        parts.append(
            {
                "part": number,
                "question": part,
                "answer": answer,
                "abstained": abstained,
                "action": trace.get("action"),
                "sources": [n.node.node_id for n in mine],
                "trace": trace,
            }
        )
    if not answered:
        text = abstain_text
        top: Dict[str, Any] = dict(traces[0]) if traces else {}
        top["abstained"] = True
        top["answered_by"] = "abstain"
        top["abstain_reason"] = "no part of the question is answered by the documents: " + "; ".join(
            f"part {p['part']}: {p['trace'].get('abstain_reason') or 'abstained'}" for p in parts
        )
    else:
        text = "\n\n".join(lines)
        top = dict(traces[answered[0]])
    top["query"] = split.question
    top["parts"] = parts
    top["split"] = {"parts": len(split.parts), "dropped": split.dropped, "answered": len(answered)}
    warnings = list(top.get("warnings") or [])
    if split.dropped:
        warnings.append(
            f"the question asks {len(split.parts) + split.dropped} things; the first {len(split.parts)} were "
            f"searched and the other {split.dropped} dropped (max_parts)"
        )
    top["warnings"] = warnings
    response = text_response(text, sources if answered else [], streaming, is_async)
    response.metadata = {"crag": top}
    return response


def _marked(node: NodeWithScore, part: int) -> NodeWithScore:
    """``node`` marked with the part it answered, on a copy (the index's node is not changed)."""
    inner = node.node.model_copy(update={"metadata": {**node.node.metadata, PART_KEY: part}})
    return NodeWithScore(node=inner, score=node.score)
