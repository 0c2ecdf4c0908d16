"""A compound question's parts, each answered by the loop, put back together as one response.

Each part (``text/compound.py`` finds them) is retrieved, graded, corrected and answered or abstained on by the
engine's loop alone, so a part the documents answer is answered even when another is not: "When was the
university founded?" is quoted from its passage, and "Who designed the cathedral?" says the documents do not
answer it. The response's text numbers the parts; its sources are every answered part's, each marked with its
part (``PART_KEY``); its trace is the first answered part's at the top (so what reads a trace's action and
scores keeps working) with ``parts``: each part's question, answer, whether it abstained, its action and sources,
and its whole trace; and ``split``: how many parts, how many past the cap were dropped, how many were answered,
the side each part of a comparison asks about (``sides``, empty for joined questions), what found the parts
(``by``: "parser" or "rewrite"), and for parts found by the rewrite, the trace of the question asked whole
(``whole``).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.schema import NodeWithScore

from llama_index_crag.text.compound import Split

#: The metadata key that says which part of a compound question a source answered (1 for the first).
PART_KEY = "crag_part"
#: Words of a comparison's side that name nothing by themselves.
_NOT_NAMING = frozenset("the a an of and or in on at for to de la le von van".split())
#: What an abstained part says in place of an answer.
PART_NOT_ANSWERED = "The documents I can search do not answer this part."


def combined(
    split: Split,
    responses: Sequence[RESPONSE_TYPE],
    abstain_text: str,
    asked_whole: Optional[Dict[str, Any]] = None,
) -> Tuple[str, List[NodeWithScore], Dict[str, Any]]:
    """The text, sources and trace of one response for ``split``'s question, from each part's (non-streamed)
    response; ``asked_whole`` is the trace of the question asked whole, when its rewrite found the parts."""
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
    top["split"] = {
        "parts": len(split.parts),
        "dropped": split.dropped,
        "answered": len(answered),
        "sides": list(split.subjects),
        "by": split.by,
    }
    if asked_whole is not None:
        top["split"]["whole"] = asked_whole
    warnings = list(top.get("warnings") or [])
    if split.dropped:
        warnings.append(
            f"the question asks {len(split.parts) + split.dropped} things; the first {len(split.parts)} were "
            f"searched and the other {split.dropped} dropped (max_parts)"
        )
    top["warnings"] = warnings
    return text, sources if answered else [], top


def _marked(node: NodeWithScore, part: int) -> NodeWithScore:
    """``node`` marked with the part it answered, on a copy (the index's node is not changed)."""
    inner = node.node.model_copy(update={"metadata": {**node.node.metadata, PART_KEY: part}})
    return NodeWithScore(node=inner, score=node.score)


def keep_to_subject(response: RESPONSE_TYPE, split: Split, part: int) -> None:
    """Withhold the answer of a comparison's side (part ``part`` of ``split``, 0-based) when the passages it was
    answered from never name that side ("Which is older, Yale?" answered from Harvard's page): the part is then
    abstained on, its quotes kept in the trace's ``quote_check.withheld``. A side is named by any of its words
    that the other sides do not share ("Harbor Lite 3.4" against "Harbor Edge 2.0": "lite" or "3.4"), in a
    passage's title or text."""
    crag = (response.metadata or {}).get("crag")
    subject = split.subject(part)
    if not subject or not isinstance(crag, dict) or crag.get("abstained"):
        return
    others = {w for i, side in enumerate(split.subjects) if i != part for w in _naming_words(side)}
    names = [w for w in _naming_words(subject) if w not in others]
    quoted = {q["node_id"] for q in crag.get("quotes") or []}
    nodes = [n for n in response.source_nodes if not quoted or n.node.node_id in quoted]
    said = " ".join(f"{n.node.metadata.get('title') or ''} {n.node.get_content()}" for n in nodes).casefold()
    if not names or any(re.search(rf"(?<!\w){re.escape(w)}(?!\w)", said) for w in names):
        return
    check = dict(crag.get("quote_check") or {})
    check.update(passed=False, withheld=list(crag.get("quotes") or []))
    crag.update(
        abstained=True,
        answered_by="abstain",
        quotes=[],
        quote_check=check,
        abstain_reason=f"the passages this part was answered from do not name {subject}, the side it asks about",
    )


def _naming_words(side: str) -> List[str]:
    return [w for w in re.findall(r"[\w'’.-]*\w", side.casefold()) if w not in _NOT_NAMING and len(w) > 1]
