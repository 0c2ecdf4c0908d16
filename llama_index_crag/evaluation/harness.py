"""Runs every system over the same questions and index, in and out of corpus, and writes the report."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from llama_index.core.llms import LLM
from llama_index.core.response_synthesizers import ResponseMode, get_response_synthesizer
from llama_index.core.schema import MetadataMode
from tqdm import tqdm

from llama_index_crag.answers.extract import META_FILE, PACKAGED_DIR
from llama_index_crag.answers.policy import ANSWER_MODES, ON_UNGROUNDED, default_answer_mode
from llama_index_crag.core.engine import CorrectiveQueryEngine
from llama_index_crag.core.settings import MAX_TIMEOUT_S
from llama_index_crag.datasets import content_hash
from llama_index_crag.errors import ConfigError
from llama_index_crag.evaluation.corpus import EvalCorpus
from llama_index_crag.evaluation.dataset import EvalQuestion, load_eval_questions
from llama_index_crag.evaluation.generator import (
    MeteredLLM,
    TokenCounter,
    generator_token_counter,
    token_counter_without_generator,
)
from llama_index_crag.evaluation.metrics import (
    ANSWERABLE,
    OUT_OF_CORPUS,
    SCORING,
    UNANSWERABLE,
    make_row,
    summarize,
    targets,
)
from llama_index_crag.evaluation.report import write_report
from llama_index_crag.evaluation.systems import SYSTEMS, SystemParts
from llama_index_crag.local.models import describe_llm
from llama_index_crag.scorers.reader_model import WEIGHTS_FILE
from llama_index_crag.scorers.registry import check_spec, from_spec, spec_defaults
from llama_index_crag.stores.chunking import describe as describe_chunking

ROWS_FILE = "rows.jsonl"
#: The correction path's time limits an evaluation lifts by default (``EvalConfig.time_limits``).
LIFTED_LIMITS = ("correction_timeout_s", "rewrite_timeout_s")
RUN_FILE = "run.json"


@dataclass
class EvalConfig:
    """One evaluation run; ``command()`` is the ``llama-crag eval`` line that repeats it."""

    dataset: Path
    out: Path
    systems: Sequence[str] = tuple(SYSTEMS)
    limit: Optional[int] = None
    #: The half of the set asked (``datasets.Halves``): ``check`` for figures, ``design`` for choosing; or ``all``.
    split: str = "all"
    generate: bool = True
    scorer: str = "evidence"
    calibration: Optional[Path] = None
    #: CRAG's answer step: "extract", "generate", or None for the engine's default for the generator.
    answer_mode: Optional[str] = None
    #: What CRAG does with a generated answer that fails its check ("flag", "extract", "abstain"); None: the default.
    on_ungrounded: Optional[str] = None
    #: False: CRAG's generated answers go unchecked (the behaviour before the check existed).
    check_answers: bool = True
    #: True: CRAG keeps the engine's time limits on the correction path. False (the default): they are lifted
    #: (``LIFTED_LIMITS``, unless a ``CRAG_*`` variable sets one), so that how busy the machine is does not decide
    #: which path a question takes: a rewrite past its limit searches with the question's keywords instead.
    time_limits: bool = False
    top_k: int = 5
    rerank_top_k: int = 10
    rerank_top_n: int = 3
    cache_dir: Path = Path(".crag-cache")
    fresh: bool = False
    progress: bool = True
    llm_name: str = field(default="", compare=False)
    #: The engine's answer mode for this run's generator when ``answer_mode`` is unset (set by ``run_evaluation``).
    generator_answer_mode: Optional[str] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.systems:
            raise ConfigError(f"no system to evaluate: choose from {', '.join(SYSTEMS)}")
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown:
            raise ConfigError(f"unknown systems {unknown}: choose from {', '.join(SYSTEMS)}")
        check_spec(self.scorer)
        if self.answer_mode not in (None, *ANSWER_MODES):
            raise ConfigError(f"unknown answer mode {self.answer_mode!r}: choose {' or '.join(ANSWER_MODES)}")
        if self.on_ungrounded not in (None, *ON_UNGROUNDED):
            raise ConfigError(f"unknown on_ungrounded {self.on_ungrounded!r}: choose {', '.join(ON_UNGROUNDED)}")

    def crag_settings(self) -> Dict[str, Any]:
        """The answer-step settings CRAG is built with (only those given; the rest stay the engine's defaults)."""
        mode = self.answer_mode or self.generator_answer_mode
        chosen: Dict[str, Any] = {"answer_mode": mode, "on_ungrounded": self.on_ungrounded}
        # With generation skipped, a generated answer is a fixed text: checking it would measure the check on
        # that text (it fails, so every answer became quotes), not the grading that --no-generate measures.
        if not self.check_answers or (mode == "generate" and not self.generate):
            chosen["check_answers"] = False
        return {k: v for k, v in chosen.items() if v is not None}

    def lifted_limits(self) -> Dict[str, float]:
        """The correction path's time limits CRAG is built with in place of the engine's (none with
        ``time_limits``, or where a ``CRAG_*`` variable sets one)."""
        if self.time_limits:
            return {}
        return {k: MAX_TIMEOUT_S for k in LIFTED_LIMITS if not os.environ.get(f"CRAG_{k.upper()}", "").strip()}

    def command(self) -> str:
        """The command line that repeats this run."""
        parts = ["llama-crag", "eval", "--dataset", str(self.dataset), "--systems", ",".join(self.systems)]
        if self.limit is not None:
            parts += ["--limit", str(self.limit)]
        if self.split != "all":
            parts += ["--split", self.split]
        if not self.generate:
            parts.append("--no-generate")
        if self.scorer != "evidence":
            parts += ["--scorer", self.scorer]
        if self.calibration:
            parts += ["--calibration", str(self.calibration)]
        if self.answer_mode:
            parts += ["--answer-mode", self.answer_mode]
        if self.on_ungrounded:
            parts += ["--on-ungrounded", self.on_ungrounded]
        if not self.check_answers:
            parts.append("--no-check")
        if self.time_limits:
            parts.append("--time-limits")
        defaults = EvalConfig(dataset=self.dataset, out=self.out)
        for name in ("top_k", "rerank_top_k", "rerank_top_n"):
            if getattr(self, name) != getattr(defaults, name):
                parts += [f"--{name.replace('_', '-')}", str(getattr(self, name))]
        parts += ["--out", str(self.out)]
        return " ".join(shlex.quote(p) for p in parts)

    def fingerprint(self) -> Dict[str, Any]:
        """What must match for rows of an earlier run to be reused (limit and systems may differ)."""
        dataset = Path(self.dataset)
        return {
            "dataset": content_hash(dataset / "corpus.jsonl", dataset / "questions.jsonl"),
            "split": self.split,
            "generate": self.generate,
            "generator": self.llm_name,
            "scorer": self.scorer,
            "scorer_defaults": spec_defaults(self.scorer),
            "calibration": content_hash(self.calibration) if self.calibration else None,
            "crag_settings": self.crag_settings(),
            "lifted_limits": self.lifted_limits(),
            "environment": crag_environment(),
            # The packaged answer model decides every quoted answer: its weights, and its decision unless a quote
            # threshold is set (so that rows quoted at CRAG_QUOTE_THRESHOLD=0 outlive a refitted decision).
            "answer_model": answer_model_fingerprint(),
            "top_k": self.top_k,
            "rerank": [self.rerank_top_k, self.rerank_top_n],
            "scoring": SCORING,
            # Rows asked of chunks cut another way are not these rows (the chunks are cut to the model's window).
            "chunking": describe_chunking(),
        }


Key = Tuple[str, str, str]


def answer_model_fingerprint() -> Dict[str, Any]:
    """The packaged answer model as it decides this run's quotes: its weights' checksum, and its decision unless
    ``CRAG_QUOTE_THRESHOLD`` overrides it (that variable is in ``crag_environment``)."""
    meta = json.loads((PACKAGED_DIR / META_FILE).read_text(encoding="utf-8"))
    overridden = os.environ.get("CRAG_QUOTE_THRESHOLD", "").strip() != ""
    return {"weights": meta.get("sha256"), "decision": None if overridden else meta.get("decision")}


def crag_environment() -> str:
    """A digest of the ``CRAG_*`` variables (``CRAG_LOWER=0.55`` changes every grade) and of the files the
    calibration and grader variables name: rows graded under other settings are never reused. A digest, not
    the values: run.json must not keep an API key or a password."""
    digest = hashlib.sha256()
    for name, value in sorted((k, v) for k, v in os.environ.items() if k.upper().startswith("CRAG_")):
        digest.update(f"{name}={value}\0".encode("utf-8", "surrogateescape"))
        named = Path(value) / WEIGHTS_FILE if name.upper() == "CRAG_GRADER" else Path(value)
        if name.upper() in ("CRAG_CALIBRATION", "CRAG_GRADER") and named.is_file():
            digest.update(content_hash(named).encode())
    return digest.hexdigest()[:12]


#: The generator a run names when none is installed: nothing is generated, and CRAG rewrites offline.
NO_GENERATOR = "none installed: generation skipped, and CRAG's rewrite is the offline one (the question's keywords)"
#: The systems that cannot run without a generator (``systems.llm_judge``), refused before the corpus is embedded.
NEEDS_A_GENERATOR = ("llm-judge",)


def run_evaluation(
    config: EvalConfig, llm: Optional[LLM], count_tokens: Optional[TokenCounter] = None
) -> Dict[str, Any]:
    """Evaluate ``config.systems`` on ``config.dataset`` and write the report under ``config.out``.

    Every system answers the same queries over the same index: each question as
    labelled (answerable or unanswerable), and each answerable question again with its
    relevant documents hidden (out of corpus). ``llm`` is the generator; it also
    rewrites for CRAG and judges for the LLM-judge system, even with
    ``generate=False``, since those calls decide what those systems do. With no
    generator (``None``, as where the bundled one is not installed) only ``generate=False``
    runs: CRAG rewrites with the question's keywords, the run's generator says so, and
    the LLM judge cannot run.

    Rows are appended to ``rows.jsonl`` as they finish; a later run with the same
    settings reuses them, so an interrupted run resumes where it stopped.

    Returns:
        The results written to ``results.json``.
    """
    if llm is None:
        if config.generate:
            raise ConfigError("generating answers needs a generator: make local, or skip generation (--no-generate)")
        judged = [s for s in config.systems if s in NEEDS_A_GENERATOR]
        if judged:
            raise ConfigError(f"{', '.join(judged)} needs a generator (make local), or leave it out of --systems")
    if count_tokens is None and llm is None:
        count_tokens, counted = token_counter_without_generator()
        config.llm_name = config.llm_name or f"{NO_GENERATOR}; input tokens in {counted}"
    config.llm_name = config.llm_name or (describe_llm(llm) if llm is not None else NO_GENERATOR)
    # The engine would choose by the generator it is given, and here that is the meter in front of it.
    config.generator_answer_mode = default_answer_mode(llm)
    out = Path(config.out)
    questions = load_eval_questions(config.dataset, config.split)[: config.limit]
    done = _resume(out, config.fingerprint(), config.fresh)
    count = count_tokens or generator_token_counter()
    started = time.perf_counter()
    corpus = EvalCorpus.build(
        Path(config.dataset),
        questions,
        Path(config.cache_dir),
        config.top_k,
        progress=config.progress,
        split=config.split,
    )
    generator = MeteredLLM(llm, count, generate=config.generate)
    parts = SystemParts(
        corpus=corpus,
        make_scorer=partial(
            from_spec, config.scorer, corpus=[n.get_content(metadata_mode=MetadataMode.EMBED) for n in corpus.nodes]
        ),
        llm=llm,
        synthesizer=get_response_synthesizer(llm=generator, response_mode=ResponseMode.COMPACT),
        top_k=config.top_k,
        rerank_top_k=config.rerank_top_k,
        rerank_top_n=config.rerank_top_n,
        calibration=config.calibration,
        crag_settings={**config.crag_settings(), **config.lifted_limits()},
    )
    setup_s = time.perf_counter() - started
    queries = [(q, ANSWERABLE if q.question.answerable else UNANSWERABLE) for q in questions] + [
        (q, OUT_OF_CORPUS) for q in questions if q.question.answerable and q.question.relevant_doc_ids
    ]
    engines = {name: SYSTEMS[name](parts) for name in config.systems}
    crag = engines.get("crag")
    crag = crag if isinstance(crag, CorrectiveQueryEngine) else None
    pending = [(q, kind) for q, kind in queries if any((s, kind, q.question.qid) not in done for s in engines)]
    for engine in engines.values() if pending else ():  # loads what a system loads lazily, outside the measurement
        engine.query(pending[0][0].question.question)
        generator.take()
    names = list(engines)
    with (out / ROWS_FILE).open("a", encoding="utf-8") as sink:
        for i, (q, kind) in enumerate(tqdm(queries, desc="queries", unit="q", disable=not config.progress)):
            # Every system answers each query in turn, in a rotating order, so that changes in the load on the
            # machine fall on all systems alike.
            for name in names[i % len(names) :] + names[: i % len(names)]:
                key = (name, kind, q.question.qid)
                if key not in done:
                    done[key] = _ask(engines[name], name, kind, q, corpus, generator, config.generate, count)
                    sink.write(json.dumps(done[key]) + "\n")
                    sink.flush()
    rows: List[Dict[str, Any]] = [done[(name, kind, q.question.qid)] for name in names for q, kind in queries]
    # Each system's time is its queries' own, summed from the rows, so that a resumed run counts the rows an
    # earlier run answered too (timing only this run's queries reported 0.0 s for a run resumed when complete).
    wall_s = {name: sum(r["timings_ms"]["total"] for r in rows if r["system"] == name) / 1000.0 for name in names}
    figures = summarize(rows, config.systems)
    results = {
        "meta": {
            "command": config.command(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
            "dataset": {
                "path": str(config.dataset),
                "split": config.split,
                "documents": len({n.metadata.get("doc_id") for n in corpus.nodes}),
                "chunks": len(corpus.nodes),
                "questions": len(questions),
            },
            "generator": config.llm_name,
            "scorer": crag.grader.scorer.name if crag else config.scorer,
            "thresholds": crag.settings.model_dump(include={"upper", "lower", "aggregation"}) if crag else {},
            "answer_step": _answer_step(crag) if crag else {},
            "time_limits": crag.settings.model_dump(include=set(LIFTED_LIMITS)) if crag else {},
            "setup_s": round(setup_s, 1),
            "wall_s": {name: round(t, 1) for name, t in wall_s.items()},
        },
        "figures": figures,
        "targets": [asdict(t) for t in targets(figures, rows)],
        "rows": rows,
    }
    write_report(out, results)
    return results


def _ask(
    engine: Any,
    system: str,
    kind: str,
    question: EvalQuestion,
    corpus: EvalCorpus,
    generator: MeteredLLM,
    generated: bool,
    count: TokenCounter,
) -> Dict[str, Any]:
    hidden = question.question.relevant_doc_ids if kind == OUT_OF_CORPUS else ()
    with corpus.view.without(hidden):
        start = time.perf_counter()
        response = engine.query(question.question.question)
        total_ms = (time.perf_counter() - start) * 1000.0
    return make_row(system, kind, question, response, total_ms, generator.take(), generated, count)


def _answer_step(crag: CorrectiveQueryEngine) -> Dict[str, Any]:
    """How CRAG answered in this run: its answer mode and, for generated answers, the check and its policy."""
    s = crag.settings
    return {"answer_mode": crag.answer_mode, "check_answers": s.check_answers, "on_ungrounded": s.on_ungrounded}


def _resume(out: Path, fingerprint: Dict[str, Any], fresh: bool) -> Dict[Key, Dict[str, Any]]:
    """Rows of an earlier run with the same fingerprint; otherwise start the folder afresh."""
    out.mkdir(parents=True, exist_ok=True)
    run_file, rows_file = out / RUN_FILE, out / ROWS_FILE
    if not fresh and run_file.exists() and rows_file.exists():
        if json.loads(run_file.read_text(encoding="utf-8")) == fingerprint:
            rows = [_row(line) for line in rows_file.read_text(encoding="utf-8").splitlines()]
            return {(r["system"], r["kind"], r["qid"]): r for r in rows if r}
    rows_file.write_text("", encoding="utf-8")
    run_file.write_text(json.dumps(fingerprint, indent=2), encoding="utf-8")
    return {}


def _row(line: str) -> Dict[str, Any]:
    """A saved row; empty for a line a killed run left half-written."""
    try:
        return dict(json.loads(line))
    except json.JSONDecodeError:
        return {}
