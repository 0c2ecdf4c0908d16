"""The corrective loop's own cost on SciFact's 5,183 abstracts: CRAG on against CRAG off, path by path.

For each sampled claim the same engine answers with CRAG off (``enabled=False``, as
``CRAG_ENABLED=false``) and on, in alternating order, over one index. The LLM is a
fixed fake (``FixedLLM``: the prompt is built and packed, then answered at once with the
context's first two sentences; the rewrite appends a fixed word to the question), so the
times are the pipeline's: retrieval, grading, refinement, fallback retrieval, regrading
and the answer check.
Queries are grouped by the path CRAG took (correct, ambiguous, incorrect) and the
on/off ratio is given at p50 and p95 for each, for three graders: the bundled
bi-encoder, the evidence scorer (the engine's default), and reuse of the scores of a
reranker both pipelines run (no model call of its own). The evidence scorer runs twice,
with and without the check of each generated answer against its sources, and a row of
its own sets the two against each other (the check's cost), with the check's own time
per answer; another runs both sides with a scope set (``filters=`` admitting every passage),
the cost of checking every candidate against a caller's scope. The LLM-judge CRAG is
measured the same way on a smaller sample, its judge the real bundled SmolLM2 (its
calls are its grading cost). Peak memory: the process's peak RSS after each phase,
and the peak Python allocation of one query on each path (tracemalloc).

Run (about 20 minutes on 2 cores once the corpus embeddings are cached by
``llama-crag eval``; the first run embeds the corpus, which takes longer):

    OMP_NUM_THREADS=1 python benchmarks/bench_engine.py --dataset ../shared/datasets/scifact
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
import tracemalloc
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen, LLMMetadata
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.response_synthesizers import get_response_synthesizer
from llama_index.core.schema import MetadataMode
from llama_index.core.vector_stores.types import FilterOperator, MetadataFilter, MetadataFilters
from tqdm import tqdm

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.core.settings import CragSettings
from llama_index_crag.evaluation.corpus import EvalCorpus
from llama_index_crag.evaluation.dataset import load_eval_questions
from llama_index_crag.evaluation.llm_judge import LLMJudgeQueryEngine
from llama_index_crag.evaluation.metrics import pipeline_ms
from llama_index_crag.evaluation.systems import ScorerRerank
from llama_index_crag.local.models import default_llm
from llama_index_crag.scorers import BiEncoderScorer, EvidenceScorer, UpstreamScoreScorer

PATHS = ("correct", "ambiguous", "incorrect")
#: The trace's stages whose times the per-step table gives (CRAG on), in the loop's order.
STEPS = ("retrieve", "grade", "refine", "fallback", "regrade", "check")
_UNCHECKED = {"check_answers": False}
#: A scope that admits every passage (each has a doc_id), so that a scoped engine finds what an unscoped one does
#: and the row measures what checking and narrowing to a scope costs, path by path.
_EVERY_DOCUMENT = {
    "filters": MetadataFilters(filters=[MetadataFilter(key="doc_id", operator=FilterOperator.NE, value="")])
}
TOP_K = 5
RERANK_TOP_K = 10


def _calibrated(build: Any, scorer: Any, path: str) -> CorrectiveQueryEngine:
    """An engine with ``scorer`` whose weights, cascade and thresholds come from a calibration file."""
    data = json.loads(Path(path).read_text())
    scorer.load_state(data["scorer_state"])
    thresholds = {k: data["thresholds"][k] for k in ("upper", "lower", "strip_threshold") if k in data["thresholds"]}
    return build(True, scorer, settings=thresholds)


class FixedLLM(CustomLLM):
    """Answers at once with the context's first two sentences, and rewrites a query by appending a fixed word.

    An answer drawn from the context gives the answer check what a real answer gives it:
    figures, names and dates to find in the sources.
    """

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=4096, num_output=128, model_name="fixed")

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        parts = prompt.split("---------------------")
        context = parts[1] if len(parts) > 2 else ""
        sentences = [s.strip() for s in context.replace("\n", " ").split(". ") if s.strip()]
        return CompletionResponse(text=". ".join(sentences[:2]) or "A fixed answer.")

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        raise NotImplementedError("the benchmark does not stream")

    def structured_predict(self, output_cls: Any, prompt: Any, llm_kwargs: Any = None, **prompt_args: Any) -> Any:
        return output_cls(query=f"{prompt_args['query']} evidence")


def peak_rss_mb() -> float:
    """The process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def timed(engine: BaseQueryEngine, question: str) -> Dict[str, Any]:
    """One query: its action, its pipeline time (less generation and rewrite), its grading and answer-check time."""
    start = time.perf_counter()
    trace = engine.query(question).metadata["crag"]  # type: ignore[index]
    timings = {**trace["timings_ms"], "total": (time.perf_counter() - start) * 1000.0}
    return {
        "action": trace["action"],
        "pipeline_ms": pipeline_ms({"timings_ms": timings}),
        "grade_ms": timings.get("grade", 0.0) + timings.get("regrade", 0.0),
        "check_ms": timings.get("check"),
        "steps_ms": {step: timings[step] for step in STEPS if step in timings},
    }


def compare(off: BaseQueryEngine, on: BaseQueryEngine, questions: Sequence[str], desc: str) -> List[Dict[str, Any]]:
    """Each question through both engines, the order alternating so drift in machine load falls on both."""
    pairs = []
    for i, question in enumerate(tqdm(questions, desc=desc, unit="q")):
        if i % 2:
            result_on, result_off = timed(on, question), timed(off, question)
        else:
            result_off, result_on = timed(off, question), timed(on, question)
        pairs.append({"question": question, "off": result_off, "on": result_on})
    return pairs


def summarize(pairs: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """On/off pipeline time at p50 and p95 for each path CRAG took, and the grading cost."""
    found: Dict[str, Dict[str, Any]] = {}
    for path in (*PATHS, "all"):
        mine = [p for p in pairs if path == "all" or p["on"]["action"] == path]
        if not mine:
            continue
        off = np.array([p["off"]["pipeline_ms"] for p in mine])
        on = np.array([p["on"]["pipeline_ms"] for p in mine])
        grade = np.array([p["on"]["grade_ms"] for p in mine])
        checks = [p["on"]["check_ms"] for p in mine if p["on"].get("check_ms") is not None]
        ran = [p["on"].get("steps_ms", {}) for p in mine]
        steps = {step: [t[step] for t in ran if step in t] for step in STEPS}
        found[path] = {
            "queries": len(mine),
            "off_p50": float(np.percentile(off, 50)),
            "on_p50": float(np.percentile(on, 50)),
            "ratio_p50": float(np.percentile(on, 50) / np.percentile(off, 50)),
            "off_p95": float(np.percentile(off, 95)),
            "on_p95": float(np.percentile(on, 95)),
            "ratio_p95": float(np.percentile(on, 95) / np.percentile(off, 95)),
            "grade_ms_p50": float(np.percentile(grade, 50)),
            "grade_ms_mean": float(grade.mean()),
            "check_ms_p50": float(np.percentile(checks, 50)) if checks else None,
            "check_ms_p95": float(np.percentile(checks, 95)) if checks else None,
            "steps_ms_p50": {step: float(np.percentile(times, 50)) for step, times in steps.items() if times},
        }
    return found


def allocation_peaks(
    off: BaseQueryEngine, on: BaseQueryEngine, pairs: Sequence[Dict[str, Any]], per_path: int
) -> Dict[str, Dict[str, float]]:
    """Median peak Python allocation (MiB, tracemalloc) of one query per path, CRAG off and on."""
    found: Dict[str, Dict[str, float]] = {}
    tracemalloc.start()
    for path in PATHS:
        questions = [p["question"] for p in pairs if p["on"]["action"] == path][:per_path]
        if not questions:
            continue
        peaks: Dict[str, List[float]] = {"off": [], "on": []}
        for question in questions:
            for label, engine in (("off", off), ("on", on)):
                tracemalloc.reset_peak()
                before = tracemalloc.get_traced_memory()[0]
                engine.query(question)
                peaks[label].append((tracemalloc.get_traced_memory()[1] - before) / 2**20)
        found[path] = {label: float(np.median(v)) for label, v in peaks.items()}
    tracemalloc.stop()
    return found


def markdown(results: Dict[str, Any]) -> str:
    """The benchmark's tables."""
    lines = [
        f"Benchmark: `{results['command']}` ({results['date']})",
        "",
        f"{results['documents']:,} abstracts ({results['chunks']:,} chunks), top-{TOP_K}; {results['queries']} claims "
        f"sampled (seed {results['seed']}), each through CRAG off and on. Pipeline times in ms: a fixed fake LLM "
        "generates and rewrites; the LLM judge's calls (real SmolLM2) are its grading.",
        "",
        "| grader | path | queries | off p50 | on p50 | ratio p50 | off p95 | on p95 | ratio p95 | grading ms p50 "
        "| answer check ms p50 / p95 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config, paths in results["configurations"].items():
        for path, f in paths.items():
            lines.append(
                f"| {config} | {path} | {f['queries']} | {f['off_p50']:.0f} | {f['on_p50']:.0f} | "
                f"{f['ratio_p50']:.2f} | {f['off_p95']:.0f} | {f['on_p95']:.0f} | {f['ratio_p95']:.2f} | "
                f"{f['grade_ms_p50']:.1f} | {_check_cell(f)} |"
            )
    lines += [
        "",
        "In the answer-check row, off is CRAG on with its answers unchecked and on is the same with every answer "
        "checked: its ratio is the check's cost alone.",
        "",
        "Per step, CRAG on, p50 ms over the queries of the path that ran the step:",
        "",
        "| grader | path | " + " | ".join(STEPS) + " |",
        "|---|---|" + "---|" * len(STEPS),
    ]
    for config, paths in results["configurations"].items():
        for path, f in paths.items():
            if path == "all":
                continue
            times = f.get("steps_ms_p50", {})
            cells = " | ".join(f"{times[step]:.1f}" if step in times else "-" for step in STEPS)
            lines.append(f"| {config} | {path} | {cells} |")
    lines += ["", "Peak RSS (MiB) after each phase:", ""]
    lines += [f"- {phase}: {mb:,.0f}" for phase, mb in results["peak_rss_mb"].items()]
    lines += [
        "",
        f"Peak Python allocation of one query, {results['allocation_peak_grader']} "
        "(MiB, median; tracemalloc, excludes torch tensors):",
        "",
    ]
    lines += [
        f"- {path}: CRAG off {v['off']:.1f}, on {v['on']:.1f}" for path, v in results["allocation_peak_mib"].items()
    ]
    if results.get("reader_cascade"):
        c = results["reader_cascade"]
        lines += ["", f"Reader cascade: {c['reached_the_reader']:.1%} of {c['batches']} graded batches ran the reader."]
    return "\n".join(lines) + "\n"


def _check_cell(figures: Dict[str, Any]) -> str:
    if figures.get("check_ms_p50") is None:
        return "-"
    return f"{figures['check_ms_p50']:.2f} / {figures['check_ms_p95']:.2f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="../shared/datasets/scifact", help="folder in the shared dataset format")
    parser.add_argument("--queries", type=int, default=300, help="claims sampled for the on/off comparison")
    parser.add_argument("--judge-queries", type=int, default=30, help="of those, how many the LLM-judge answers")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample")
    parser.add_argument("--cache-dir", default=".crag-cache", help="where corpus embeddings are cached")
    parser.add_argument("--out", default="eval-out/bench_engine", help="folder for bench_engine.json and .md")
    parser.add_argument("--grader", default=None, help="also measure the reader cascade of this grader directory")
    parser.add_argument("--grader-calibration", default=None, help="its calibration (calibrate --scorer reader:DIR)")
    parser.add_argument(
        "--only",
        action="append",
        default=None,
        help="measure only the rows whose name holds this text (repeatable; e.g. --only 'engine default')",
    )
    args = parser.parse_args(argv)

    judge_llm, described = default_llm()
    print(f"LLM judge: {described}. Everything else: a fixed fake LLM.")
    llm = FixedLLM()
    questions = load_eval_questions(args.dataset)
    drawn = [
        q.question.question for q in random.Random(args.seed).sample(questions, min(args.queries + 3, len(questions)))
    ]
    warm_up, sample = drawn[:3], drawn[3:]  # scorers cache query embeddings: warm up on other questions
    rss = {"models loaded": peak_rss_mb()}
    corpus = EvalCorpus.build(Path(args.dataset), questions, Path(args.cache_dir), TOP_K, progress=True)
    corpus.fallback.warm()  # what grading reads (chunks, knowledge strips) embedded with the index, not in a query
    rss["index and fallback built"] = peak_rss_mb()

    synthesizer = get_response_synthesizer(llm=llm)
    texts = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in corpus.nodes]

    def engine(
        enabled: bool, scorer: Any, top_k: int = TOP_K, postprocessors: Any = None, settings: Any = None
    ) -> CorrectiveQueryEngine:
        """An engine over the corpus; ``settings`` are ``CragSettings`` keywords (thresholds, the answer check)."""
        return CorrectiveQueryEngine.from_defaults(
            retriever=corpus.retriever(top_k),
            llm=llm,
            scorer=scorer,
            fallback=corpus.fallback_retriever(TOP_K),
            response_synthesizer=synthesizer,
            node_postprocessors=postprocessors,
            enabled=enabled,
            **(settings or {}),
        )

    off = engine(False, BiEncoderScorer())
    # Each side has its own reranker: a shared one would embed a passage for whichever side asks first.
    rerank_off, rerank_on = (ScorerRerank(BiEncoderScorer(), top_n=TOP_K) for _ in range(2))
    checked, unchecked = (
        engine(True, EvidenceScorer(corpus=texts)),
        engine(True, EvidenceScorer(corpus=texts), settings=_UNCHECKED),
    )
    configurations = {
        "bi-encoder": (off, engine(True, BiEncoderScorer())),
        "evidence (engine default)": (off, checked),
        "evidence, answers unchecked": (off, unchecked),
        # The check's own cost: the same two engines, each query through both in alternating order, once both are
        # warm (the rows above run each against CRAG off in turn, so the later one meets warmer word caches).
        "answer check: evidence checked / unchecked": (unchecked, checked),
        "evidence, a scope set (filters= on both sides)": (
            engine(False, BiEncoderScorer(), settings=_EVERY_DOCUMENT),
            engine(True, EvidenceScorer(corpus=texts), settings=_EVERY_DOCUMENT),
        ),
        "reused reranker scores": (
            engine(False, BiEncoderScorer(), RERANK_TOP_K, [rerank_off]),
            engine(
                True,
                UpstreamScoreScorer.from_reranker(rerank_on),
                RERANK_TOP_K,
                [rerank_on],
                BiEncoderScorer.BUNDLED_THRESHOLDS,  # the reranker's scores are the bi-encoder's cosines
            ),
        ),
    }
    if args.only:
        configurations = {
            name: pair for name, pair in configurations.items() if any(part in name for part in args.only)
        }
    reader = None
    if args.grader:
        from llama_index_crag.scorers.reader import ReaderScorer

        reader = ReaderScorer(args.grader, corpus=texts)
        configurations["reader cascade"] = (
            off,
            _calibrated(engine, reader, args.grader_calibration) if args.grader_calibration else engine(True, reader),
        )
    for off, on in configurations.values():  # lazy loads (sentence splitter, caches) outside the measurement
        for question in warm_up:
            off.query(question)
            on.query(question)
    if reader is not None:
        reader.reader_runs = reader.settled = 0
    pairs = {name: compare(off, on, sample, name) for name, (off, on) in configurations.items()}
    rss["CRAG off and on runs"] = peak_rss_mb()
    reader_share = None
    if reader is not None:
        graded = reader.reader_runs + reader.settled
        reader_share = {"batches": graded, "reached_the_reader": round(reader.reader_runs / max(1, graded), 4)}

    judge = LLMJudgeQueryEngine(
        retriever=corpus.retriever(TOP_K),
        llm=judge_llm,
        fallback=corpus.fallback_retriever(TOP_K),
        response_synthesizer=synthesizer,
        abstain_text=CragSettings.model_fields["abstain_text"].default,
    )
    if args.judge_queries:
        judge.query(warm_up[0])
        pairs["LLM judge (SmolLM2, 1 call per chunk)"] = compare(off, judge, sample[: args.judge_queries], "llm-judge")
        rss["LLM-judge runs"] = peak_rss_mb()

    measured = "bi-encoder" if "bi-encoder" in configurations else next(iter(configurations))
    results = {
        "command": "OMP_NUM_THREADS=1 python benchmarks/bench_engine.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "documents": len({n.metadata.get("doc_id") for n in corpus.nodes}),
        "chunks": len(corpus.nodes),
        "queries": len(sample),
        "seed": args.seed,
        "configurations": {name: summarize(p) for name, p in pairs.items()},
        "peak_rss_mb": rss,
        "reader_cascade": reader_share,
        "allocation_peak_grader": measured,
        "allocation_peak_mib": allocation_peaks(*configurations[measured], pairs[measured], per_path=5),
        "pairs": pairs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_engine.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    (out / "bench_engine.md").write_text(markdown(results), encoding="utf-8")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
