"""The evaluation's outputs: a Markdown report, a JSON file of every figure and row, and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from llama_index_crag.core.settings import MAX_TIMEOUT_S
from llama_index_crag.errors import MissingDependency
from llama_index_crag.evaluation.metrics import LATENCY_STAGES

ACTIONS = ("correct", "ambiguous", "incorrect", "disabled")
PLOTS = ("quality.png", "latency.png", "actions.png")

Figures = Dict[str, Dict[str, Any]]

# (label, figure key, format): the rows of the figures table. Arrows say which way is right.
_ROWS: Sequence[Tuple[str, str, str]] = (
    ("abstention, out of corpus (higher is right)", "abstain_out_of_corpus", "pct"),
    ("out of corpus, answered right from another passage that holds the answer", "answered_right_out_of_corpus", "pct"),
    ("abstention, unanswerable (higher is right)", "abstain_unanswerable", "pct"),
    ("false abstention, answerable (lower is right)", "false_abstention", "pct"),
    ("false abstention, answerable that plain RAG had in context", "false_abstention_plain_in_context", "pct"),
    (
        "false abstention with a passage of the question's document retrieved (the grade's or the quote's)",
        "false_abstention_retrieved",
        "pct",
    ),
    ("answer in context, answerable", "answer_in_context", "pct"),
    ("context precision, answerable", "context_precision", "pct"),
    ("unsupported answers: answered without the gold in context", "unsupported_answers", "pct"),
    ("wrong answers: answered, and not correctly", "wrong_answers", "pct"),
    ("answer accuracy, all queries", "accuracy", "pct"),
    ("answer accuracy, answerable", "accuracy_answerable", "pct"),
    ("truthfulness: correct minus wrong answers, abstaining counts 0 (higher is right)", "truthfulness", "pct"),
    ("wrong answers among answered answerable queries (lower is right)", "wrong_among_answered_answerable", "pct"),
    ("answers flagged by the answer check (kept, marked)", "flagged_answers", "pct"),
    ("quotes withheld: they did not answer the question together, so CRAG abstained", "quotes_withheld", "pct"),
    ("generator input tokens per query", "input_tokens", "num"),
    ("generator input tokens per answered query", "input_tokens_answered", "num"),
    ("LLM judge calls per query", "judge_calls", "num"),
)


def write_report(out: Path, results: Dict[str, Any]) -> None:
    """Write ``report.md``, ``results.json`` and the plots into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    _plots(out, results["figures"])
    (out / "report.md").write_text(markdown(results), encoding="utf-8")


def markdown(results: Dict[str, Any]) -> str:
    """The report: how it was run, the figures, latency per stage, the targets, the plots."""
    meta, figures = results["meta"], results["figures"]
    systems = list(figures)
    config, dataset = meta["config"], meta["dataset"]
    queries = next(iter(figures.values()))["queries"] if figures else {}
    thresholds = meta["thresholds"]
    lines = [
        f"# CRAG evaluation: {Path(dataset['path']).name}",
        "",
        "```",
        meta["command"],
        "```",
        "",
        f"Run {meta['date']}. Dataset `{dataset['path']}`: {dataset['documents']:,} documents "
        f"({dataset['chunks']:,} chunks), {dataset['questions']:,} questions, asked as "
        f"{queries.get('answerable', 0)} answerable, {queries.get('unanswerable', 0)} unanswerable and "
        f"{queries.get('out_of_corpus', 0)} out-of-corpus queries (answerable questions with their relevant "
        "documents hidden from every retriever).",
        "",
        f"- Generator: {meta['generator']}."
        + (
            ""
            if config["generate"]
            else " Generation skipped (`--no-generate`): each prompt is built, packed and counted, then answered "
            "with a fixed text, so the accuracy of generated answers is not measured (quoted answers need no "
            "generator and are scored) and `generate` time is prompt building only."
        ),
        f"- CRAG scorer: {meta['scorer']}"
        + (f", thresholds upper={thresholds['upper']}, lower={thresholds['lower']}." if thresholds else "."),
        f"- Index: bundled all-MiniLM-L6-v2, `VectorStoreIndex`, top-{config['top_k']}. Fallback: BM25 and "
        "sentence windows over the same chunks.",
        *_answer_note(meta.get("answer_step") or {}, config["generate"]),
        *_limits_note(meta.get("time_limits") or {}),
        *_system_notes(meta, config, systems),
        f"- Set-up {meta['setup_s']} s; systems: " + ", ".join(f"{s} {t} s" for s, t in meta["wall_s"].items()) + ".",
        "",
        "## Figures",
        "",
        _table(
            ["figure", *systems],
            [
                [label, *(_format(figures[s][key], fmt, figures[s].get("intervals", {}).get(key)) for s in systems)]
                for label, key, fmt in _ROWS
            ],
        ),
        "± is half a 95% interval over the questions the figure averages (normal approximation).",
        "",
        _table(
            ["actions", *systems],
            [[a, *(_format(figures[s]["actions"].get(a), "pct") for s in systems)] for a in ACTIONS],
        ),
        "## Latency (ms: p50 / p95 / p99)",
        "",
        _table(["stage", *systems], _latency_rows(figures, systems)),
        "`crag_ms` is the correction's own cost (grade, refine, rewrite, fallback, regrade); `pipeline` is the "
        "end-to-end time less the generator's calls (generation and the LLM rewrite).",
        "",
    ]
    if results["targets"]:
        lines += [
            "## Targets: CRAG against plain RAG",
            "",
            _table(
                ["target", "seed", "measured", "met"],
                [
                    [t["name"], t["seed"], t["measured"], {True: "yes", False: "**no**", None: "n/a"}[t["met"]]]
                    for t in results["targets"]
                ],
            ),
        ]
    lines += ["## Plots", "", *(f"![{p[:-4]}]({p})" for p in PLOTS), ""]
    return "\n".join(lines)


def _limits_note(limits: Dict[str, Any]) -> List[str]:
    """CRAG's time limits on the correction path in this run: the engine's, or lifted so that load does not count."""
    if not limits:
        return []
    correction = float(limits.get("correction_timeout_s") or 0.0)
    rewrite = limits.get("rewrite_timeout_s")
    if correction == MAX_TIMEOUT_S and rewrite == MAX_TIMEOUT_S:
        return [
            "- CRAG's time limits on the correction path lifted (the default of `llama-crag eval`; `--time-limits` "
            "keeps them): on a busy machine a rewrite past its limit would search with the question's keywords "
            "instead, and the figures would measure the load."
        ]
    return [f"- CRAG's time limits: correction {correction} s, each rewrite {rewrite or correction / 2} s."]


def _answer_note(step: Dict[str, Any], generated: bool = True) -> List[str]:
    """How CRAG answered: quoting the evidence, or generating (checked or not, and what a failed check did)."""
    if not step:
        return []
    if step["answer_mode"] == "generate" and not generated:
        return ["- CRAG generates its answers (`answer_mode=generate`); with generation skipped they are not checked."]
    if step["answer_mode"] == "extract":
        return [
            "- CRAG answers with the quoted evidence (`answer_mode=extract`): an answer is correct when a quote "
            "holds a gold answer (an out-of-corpus question's too: another passage may hold it). The baselines "
            "generate."
        ]
    check = (
        f"each checked against its sources, an ungrounded one becomes `{step['on_ungrounded']}`"
        if step["check_answers"]
        else "unchecked"
    )
    return [f"- CRAG generates its answers (`answer_mode=generate`), {check}."]


def _system_notes(meta: Dict[str, Any], config: Dict[str, Any], systems: List[str]) -> List[str]:
    notes = []
    if "rerank" in systems:
        same = (
            " With the bi-encoder, which ranks as the index does, this is plain RAG with a shorter context."
            if meta["scorer"].startswith("bi-encoder")
            else ""
        )
        notes.append(
            f"- Rerank-only: top-{config['rerank_top_k']} reranked by CRAG's scorer, top-{config['rerank_top_n']} kept "
            f"(no cross-encoder weights exist offline).{same}"
        )
    if "llm-judge" in systems:
        notes.append(
            "- LLM-judge: the generator grades each chunk yes/no (one call per chunk); any no rewrites the query and "
            "adds the fallback's results ungraded (CorrectiveRAGPack, LangGraph's CRAG tutorial)."
        )
    return notes


def _latency_rows(figures: Figures, systems: List[str]) -> List[List[str]]:
    rows = []
    for stage in (*LATENCY_STAGES, "pipeline", "total"):
        cells = []
        for s in systems:
            p = figures[s]["latency_ms"].get(stage)
            cells.append(f"{p['p50']:.0f} / {p['p95']:.0f} / {p['p99']:.0f}" if p else "-")
        if any(c != "-" for c in cells):
            rows.append([f"`{stage}`", *cells])
    return rows


def _table(header: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _format(value: Optional[float], fmt: str, plus_minus: Optional[float] = None) -> str:
    """A figure; with ``plus_minus``, half its 95% interval after it ("2.0% ±3.1")."""
    if value is None:
        return "-"
    if fmt != "pct":
        return f"{value:,.1f}"
    return f"{value:.1%}" + ("" if plus_minus is None else f" ±{100 * plus_minus:.1f}")


def _plots(out: Path, figures: Figures) -> None:
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingDependency("the evaluation plots need matplotlib: pip install 'llama-index-crag[eval]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(figures)
    quality = [(label.split(" (")[0].split(":")[0], key) for label, key, fmt in _ROWS[:7] if fmt == "pct"]
    _bars(plt, out / "quality.png", systems, quality, lambda s, k: figures[s][k], "share of queries", "Quality")
    stages = [
        ("pipeline p50", ("pipeline", "p50")),
        ("pipeline p95", ("pipeline", "p95")),
        ("total p95", ("total", "p95")),
    ]
    _bars(
        plt,
        out / "latency.png",
        systems,
        stages,
        lambda s, k: figures[s]["latency_ms"][k[0]][k[1]],
        "milliseconds (log scale)",
        "Latency",
        log=True,
    )
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = [0.0] * len(systems)
    for action in ACTIONS:
        shares = [figures[s]["actions"].get(action, 0.0) for s in systems]
        ax.bar(systems, shares, bottom=bottom, label=action)
        bottom = [b + v for b, v in zip(bottom, shares)]
    ax.set_ylabel("share of queries")
    ax.set_title("Actions")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(out / "actions.png", dpi=110)
    plt.close(fig)


def _bars(
    plt: Any,
    path: Path,
    systems: List[str],
    series: Sequence[Tuple[str, Any]],
    value: Callable[[str, Any], Optional[float]],
    ylabel: str,
    title: str,
    log: bool = False,
) -> None:
    """Grouped bars: one group per series, one bar per system."""
    fig, ax = plt.subplots(figsize=(max(7, 1.4 * len(series)), 3.8))
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        heights = [value(system, key) or 0.0 for _, key in series]
        ax.bar([x + i * width for x in range(len(series))], heights, width, label=system)
    ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(series))])
    ax.set_xticklabels([label for label, _ in series], fontsize=7, rotation=15, ha="right")
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
