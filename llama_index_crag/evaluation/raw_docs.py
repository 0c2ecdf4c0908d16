"""The evaluation over raw documents: ingest a folder as a user would, ask every question, score the answers.

``llama-crag eval`` measures the loop over passages that a dataset hands it ready-cut (``corpus.jsonl``). A team's
own documents come as files: HTML with navigation, long pages, tables and code. ``llama-crag eval-docs`` measures
that whole path on a set laid out as ``../shared/datasets/pgdocs`` is:

- ``docs/``: the documents, ingested with ``stores.folder.ingest`` (what ``llama-crag ingest`` runs) into an index
  folder, which is reused when it exists (an ingest of an unchanged folder embeds nothing);
- ``questions.jsonl``: ``{"qid", "question", "answerable", "answers", "source", "kind"}``, where ``source`` names
  the page (or pages, joined by ``||``) that holds the answer, and ``kind`` is ``answerable``, ``compound``
  (needs every one of its ``answers``), or an unanswerable kind (``near_miss``, ``off_topic``).

Every question is asked of the default engine over that folder (``core.persisted.load_engine``) with no
generator: the answer is the quoted evidence, so no model but the embedding model runs. An answer is *right*
when it holds one of ``answers`` (a compound question: every one of them), compared case-insensitively with
whitespace collapsed; an unanswerable question is right only when the engine abstains, and any answer to it is
*wrong*. Truthfulness is right minus wrong over all questions.

Beside CRAG, plain retrieval over the same index (the vector retriever's top ``k``, no grading) is reported two
ways, since with no generator plain RAG cannot answer in its own words: *plain, top passage quoted* answers
every question with its first passage (so it never abstains), and *answer in plain top-k* is the share of
answerable questions whose answers stand in the top ``k`` passages together (retrieval's recall, the ceiling of
any grader).
"""

from __future__ import annotations

import json
import resource
import shlex
import shutil
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.schema import MetadataMode, NodeWithScore
from tqdm import tqdm

from llama_index_crag.datasets import SPLITS, Halves, Question, numbered_rows, text_field
from llama_index_crag.errors import DatasetError
from llama_index_crag.evaluation.metrics import half_width
from llama_index_crag.local.embedding_cache import WrappedEmbedding

RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"
#: The kinds of questions in the order a report lists them; any other kind a set uses follows, in file order.
KIND_ORDER = ("answerable", "compound", "near_miss", "off_topic", "unanswerable")
#: The kind whose every answer must be in the answer.
COMPOUND = "compound"
RIGHT, WRONG, ABSTAINED = "right", "wrong", "abstained"
#: The two ways plain retrieval is reported (see the module's docstring), and CRAG.
CRAG, PLAIN_TOP = "crag", "plain_top_passage"


@dataclass(frozen=True)
class DocQuestion:
    """One question of a raw-document set: ``sources`` are the document ids (paths under ``docs/``) that hold it."""

    qid: str
    question: str
    kind: str
    answerable: bool
    answers: Tuple[str, ...] = ()
    sources: Tuple[str, ...] = ()

    @property
    def needs_every_answer(self) -> bool:
        """A compound question is right only with every one of its answers (two facts from two pages)."""
        return self.kind == COMPOUND

    def as_question(self) -> Question:
        """The question as ``datasets.Halves`` reads one (its sources as its relevant documents)."""
        return Question(self.qid, self.question, list(self.answers), self.answerable, list(self.sources))


def load_doc_questions(path: Path | str) -> List[DocQuestion]:
    """The questions of a raw-document set's ``questions.jsonl`` (a repeated ``qid`` or an answerable question
    with no answer is refused: it could never be scored right)."""
    questions: List[DocQuestion] = []
    for where, row in numbered_rows(Path(path)):
        answers = row.get("answers") or []
        if not isinstance(answers, list) or not all(isinstance(a, (str, int, float)) for a in answers):
            raise DatasetError(f"{where} has 'answers' {json.dumps(answers)[:80]}: it must be a list of strings")
        answerable = bool(row.get("answerable", bool(answers)))
        texts = tuple(str(a) for a in answers if str(a).strip())
        if answerable and not texts:
            raise DatasetError(f"{where} is answerable but has no answers to score an answer against")
        source = row.get("source") or row.get("relevant_doc_ids") or ""
        named = source if isinstance(source, list) else str(source).split("||")
        questions.append(
            DocQuestion(
                qid=text_field(row, where, "qid"),
                question=text_field(row, where, "question"),
                kind=str(row.get("kind") or ("answerable" if answerable else "unanswerable")),
                answerable=answerable,
                answers=texts,
                sources=tuple(s.strip() for s in map(str, named) if s.strip()),
            )
        )
    repeated = sorted(q for q, n in Counter(q.qid for q in questions).items() if n > 1)
    if repeated:
        raise DatasetError(f"{path} repeats qid {', '.join(map(repr, repeated[:5]))}")
    return questions


def collapsed(text: str) -> str:
    """Lower case, whitespace collapsed: how an answer is looked for in a text."""
    return " ".join(text.casefold().split())


def holds(text: str, answers: Sequence[str], every: bool = False) -> bool:
    """Whether ``text`` holds one of ``answers`` (``every``: all of them), case-insensitive, whitespace collapsed."""
    wanted = [collapsed(a) for a in answers if a.strip()]
    if not wanted:
        return False
    found = collapsed(text)
    return (all if every else any)(a in found for a in wanted)


def outcome(question: DocQuestion, answer: str, abstained: bool) -> str:
    """``right``, ``wrong`` or ``abstained``: an unanswerable question is right only when abstained on."""
    if abstained:
        return ABSTAINED if question.answerable else RIGHT
    if not question.answerable:
        return WRONG
    return RIGHT if holds(answer, question.answers, question.needs_every_answer) else WRONG


def split_set(
    questions: Sequence[DocQuestion], documents: Iterable[str], split: str
) -> Tuple[List[DocQuestion], List[str]]:
    """The questions and document ids of one half (``datasets.Halves``: by source page, pages a question names
    together fall together; a question with no source by a hash of its qid), or of the whole set."""
    halves = Halves.of_questions([q.as_question() for q in questions], split)
    kept = [q for q in questions if halves.keeps_question(q.as_question())]
    return kept, [d for d in documents if halves.keeps_document(d)]


class CountingEmbedding(WrappedEmbedding):
    """An embedding model that counts the passages it embeds (what an ingest pays for), and is otherwise ``inner``."""

    _count: int = PrivateAttr(default=0)

    def __init__(self, inner: BaseEmbedding) -> None:
        super().__init__(inner)

    @property
    def embedded(self) -> int:
        return self._count

    @classmethod
    def class_name(cls) -> str:
        return "CountingEmbedding"

    def get_text_embedding_batch(self, texts: List[str], show_progress: bool = False, **kwargs: Any) -> List[Embedding]:
        self._count += len(texts)
        return super().get_text_embedding_batch(texts, show_progress=show_progress, **kwargs)


@dataclass
class DocEvalConfig:
    """One raw-document evaluation; ``command()`` is the ``llama-crag eval-docs`` line that repeats it."""

    docs: Path
    questions: Path
    out: Path
    split: str = "all"
    #: The index folder to ingest into and ask; None: one under ``out`` named for the split and the chunker, so
    #: that a changed chunker never reuses chunks cut by another (an ingest re-chunks changed documents only).
    index: Optional[Path] = None
    limit: Optional[int] = None
    top_k: int = 5
    progress: bool = True
    dataset: Optional[Path] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise DatasetError(f"unknown split {self.split!r}: choose {', '.join(SPLITS)}")

    def index_dir(self) -> Path:
        if self.index is not None:
            return Path(self.index)
        return Path(self.out) / f"index-{self.split}-{chunker_fingerprint()}"

    def command(self) -> str:
        parts = ["llama-crag", "eval-docs"]
        if self.dataset is not None:
            parts += ["--dataset", str(self.dataset)]
        else:
            parts += ["--docs", str(self.docs), "--questions", str(self.questions)]
        if self.split != "all":
            parts += ["--split", self.split]
        if self.index is not None:
            parts += ["--index", str(self.index)]
        if self.limit is not None:
            parts += ["--limit", str(self.limit)]
        if self.top_k != 5:
            parts += ["--top-k", str(self.top_k)]
        parts += ["--out", str(self.out)]
        return " ".join(shlex.quote(p) for p in parts)


def chunker_fingerprint() -> str:
    """A short digest of how ingest chunks (``stores.chunking.fingerprint``)."""
    from llama_index_crag.stores.chunking import fingerprint

    return fingerprint()


def document_ids(docs: Path) -> List[str]:
    """Every file under ``docs`` as ingest names it (its path relative to ``docs``), hidden ones left out."""
    return sorted(
        p.relative_to(docs).as_posix()
        for p in docs.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(docs).parts)
    )


def half_folder(docs: Path, kept: Sequence[str], folder: Path) -> Path:
    """The documents ``kept`` copied into ``folder`` (with their sidecars), so that ingest reads one half alone;
    files no longer in the half are removed, so a reused index drops them too."""
    wanted = set(kept)
    folder.mkdir(parents=True, exist_ok=True)
    for present in document_ids(folder):
        if present not in wanted and not any(present == f"{k}.meta.json" for k in wanted):
            (folder / present).unlink()
    for doc_id in kept:
        for name in (doc_id, f"{doc_id}.meta.json"):
            source, target = docs / name, folder / name
            if source.is_file() and (not target.exists() or target.read_bytes() != source.read_bytes()):
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
    return folder


def peak_memory_mb() -> float:
    """This process's peak resident memory so far, in MB (``resource.getrusage``; kilobytes on Linux)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)


def run_doc_evaluation(config: DocEvalConfig) -> Dict[str, Any]:
    """Ingest the documents of ``config``'s split, ask its questions, write ``results.json`` and ``report.md``
    under ``config.out`` and return the results."""
    from llama_index_crag.core.persisted import load_engine
    from llama_index_crag.local.models import default_embed_model
    from llama_index_crag.stores.folder import ingest, load_index

    docs, out = Path(config.docs), Path(config.out)
    if not docs.is_dir():
        raise DatasetError(f"{docs} is not a folder of documents")
    every = load_doc_questions(config.questions)
    questions, kept = split_set(every, [d for d in document_ids(docs) if not d.endswith(".meta.json")], config.split)
    questions = questions[: config.limit]
    out.mkdir(parents=True, exist_ok=True)
    source = docs if config.split == "all" else half_folder(docs, kept, out / f"docs-{config.split}")
    index_dir = config.index_dir()
    reused = (index_dir / "manifest.json").exists()
    counter = CountingEmbedding(default_embed_model())
    started = time.perf_counter()
    report = ingest(source, index_dir, embed_model=counter, progress=config.progress)
    ingest_s = time.perf_counter() - started
    ingest_memory = peak_memory_mb()
    loaded = load_index(index_dir)
    engine = load_engine(loaded, None)
    plain = loaded.index.as_retriever(similarity_top_k=config.top_k)
    lengths = _passage_lengths(loaded.nodes)
    rows: List[Dict[str, Any]] = []
    for question in tqdm(questions, desc="questions", unit="q", disable=not config.progress):
        rows.append(_ask(engine, plain, question))
    results: Dict[str, Any] = {
        "meta": {
            "command": config.command(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "split": config.split,
            "documents": report.documents,
            "skipped": report.skipped,
            "questions": len(questions),
            "index": str(index_dir),
            "index_reused": reused,
            "chunker": _chunker(),
            "chunks": len(loaded.nodes),
            "passage_chars": lengths,
            "ingest_s": round(ingest_s, 1),
            "embeddings_made": counter.embedded,
            "peak_memory_mb": {"after_ingest": ingest_memory, "end": peak_memory_mb()},
            "top_k": config.top_k,
        },
        "figures": summarize(rows),
        "rows": rows,
    }
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    (out / REPORT_FILE).write_text(render(results), encoding="utf-8")
    return results


def _chunker() -> Dict[str, Any]:
    from llama_index_crag.stores.chunking import describe

    return describe()


def _passage_lengths(nodes: Sequence[Any]) -> Dict[str, float]:
    sizes = sorted(len(n.get_content(metadata_mode=MetadataMode.NONE)) for n in nodes)
    if not sizes:
        return {}
    return {"median": float(statistics.median(sizes)), "max": float(sizes[-1]), "mean": round(statistics.mean(sizes))}


def _ask(engine: Any, plain: Any, question: DocQuestion) -> Dict[str, Any]:
    started = time.perf_counter()
    response = engine.query(question.question)
    crag_ms = (time.perf_counter() - started) * 1000.0
    trace = (response.metadata or {}).get("crag", {})
    abstained = bool(trace.get("abstained"))
    answer = "" if abstained else str(response.response or "")
    context = "\n".join(n.node.get_content(metadata_mode=MetadataMode.NONE) for n in response.source_nodes or [])
    hits: List[NodeWithScore] = plain.retrieve(question.question)
    passages = [h.node.get_content(metadata_mode=MetadataMode.NONE) for h in hits]
    every = question.needs_every_answer
    top = passages[0] if passages else ""
    return {
        "qid": question.qid,
        "kind": question.kind,
        "answerable": question.answerable,
        "question": question.question,
        "answers": list(question.answers),
        CRAG: outcome(question, answer, abstained),
        PLAIN_TOP: outcome(question, top, not passages),
        "in_plain_top_k": holds("\n".join(passages), question.answers, every) if question.answerable else None,
        "in_crag_context": holds(context, question.answers, every) if question.answerable and not abstained else None,
        "source_in_plain_top_k": bool(set(question.sources) & {h.node.metadata.get("doc_id") for h in hits}),
        "action": trace.get("action"),
        "abstain_reason": trace.get("abstain_reason"),
        "answer": answer[:600],
        "warnings": list(trace.get("warnings") or []),
        "ms": round(crag_ms, 1),
    }


def _kinds(rows: Sequence[Dict[str, Any]]) -> List[str]:
    present = list(dict.fromkeys(r["kind"] for r in rows))
    return [k for k in KIND_ORDER if k in present] + [k for k in present if k not in KIND_ORDER]


def _figures(rows: Sequence[Dict[str, Any]], system: str) -> Dict[str, Any]:
    counts = Counter(r[system] for r in rows)
    points = [1.0 if r[system] == RIGHT else -1.0 if r[system] == WRONG else 0.0 for r in rows]
    kinds = {}
    for kind in _kinds(rows):
        mine = [r for r in rows if r["kind"] == kind]
        right = [1.0 if r[system] == RIGHT else 0.0 for r in mine]
        kinds[kind] = {
            "questions": len(mine),
            **{o: sum(1 for r in mine if r[system] == o) for o in (RIGHT, WRONG, ABSTAINED)},
            "right_share": sum(right) / len(mine),
            "right_share_pm": half_width(right),
        }
    return {
        "questions": len(rows),
        **{o: counts.get(o, 0) for o in (RIGHT, WRONG, ABSTAINED)},
        "truthfulness": sum(points) / len(rows) if rows else None,
        "truthfulness_pm": half_width(points),
        "kinds": kinds,
    }


def summarize(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Per system (CRAG, plain with its top passage quoted): right, wrong, abstained, truthfulness and its 95%
    interval, and the same per kind; and plain retrieval's answer-in-top-k recall over the answerable kinds."""
    answerable = [r for r in rows if r["answerable"]]
    recall = {
        kind: sum(1 for r in answerable if r["kind"] == kind and r["in_plain_top_k"]) for kind in _kinds(answerable)
    }
    return {
        CRAG: _figures(rows, CRAG),
        PLAIN_TOP: _figures(rows, PLAIN_TOP),
        "answer_in_plain_top_k": {
            "answerable": len(answerable),
            "found": sum(1 for r in answerable if r["in_plain_top_k"]),
            "by_kind": recall,
        },
        "source_in_plain_top_k": sum(1 for r in answerable if r["source_in_plain_top_k"]),
    }


def _pct(value: Optional[float], pm: Optional[float] = None) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.1f}%" + ("" if pm is None else f" ±{100 * pm:.1f}")


def render(results: Dict[str, Any]) -> str:
    """The report: how it was run, the ingest's cost, and the figures table."""
    meta, figures = results["meta"], results["figures"]
    lines = [
        "# Raw-document evaluation",
        "",
        f"`{meta['command']}` ({meta['date']})",
        "",
        f"- {meta['documents']} documents ({meta['split']}), {meta['chunks']} chunks "
        f"(median {meta['passage_chars'].get('median', 0):.0f} characters, longest "
        f"{meta['passage_chars'].get('max', 0):.0f}); chunker: {json.dumps(meta['chunker'])}",
        f"- ingest: {meta['ingest_s']} s, {meta['embeddings_made']} passages embedded"
        + (" (an existing index folder, updated)" if meta["index_reused"] else "")
        + f"; peak memory {meta['peak_memory_mb']['after_ingest']} MB after ingest, "
        f"{meta['peak_memory_mb']['end']} MB at the end",
        f"- {meta['questions']} questions; plain: the vector retriever's top {meta['top_k']}, no grading, its "
        "first passage quoted as the answer (it never abstains)",
        "",
    ]
    lines += table(figures)
    return "\n".join(lines) + "\n"


def table(figures: Dict[str, Any]) -> List[str]:
    """The figures as a Markdown table: per kind right / wrong / abstained, and truthfulness with its interval."""
    crag, plain = figures[CRAG], figures[PLAIN_TOP]
    lines = [
        "| questions | CRAG right / wrong / abstained | plain (top passage) right / wrong |",
        "|---|---|---|",
    ]
    for kind, mine in crag["kinds"].items():
        theirs = plain["kinds"][kind]
        lines.append(
            f"| {kind} ({mine['questions']}) | {mine[RIGHT]} / {mine[WRONG]} / {mine[ABSTAINED]} | "
            f"{theirs[RIGHT]} / {theirs[WRONG]} |"
        )
    lines.append(
        f"| all ({crag['questions']}) | {crag[RIGHT]} / {crag[WRONG]} / {crag[ABSTAINED]} | "
        f"{plain[RIGHT]} / {plain[WRONG]} |"
    )
    lines.append(
        f"| truthfulness, right - wrong | {_pct(crag['truthfulness'], crag['truthfulness_pm'])} | "
        f"{_pct(plain['truthfulness'], plain['truthfulness_pm'])} |"
    )
    recall = figures["answer_in_plain_top_k"]
    by_kind = ", ".join(f"{k} {v}" for k, v in recall["by_kind"].items())
    lines += [
        "",
        f"Answer in plain top-k: {recall['found']} of {recall['answerable']} answerable questions ({by_kind}). "
        "± is half a 95% interval over the questions.",
    ]
    return lines


def describe_results(results: Dict[str, Any]) -> str:
    """A few lines for the terminal."""
    meta = results["meta"]
    return "\n".join(
        [
            f"Ingest: {meta['documents']} documents, {meta['chunks']} chunks, {meta['ingest_s']} s, "
            f"{meta['embeddings_made']} passages embedded, peak memory {meta['peak_memory_mb']['end']} MB.",
            *table(results["figures"]),
        ]
    )
