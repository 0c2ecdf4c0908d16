"""Per-question rows and the figures computed from them, and the targets they are judged against."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.schema import MetadataMode

from llama_index_crag.answers.policy import ON_UNGROUNDED
from llama_index_crag.evaluation.dataset import EvalQuestion, contains_any, quotes_any

ANSWERABLE, UNANSWERABLE, OUT_OF_CORPUS = "answerable", "unanswerable", "out_of_corpus"
#: How rows are scored; saved rows scored otherwise are not reused (2: claims' quotes scored by their rationale;
#: 3: an out-of-corpus question answered from another passage that holds its answer is right).
SCORING = 3
#: Stages whose time is the generator's (excluded from pipeline time).
LLM_STAGES = ("generate", "rewrite")
LATENCY_STAGES = (
    *("retrieve", "rerank", "grade", "refine", "rewrite", "fallback", "regrade"),
    *("extract", "generate", "check", "crag_ms"),
)


def make_row(
    system: str,
    kind: str,
    question: EvalQuestion,
    response: RESPONSE_TYPE,
    total_ms: float,
    generator_input: Sequence[int],
    generated: bool,
    count_tokens: Callable[[str], int],
) -> Dict[str, Any]:
    """One system's outcome on one question, with everything the figures need (JSON-ready).

    ``generator_input`` is (prompt tokens, calls) of the generator for this query.
    """
    trace = dict(response.metadata["crag"])  # type: ignore[index]
    abstained = bool(trace["abstained"])
    quote_check = trace.get("quote_check") or {}
    nodes = [] if abstained else list(response.source_nodes)
    texts = [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]
    doc_ids = [n.node.metadata.get("doc_id") for n in nodes]
    tokens = [count_tokens(t) for t in texts]
    relevant = set(question.question.relevant_doc_ids) if kind == ANSWERABLE else set()
    # Hiding a question's own passage does not hide a fact the corpus repeats elsewhere (SQuAD's articles do).
    has_gold = kind in (ANSWERABLE, OUT_OF_CORPUS)
    answer = str(response).strip()
    return {
        "system": system,
        "kind": kind,
        "qid": question.question.qid,
        "action": trace["action"],
        "abstained": abstained,
        "top_score": trace.get("top_score"),
        "retry_score": trace.get("retry_score"),
        "answer": answer[:500],
        "context_doc_ids": doc_ids,
        "context_tokens": sum(tokens),
        "relevant_context_tokens": sum(t for t, d in zip(tokens, doc_ids) if d in relevant),
        "answer_in_context": contains_any(" ".join(texts), question.gold_context) if has_gold else None,
        "gold_retrieved": _gold_retrieved(trace, response, relevant),
        "input_tokens": generator_input[0],
        "generator_calls": generator_input[1],
        "judge_calls": trace.get("judge_calls", 0),
        "answered_by": trace.get("answered_by"),
        "grounded": trace.get("grounded"),
        "check_outcome": (trace.get("answer_check") or {}).get("outcome"),
        # The quotes read together and graded: their grade, and whether the engine abstained for withholding them
        # (a flagged generated answer is kept whatever its quotes' grade).
        "quote_grade": quote_check.get("grade"),
        "quotes_withheld": abstained and quote_check.get("passed") is False,
        # A quoted answer needs no generator, so it is scored with generation skipped too.
        "correct": _correct(kind, question, abstained, answer, _quoted(trace))
        if generated or trace.get("answer_mode") == "extract"
        else None,
        "timings_ms": {**trace["timings_ms"], "total": round(total_ms, 3)},
    }


def _gold_retrieved(trace: Dict[str, Any], response: RESPONSE_TYPE, relevant: set) -> Optional[bool]:
    """Whether a passage of the question's own documents was among the candidates first retrieved: the trace's
    primary candidates, or for a system that lists none, its context. None for a question with no documents of
    its own (unanswerable, out of corpus) or when neither is known."""
    if not relevant:
        return None
    listed = [n.get("doc_id") for n in trace.get("nodes") or [] if n.get("source", "retriever") == "retriever"]
    if not listed:
        listed = [n.node.metadata.get("doc_id") for n in response.source_nodes]
    return bool(relevant & set(listed)) if listed else None


def _quoted(trace: Dict[str, Any]) -> Optional[List[str]]:
    """The quotes the answer is made of, or None when it was generated."""
    if trace.get("answered_by") != "extract":
        return None
    return [str(q.get("text", "")) for q in trace.get("quotes") or []]


def _correct(
    kind: str, question: EvalQuestion, abstained: bool, answer: str, quotes: Optional[List[str]] = None
) -> Optional[bool]:
    """Right or wrong: an answer holds a short answer (SQuAD); where a set has none, only evidence sentences
    (SciFact's claims), a quoted answer is right when it quotes one of them, and a generated one is not scored.

    An unanswerable question is only ever right abstained on. An out-of-corpus one (its own passage hidden) is
    right abstained on, and right answered only when the answer meets the same test as an answerable one's: the
    corpus held the fact in another passage, and the answer found it.
    """
    if kind == UNANSWERABLE:
        return abstained
    if abstained:
        return kind == OUT_OF_CORPUS
    if not question.answers:
        if quotes is not None:
            return quotes_any(quotes, question.gold_context)
        return None if kind == ANSWERABLE else False
    return contains_any(answer, question.answers)


def pipeline_ms(row: Dict[str, Any]) -> float:
    """End-to-end time less the generator's own calls (generation and the LLM rewrite)."""
    timings = row["timings_ms"]
    return float(timings["total"] - sum(timings.get(s, 0.0) for s in LLM_STAGES))


def _mean(values: Sequence[Any]) -> Optional[float]:
    kept = [float(v) for v in values if v is not None]
    return float(np.mean(kept)) if kept else None


def _percentiles(values: Sequence[float]) -> Dict[str, float]:
    p50, p95, p99 = np.percentile(values, [50, 95, 99]) if values else (np.nan,) * 3
    return {"p50": round(float(p50), 2), "p95": round(float(p95), 2), "p99": round(float(p99), 2), "n": len(values)}


def summarize(rows: Sequence[Dict[str, Any]], systems: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """The figures of each system (see ``docs/evaluation.md`` for their definitions)."""
    plain_had_it = {
        r["qid"] for r in rows if r["system"] == "plain" and r["kind"] == ANSWERABLE and r["answer_in_context"]
    }
    has_plain = any(r["system"] == "plain" for r in rows)
    figures: Dict[str, Dict[str, Any]] = {}
    for system in systems:
        mine = [r for r in rows if r["system"] == system]
        if not mine:
            continue
        kind = {k: [r for r in mine if r["kind"] == k] for k in (ANSWERABLE, UNANSWERABLE, OUT_OF_CORPUS)}
        answerable = kind[ANSWERABLE]
        given = [r for r in answerable if r["context_tokens"]]
        actions = Counter(r["action"] for r in mine)
        figures[system] = {
            "queries": {k: len(v) for k, v in kind.items()},
            "abstain_out_of_corpus": _mean([r["abstained"] for r in kind[OUT_OF_CORPUS]]),
            "answered_right_out_of_corpus": _mean(
                [None if r["correct"] is None else not r["abstained"] and r["correct"] for r in kind[OUT_OF_CORPUS]]
            ),
            "abstain_unanswerable": _mean([r["abstained"] for r in kind[UNANSWERABLE]]),
            "false_abstention": _mean([r["abstained"] for r in answerable]),
            "false_abstention_retrieved": _mean(
                [
                    None if r.get("gold_retrieved") is None else r["abstained"] and r["gold_retrieved"]
                    for r in answerable
                ]
            ),
            "false_abstention_plain_in_context": (
                _mean([r["abstained"] for r in answerable if r["qid"] in plain_had_it]) if has_plain else None
            ),
            "answer_in_context": _mean([r["answer_in_context"] for r in answerable]),
            "context_precision": _mean([r["relevant_context_tokens"] / r["context_tokens"] for r in given]),
            "unsupported_answers": _mean([_unsupported(r) for r in mine]),
            "wrong_answers": _mean(
                [None if r["correct"] is None else not r["abstained"] and not r["correct"] for r in mine]
            ),
            "accuracy": _mean([r["correct"] for r in mine]),
            "accuracy_answerable": _mean([r["correct"] for r in answerable]),
            "truthfulness": _mean([truthfulness(r) for r in mine]),
            "wrong_among_answered_answerable": _mean(
                [None if r["correct"] is None else not r["correct"] for r in answerable if not r["abstained"]]
            ),
            "flagged_answers": _mean([r.get("check_outcome") == "flagged" for r in mine if not r["abstained"]]),
            "quotes_withheld": _mean([bool(r.get("quotes_withheld")) for r in mine]),
            "answered_by": {
                a: round(n / len(mine), 4)
                for a, n in sorted(Counter(r.get("answered_by") or "none" for r in mine).items())
            },
            "input_tokens": _mean([r["input_tokens"] for r in mine]),
            "input_tokens_answered": _mean([r["input_tokens"] for r in mine if not r["abstained"]]),
            "judge_calls": _mean([r["judge_calls"] for r in mine]),
            "actions": {a: round(n / len(mine), 4) for a, n in sorted(actions.items())},
            # Half a 95% interval of the headline figures, over the questions each averages.
            "intervals": {
                "abstain_out_of_corpus": half_width([float(r["abstained"]) for r in kind[OUT_OF_CORPUS]]),
                "abstain_unanswerable": half_width([float(r["abstained"]) for r in kind[UNANSWERABLE]]),
                "false_abstention": half_width([float(r["abstained"]) for r in answerable]),
                "truthfulness": half_width([float(t) for t in (truthfulness(r) for r in mine) if t is not None]),
            },
            "latency_ms": {
                **{
                    stage: _percentiles([r["timings_ms"][stage] for r in mine if stage in r["timings_ms"]])
                    for stage in LATENCY_STAGES
                    if any(stage in r["timings_ms"] for r in mine)
                },
                "pipeline": _percentiles([pipeline_ms(r) for r in mine]),
                "total": _percentiles([r["timings_ms"]["total"] for r in mine]),
            },
        }
    return figures


def half_width(values: Sequence[float]) -> Optional[float]:
    """Half the width of the 95% interval of a mean over ``values`` (normal approximation): a half of a shared set
    is a few hundred questions, so one question moves a figure by a point or more. None under two values."""
    if len(values) < 2:
        return None
    return 1.96 * statistics.stdev(values) / math.sqrt(len(values))


def truthfulness(row: Dict[str, Any]) -> Optional[int]:
    """The CRAG benchmark's score of one answer: 1 correct, -1 wrong (any answer where none exists), 0 abstained.

    An out-of-corpus question answered right from another passage (see ``_correct``) scores 1. Its mean rewards
    abstaining over guessing; ``None`` when the answer was not generated.
    """
    if row["correct"] is None:
        return None
    if row["abstained"]:
        return 0
    return 1 if row["correct"] else -1


def apply_policy(
    flagged: Dict[Tuple[str, str], Dict[str, Any]], quoted: Dict[Tuple[str, str], Dict[str, Any]], policy: str
) -> List[Dict[str, Any]]:
    """CRAG's rows under ``policy`` (``on_ungrounded``), from a run with ``flag`` and a run that quoted.

    Generation is deterministic and the policy acts after the check, so a flag run's
    answers are every policy's answers; only a flagged one changes. ``abstain`` abstains
    on it; ``extract`` answers with the quotes of the same query's row in ``quoted``
    (an ``answer_mode=extract`` run, which quotes the same graded context). Rows are
    keyed by (kind, question id).
    """
    if policy not in ON_UNGROUNDED:
        raise ValueError(f"unknown policy {policy!r}: choose {', '.join(ON_UNGROUNDED)}")
    out = []
    for key, row in flagged.items():
        if row.get("check_outcome") != "flagged" or policy == "flag":
            out.append(row)
        elif policy == "abstain":
            out.append({**row, "abstained": True, "answer": "", "correct": row["kind"] != ANSWERABLE})
        else:
            quote = quoted[key]
            out.append({**row, "abstained": quote["abstained"], "answer": quote["answer"], "correct": quote["correct"]})
    return out


def _unsupported(row: Dict[str, Any]) -> Optional[bool]:
    """Answered although the context cannot support it: generation-free proxy of a confident wrong answer."""
    if row["abstained"]:
        return False
    if row["kind"] == ANSWERABLE:
        return None if row["answer_in_context"] is None else not row["answer_in_context"]
    # An out-of-corpus question's context may hold its fact from another passage (rows scored before that: never).
    return row["kind"] == UNANSWERABLE or not row.get("answer_in_context")


@dataclass(frozen=True)
class Target:
    """One target of the issue, with the seed's figure and ours."""

    name: str
    seed: str
    measured: str
    met: Optional[bool]


# The Harbor Analytics seed case: wrong answers 31% -> 8%, context precision 52% -> 79%, generator input -37%,
# +48 ms p95; and the protocol targets.
SEED_WRONG, SEED_PRECISION, SEED_INPUT, SEED_P95_MS = (0.31, 0.08), (0.52, 0.79), -0.37, 48.0
MIN_OOC_ABSTENTION, MAX_FALSE_ABSTENTION, MAX_CORRECT_PATH_RATIO = 0.90, 0.05, 1.05


def targets(figures: Dict[str, Dict[str, Any]], rows: Sequence[Dict[str, Any]], system: str = "crag") -> List[Target]:
    """How ``system`` fares against plain RAG on the issue's targets (empty without both in the run)."""
    if system not in figures or "plain" not in figures:
        return []
    ours, base = figures[system], figures["plain"]
    generated = ours["wrong_answers"] is not None
    wrong_key = "wrong_answers" if generated else "unsupported_answers"
    wrong_label = "wrong answers" if generated else "unsupported answers (answered, gold not in context)"
    found: List[Target] = [
        _relative(
            f"{wrong_label}: relative cut",
            base[wrong_key],
            ours[wrong_key],
            _change(*SEED_WRONG),
            SEED_WRONG,
            lower=True,
        ),
        _relative(
            "context precision: relative gain",
            base["context_precision"],
            ours["context_precision"],
            _change(*SEED_PRECISION),
            SEED_PRECISION,
            lower=False,
        ),
        _relative(
            "generator input tokens: relative cut",
            base["input_tokens"],
            ours["input_tokens"],
            SEED_INPUT,
            None,
            lower=True,
            percent=False,
        ),
    ]
    for stage, label in (("total", "end to end"), ("pipeline", "pipeline: less the generator's calls")):
        added = ours["latency_ms"][stage]["p95"] - base["latency_ms"][stage]["p95"]
        found.append(
            Target(f"p95 latency added, {label}", f"+{SEED_P95_MS:.0f} ms", f"{added:+.0f} ms", added <= SEED_P95_MS)
        )
    ratio = correct_path_ratio(rows, system)
    found.append(
        Target(
            "correct-path p50 pipeline time, CRAG / plain (same questions)",
            f"<= {MAX_CORRECT_PATH_RATIO}",
            "n/a" if ratio is None else f"{ratio:.3f}",
            None if ratio is None else ratio <= MAX_CORRECT_PATH_RATIO,
        )
    )
    ooc = ours["abstain_out_of_corpus"]
    found.append(
        Target(
            "abstention on out-of-corpus questions",
            f">= {MIN_OOC_ABSTENTION:.0%}",
            _pct(ooc),
            None if ooc is None else ooc >= MIN_OOC_ABSTENTION,
        )
    )
    false = ours["false_abstention_plain_in_context"]
    found.append(
        Target(
            "false abstention on answerable questions plain RAG had in context",
            f"<= {MAX_FALSE_ABSTENTION:.0%}",
            _pct(false),
            None if false is None else false <= MAX_FALSE_ABSTENTION,
        )
    )
    return found


def correct_path_ratio(rows: Sequence[Dict[str, Any]], system: str = "crag") -> Optional[float]:
    """p50 pipeline time of ``system`` over p50 of plain RAG, on the questions ``system`` graded correct."""
    plain = {(r["kind"], r["qid"]): r for r in rows if r["system"] == "plain"}
    pairs = [
        (pipeline_ms(r), pipeline_ms(plain[(r["kind"], r["qid"])]))
        for r in rows
        if r["system"] == system and r["action"] == "correct" and (r["kind"], r["qid"]) in plain
    ]
    if not pairs:
        return None
    ours, base = zip(*pairs)
    return float(np.median(ours) / np.median(base))


def _change(before: float, after: float) -> float:
    return (after - before) / before


def _relative(
    name: str,
    base: Optional[float],
    ours: Optional[float],
    seed_change: float,
    seed_pair: Optional[tuple[float, float]],
    lower: bool,
    percent: bool = True,
) -> Target:
    seed = f"{seed_change:+.0%}" + (f" ({seed_pair[0]:.0%} -> {seed_pair[1]:.0%})" if seed_pair else "")
    if base is None or ours is None or base == 0:
        return Target(name, seed, "n/a", None)
    change = _change(base, ours)
    shown = "{:.0%}" if percent else "{:,.0f}"  # a share, or a count (tokens)
    measured = f"{change:+.0%} ({shown.format(base)} -> {shown.format(ours)})"
    return Target(name, seed, measured, change <= seed_change if lower else change >= seed_change)


def _pct(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1%}"
