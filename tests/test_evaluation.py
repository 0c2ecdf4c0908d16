"""The evaluation harness: end to end on a tiny dataset, resuming, the out-of-corpus view, the LLM-judge baseline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
from llama_index.core.base.response.schema import Response
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.llms import LLM, MockLLM
from llama_index.core.response_synthesizers import get_response_synthesizer
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from llama_index_crag import FallbackRetriever
from llama_index_crag.cli import main
from llama_index_crag.core.settings import MAX_TIMEOUT_S
from llama_index_crag.datasets import Halves, Question, half_of, load_documents, load_questions
from llama_index_crag.errors import DatasetError
from llama_index_crag.evaluation.corpus import EvalCorpus
from llama_index_crag.evaluation.dataset import EvalQuestion, load_eval_questions
from llama_index_crag.evaluation.generator import SKIPPED_ANSWER, MeteredLLM
from llama_index_crag.evaluation.harness import EvalConfig, run_evaluation
from llama_index_crag.evaluation.llm_judge import LLMJudgeQueryEngine
from llama_index_crag.evaluation.metrics import (
    ANSWERABLE,
    OUT_OF_CORPUS,
    UNANSWERABLE,
    apply_policy,
    make_row,
    summarize,
    truthfulness,
)
from llama_index_crag.evaluation.report import PLOTS
from llama_index_crag.evaluation.systems import SYSTEMS
from llama_index_crag.scorers.registry import from_spec

from .conftest import ALPHA, BETA, CORPUS, FixedRetriever, ScriptedLLM

DOCS = {
    "alpha": "The alpha project budget for 2024 is 3.2 million euros. It was approved in March by the board.",
    "beta": "Lunch at the Beta cafeteria is served from noon until two in the afternoon. The menu changes weekly.",
    "gamma": "The gamma office is in Porto. It opened in 2019 with twelve staff members and a view of the river.",
    "delta": "The delta team maintains the billing service and the invoicing database of the company.",
    "epsilon": "Harbor Analytics was founded in 2012 in Lisbon. Its chief executive officer is Miriam Okafor.",
}
QUESTIONS = [
    {"qid": "q1", "question": "What is the alpha project budget for 2024?", "answers": ["3.2 million euros"],
     "answerable": True, "relevant_doc_ids": ["alpha"]},
    {"qid": "q2", "question": "In which city is the gamma office?", "answers": ["Porto"], "answerable": True,
     "relevant_doc_ids": ["gamma"]},
    {"qid": "q3", "question": "Who signed the lease of the gamma office?", "answers": [], "answerable": False,
     "relevant_doc_ids": ["gamma"]},
    {"qid": "q4", "question": "What is the boiling point of mercury?", "answers": [], "answerable": False,
     "relevant_doc_ids": []},
]  # fmt: skip


class JudgingLLM(ScriptedLLM):
    """The scripted LLM, also judging chunks and rewriting in free text.

    A chunk is judged relevant when it mentions ``topic``; with no topic the judge
    replies in prose instead of JSON.
    """

    topic: Optional[str] = "alpha"

    def _text(self, prompt: str) -> str:
        if "You are a grader" in prompt:
            document = prompt.split("Retrieved document:")[1].split("User question:")[0]
            self.calls["judge"] = self.calls.get("judge", 0) + 1
            if self.topic is None:
                return "Sure, this one looks relevant."
            return '{"binary_score": "%s"}' % ("yes" if self.topic in document.lower() else "no")
        if "refine a query" in prompt:
            self.calls["refine"] = self.calls.get("refine", 0) + 1
            return "alpha project budget"
        return super()._text(prompt)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: on a small, busy machine two threads wait on each other for most of each embedding."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"doc_id": d, "text": t}) + "\n" for d, t in DOCS.items()))
    (folder / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return folder


def words(text: str) -> int:
    return len(text.split())


@pytest.fixture(scope="module")
def evaluated(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Tuple[List[str], Path]:
    """``llama-crag eval`` run once over the tiny dataset, every system, the scripted LLM as generator."""
    folder = tmp_path_factory.mktemp("eval")
    argv = ["eval", "--dataset", str(dataset), "--out", str(folder / "out"), "--cache-dir", str(folder / "cache")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("llama_index_crag.local.models.default_llm", lambda *args: (JudgingLLM(), "scripted"))
        assert main([*argv, "--no-progress"]) == 0
    return argv, folder / "out"


def test_eval_command_writes_the_report_the_json_and_the_plots(
    evaluated: Tuple[List[str], Path], dataset: Path
) -> None:
    _, out = evaluated
    assert {"report.md", "results.json", "rows.jsonl", *PLOTS} <= {p.name for p in out.iterdir()}
    assert all((out / p).read_bytes().startswith(b"\x89PNG") for p in PLOTS)
    results = json.loads((out / "results.json").read_text())
    figures = results["figures"]
    assert list(figures) == list(SYSTEMS)
    assert len(results["rows"]) == len(SYSTEMS) * 6  # 4 questions as labelled, 2 answerable ones out of corpus
    for system, f in figures.items():
        assert f["queries"] == {"answerable": 2, "unanswerable": 2, "out_of_corpus": 2}, system
        rates = [f[k] for k in ("abstain_out_of_corpus", "abstain_unanswerable", "false_abstention", "accuracy")]
        assert all(0.0 <= r <= 1.0 for r in rates), system
        assert abs(sum(f["actions"].values()) - 1.0) < 1e-6
        assert f["latency_ms"]["total"]["p50"] > 0 and f["latency_ms"]["retrieve"]["n"] == 6
    assert figures["plain"]["answer_in_context"] == 1.0 and figures["plain"]["abstain_out_of_corpus"] == 0.0
    # Every answerable row says whether its document was retrieved (plain's context held it each time), and the
    # false abstentions with it retrieved are a part of the false abstentions.
    answerable = [r for r in results["rows"] if r["kind"] == "answerable"]
    assert all(r["gold_retrieved"] is not None for r in answerable if r["system"] != "llm-judge")
    assert all(r["gold_retrieved"] for r in answerable if r["system"] == "plain")
    assert all(r["gold_retrieved"] is None for r in results["rows"] if r["kind"] != "answerable")
    assert 0.0 <= figures["crag"]["false_abstention_retrieved"] <= figures["crag"]["false_abstention"]
    assert figures["plain"]["input_tokens"] > figures["rerank"]["input_tokens"] > 0
    assert figures["crag"]["abstain_unanswerable"] >= 0.5, "CRAG abstains at least on the off-topic question"
    assert 4 <= figures["llm-judge"]["judge_calls"] <= 5, "one call per chunk: 5 documents, 4 with one hidden"
    assert f"llama-crag eval --dataset {dataset}" in (out / "report.md").read_text()
    assert "## Targets" in (out / "report.md").read_text()


def test_the_headline_figures_carry_half_their_95_percent_interval_over_their_own_questions(
    evaluated: Tuple[List[str], Path],
) -> None:
    _, out = evaluated
    results = json.loads((out / "results.json").read_text())
    rows = [r for r in results["rows"] if r["system"] == "crag"]

    def expected(values: List[float]) -> float:
        mean = sum(values) / len(values)
        return 1.96 * (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 / len(values) ** 0.5

    def abstained(kind: str) -> List[float]:
        return [float(r["abstained"]) for r in rows if r["kind"] == kind]

    points = [0.0 if r["abstained"] else 1.0 if r["correct"] else -1.0 for r in rows if r["correct"] is not None]
    intervals = results["figures"]["crag"]["intervals"]
    assert intervals["abstain_out_of_corpus"] == pytest.approx(expected(abstained("out_of_corpus")))
    assert intervals["abstain_unanswerable"] == pytest.approx(expected(abstained("unanswerable")))
    assert intervals["false_abstention"] == pytest.approx(expected(abstained("answerable")))
    assert intervals["truthfulness"] == pytest.approx(expected(points))
    report = (out / "report.md").read_text()
    truthful = next(line for line in report.splitlines() if line.startswith("| truthfulness"))
    assert f"±{100 * intervals['truthfulness']:.1f}" in truthful


def test_a_target_on_token_counts_shows_counts_even_when_quoting_needs_none() -> None:
    from llama_index_crag.evaluation.metrics import _relative

    cut = _relative("generator input tokens: relative cut", 900.5, 0.0, -0.37, None, lower=True, percent=False)
    assert cut.measured == "-100% (900 -> 0)" and cut.met
    share = _relative("context precision: relative gain", 0.18, 0.95, 0.52, (0.52, 0.79), lower=False)
    assert share.measured == "+428% (18% -> 95%)"


def test_the_same_command_again_reuses_the_saved_rows_and_asks_nothing(
    evaluated: Tuple[List[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv, out = evaluated
    before = json.loads((out / "results.json").read_text())
    again = JudgingLLM()
    monkeypatch.setattr("llama_index_crag.local.models.default_llm", lambda *args: (again, "scripted"))
    assert main([*argv, "--no-progress"]) == 0
    after = json.loads((out / "results.json").read_text())
    assert after["rows"] == before["rows"]
    assert again.calls == {"answer": 0, "rewrite": 0}
    # The systems' times are their queries', from the saved rows: the same as the first run's, not 0.0 s.
    assert after["meta"]["wall_s"] == before["meta"]["wall_s"] and min(after["meta"]["wall_s"].values()) > 0


def test_no_generate_measures_the_prompt_but_never_calls_the_generator(dataset: Path, tmp_path: Path) -> None:
    llm = JudgingLLM()
    config = EvalConfig(
        dataset=dataset, out=tmp_path / "out", systems=["plain"], generate=False, cache_dir=tmp_path, progress=False
    )
    results = run_evaluation(config, llm, count_tokens=words)
    assert llm.calls["answer"] == 0
    assert {r["answer"] for r in results["rows"]} == {SKIPPED_ANSWER}
    assert results["figures"]["plain"]["input_tokens"] > 20
    assert results["figures"]["plain"]["accuracy"] is None and results["figures"]["plain"]["wrong_answers"] is None


def test_out_of_corpus_view_hides_the_gold_documents_from_every_retriever(dataset: Path, tmp_path: Path) -> None:
    corpus = EvalCorpus.build(dataset, load_eval_questions(dataset), tmp_path, top_k=3)
    question = QueryBundle("What is the alpha project budget?")

    def doc_ids(retriever: Any) -> List[str]:
        return [n.node.metadata["doc_id"] for n in retriever.retrieve(question)]

    assert doc_ids(corpus.retriever(3))[0] == "alpha"
    with corpus.view.without(["alpha"]):
        hidden = doc_ids(corpus.retriever(3))
        fallback = doc_ids(corpus.fallback_retriever(3))
    assert "alpha" not in hidden and len(hidden) == 3
    assert fallback and "alpha" not in fallback
    assert "alpha" in doc_ids(corpus.retriever(3)), "the view is restored after the block"


def test_grading_through_the_view_reuses_the_index_embeddings(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llama_index_crag.scorers.bi_encoder import BiEncoderScorer, reuse_retrieval_embeddings

    corpus = EvalCorpus.build(dataset, load_eval_questions(dataset), tmp_path, top_k=3)
    retriever = corpus.retriever(3)
    question = QueryBundle("What is the alpha project budget?")
    hits = retriever.retrieve(question)
    scorer = BiEncoderScorer()
    assert reuse_retrieval_embeddings(scorer, retriever, question, hits) == len(hits) == 3
    calls: List[int] = []
    embed_type = type(scorer.embed_model)
    batch, query = embed_type.get_text_embedding_batch, embed_type.get_query_embedding
    monkeypatch.setattr(
        embed_type, "get_text_embedding_batch", lambda self, t, **kw: calls.append(len(t)) or batch(self, t, **kw)
    )
    monkeypatch.setattr(embed_type, "get_query_embedding", lambda self, t: calls.append(1) or query(self, t))
    scorer.score_texts(question.query_str, [h.node.get_content() for h in hits])
    assert calls == [], "the query and the candidates were embedded by retrieval already"


class CountingEmbedding(MockEmbedding):
    """Constant vectors; counts the passages it is asked to embed."""

    passages: int = 0

    def get_text_embedding_batch(self, texts: List[str], show_progress: bool = False, **kwargs: Any) -> List[Any]:
        self.passages += len(texts)
        return super().get_text_embedding_batch(texts, show_progress, **kwargs)


def test_corpus_and_sentence_window_embeddings_are_computed_once_then_read_from_disk(
    dataset: Path, tmp_path: Path
) -> None:
    questions = load_eval_questions(dataset)
    first, second = CountingEmbedding(embed_dim=8), CountingEmbedding(embed_dim=8)
    EvalCorpus.build(dataset, questions, tmp_path, top_k=3, embed_model=first)
    assert first.passages > len(DOCS), "the chunks and the fallback's sentence windows"
    corpus = EvalCorpus.build(dataset, questions, tmp_path, top_k=3, embed_model=second)
    assert second.passages == 0 and len(corpus.nodes) == len(DOCS)


def test_a_copy_of_a_dataset_under_another_name_reads_the_embeddings_of_the_original(
    dataset: Path, tmp_path: Path
) -> None:
    questions = load_eval_questions(dataset)
    EvalCorpus.build(dataset, questions, tmp_path, top_k=3, embed_model=CountingEmbedding(embed_dim=8))
    half = tmp_path / "half"  # as docs/grading.md splits a set in two: the same corpus, some of the questions
    half.mkdir()
    shutil.copy(dataset / "corpus.jsonl", half / "corpus.jsonl")
    (half / "questions.jsonl").write_text((dataset / "questions.jsonl").read_text().splitlines()[0] + "\n")
    copy = CountingEmbedding(embed_dim=8)
    EvalCorpus.build(half, load_eval_questions(half), tmp_path, top_k=3, embed_model=copy)
    assert copy.passages == 0
    (half / "corpus.jsonl").write_text((dataset / "corpus.jsonl").read_text().replace("Porto", "Braga"))
    changed = CountingEmbedding(embed_dim=8)
    EvalCorpus.build(half, load_eval_questions(half), tmp_path, top_k=3, embed_model=changed)
    assert changed.passages > 0, "another corpus is embedded afresh"


def judge_engine(llm: LLM) -> LLMJudgeQueryEngine:
    return LLMJudgeQueryEngine(
        retriever=FixedRetriever([ALPHA, BETA]),
        llm=llm,
        fallback=FallbackRetriever.from_nodes(CORPUS, sources=("bm25",), similarity_top_k=2),
        response_synthesizer=get_response_synthesizer(llm=llm),
        abstain_text="I don't know",
    )


def test_llm_judge_sends_the_rewritten_query_to_the_fallback_when_any_chunk_is_judged_no() -> None:
    llm = JudgingLLM()
    response = judge_engine(llm).query("What is the alpha project budget?")
    trace = response.metadata["crag"]
    assert llm.calls["judge"] == 2 and trace["judge_calls"] == 2
    assert trace["action"] == "ambiguous" and [n["label"] for n in trace["nodes"]] == ["correct", "incorrect"]
    assert llm.calls["refine"] == 1 and trace["rewritten_query"] == "alpha project budget"
    assert response.source_nodes[0].node.node_id == "alpha" and len(response.source_nodes) == 3
    assert {"retrieve", "grade", "rewrite", "fallback", "generate"} <= set(trace["timings_ms"])


def test_llm_judge_generates_from_the_retrieval_when_every_chunk_is_judged_yes() -> None:
    llm = JudgingLLM(topic="the")
    trace = judge_engine(llm).query("What is the alpha project budget?").metadata["crag"]
    assert trace["action"] == "correct" and llm.calls.get("refine", 0) == 0 and not trace["abstained"]


def test_an_unparsable_judgement_counts_as_no() -> None:
    trace = judge_engine(JudgingLLM(topic=None)).query("What is the alpha project budget?").metadata["crag"]
    assert trace["judge_failures"] == 2 and trace["action"] == "incorrect"


def test_metered_llm_counts_each_prompt_and_skips_generation_when_asked() -> None:
    inner = ScriptedLLM()
    skipping = MeteredLLM(inner, words, generate=False)
    assert skipping.complete("one two three").text == SKIPPED_ANSWER
    assert skipping.take() == (3, 1) and skipping.take() == (0, 0)
    assert inner.calls["answer"] == 0
    generating = MeteredLLM(inner, words)
    assert generating.complete("one two").text.startswith("ANSWER") and inner.calls["answer"] == 1
    assert generating.metadata.context_window == inner.metadata.context_window


def row(system: str, qid: str, kind: str, abstained: bool, in_context: Any, **extra: Any) -> Dict[str, Any]:
    return {
        "system": system, "qid": qid, "kind": kind, "abstained": abstained, "answer_in_context": in_context,
        "action": "correct", "context_tokens": 0 if abstained else 10, "relevant_context_tokens": 0,
        "input_tokens": 0 if abstained else 100, "judge_calls": 0, "correct": None,
        "timings_ms": {"retrieve": 1.0, "total": 2.0}, **extra,
    }  # fmt: skip


def test_false_abstention_counts_only_questions_plain_rag_had_in_context() -> None:
    rows = [
        row("plain", "a", "answerable", False, True),
        row("plain", "b", "answerable", False, False),
        row("crag", "a", "answerable", False, True),
        row("crag", "b", "answerable", True, False),
        row("crag", "a", "out_of_corpus", True, None),
    ]
    crag = summarize(rows, ["plain", "crag"])["crag"]
    assert crag["false_abstention"] == 0.5
    assert crag["false_abstention_plain_in_context"] == 0.0
    assert crag["abstain_out_of_corpus"] == 1.0
    assert crag["unsupported_answers"] == 0.0 and crag["input_tokens"] == pytest.approx(100 / 3)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_eval_with_the_bundled_generator_measures_answer_accuracy(dataset: Path, tmp_path: Path) -> None:
    from llama_index_crag.local.llamacpp import BundledLlamaCPP

    config = EvalConfig(dataset=dataset, out=tmp_path / "out", limit=1, cache_dir=tmp_path, progress=False)
    results = run_evaluation(config, BundledLlamaCPP())
    for system, f in results["figures"].items():
        assert 0.0 <= f["accuracy"] <= 1.0, system
        if system != "crag":
            assert f["latency_ms"]["generate"]["p50"] > 0, system
    # With the bundled model, CRAG quotes (the engine's offline default) and never asks it for an answer.
    assert results["meta"]["answer_step"]["answer_mode"] == "extract"
    assert "generate" not in results["figures"]["crag"]["latency_ms"]
    assert 4 <= results["figures"]["llm-judge"]["judge_calls"] <= 5, "one call per chunk, one fewer if gold is hidden"


# The readers (packaged, reader:DIR) are checked in tests/test_packaged_grader.py and tests/test_reader.py.
@pytest.mark.parametrize("name", ["default", "evidence", "bi-encoder"])
def test_every_offline_scorer_spec_builds_from_the_corpus_and_scores_in_unit_range(name: str) -> None:
    scorer = from_spec(name, corpus=list(DOCS.values()))
    scores = scorer.score_texts("In which city is the gamma office?", [DOCS["gamma"], DOCS["beta"]])
    assert all(0.0 <= s <= 1.0 for s in scores) and scores[0] > scores[1]


def test_a_row_left_half_written_by_a_killed_run_is_asked_again(dataset: Path, tmp_path: Path) -> None:
    config = EvalConfig(dataset=dataset, out=tmp_path / "out", systems=["plain"], cache_dir=tmp_path, progress=False)
    first = run_evaluation(config, JudgingLLM(), count_tokens=words)
    rows_file = tmp_path / "out" / "rows.jsonl"
    lines = rows_file.read_text().splitlines()
    rows_file.write_text("\n".join(lines[:-1] + [lines[-1][:40]]) + "\n")
    again = JudgingLLM()
    second = run_evaluation(config, again, count_tokens=words)
    assert again.calls["answer"] == 2, "the warm-up query, then the one row that was lost"
    assert [(r["kind"], r["qid"]) for r in second["rows"]] == [(r["kind"], r["qid"]) for r in first["rows"]]


def test_rows_graded_with_other_shipped_weights_are_not_reused(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llama_index_crag.scorers.evidence import EvidenceScorer

    config = EvalConfig(dataset=dataset, out=tmp_path / "out", systems=["crag"], cache_dir=tmp_path, progress=False)
    run_evaluation(config, JudgingLLM(), count_tokens=words)
    same = JudgingLLM()
    run_evaluation(config, same, count_tokens=words)
    assert same.calls["answer"] == 0
    # A library upgrade that refits the default grader makes the saved CRAG rows stale.
    monkeypatch.setattr(EvidenceScorer, "DEFAULT_THRESHOLDS", {**EvidenceScorer.DEFAULT_THRESHOLDS, "lower": 0.5})
    upgraded = JudgingLLM()
    run_evaluation(config, upgraded, count_tokens=words)
    assert upgraded.calls["answer"] > 0


def test_truthfulness_rewards_abstaining_over_guessing() -> None:
    def row(kind: str, abstained: bool, correct: Optional[bool]) -> Dict[str, Any]:
        return {"kind": kind, "abstained": abstained, "correct": correct}

    assert truthfulness(row(ANSWERABLE, False, True)) == 1
    assert truthfulness(row(ANSWERABLE, False, False)) == -1
    assert truthfulness(row(ANSWERABLE, True, False)) == 0
    # Where the corpus has no answer, abstaining scores 0 and any answer is wrong.
    assert truthfulness(row(OUT_OF_CORPUS, True, True)) == 0
    assert truthfulness(row(UNANSWERABLE, False, False)) == -1
    assert truthfulness(row(OUT_OF_CORPUS, False, False)) == -1
    # ... unless another passage held it after all, and the answer found it.
    assert truthfulness(row(OUT_OF_CORPUS, False, True)) == 1
    assert truthfulness(row(ANSWERABLE, False, None)) is None


def test_a_false_abstention_says_whether_the_questions_document_was_retrieved() -> None:
    question = EvalQuestion(
        Question("q1", "Why does unemployment harm growth?", answers=["waste"], relevant_doc_ids=["d1"]), ("waste",)
    )
    unanswerable = EvalQuestion(Question("q2", "Why does unemployment harm trade?", answerable=False), ())

    def row(listed: List[Tuple[str, str]], kind: str = ANSWERABLE, context: Tuple[str, ...] = ()) -> Dict[str, Any]:
        nodes = [{"doc_id": d, "source": source} for d, source in listed]
        trace = {"abstained": not context, "action": "incorrect", "nodes": nodes, "timings_ms": {}}
        sources = [NodeWithScore(node=TextNode(text="waste", metadata={"doc_id": d}), score=1.0) for d in context]
        response = Response("waste" if context else "I don't know.", source_nodes=sources, metadata={"crag": trace})
        asked = unanswerable if kind == UNANSWERABLE else question
        return make_row("crag", kind, asked, response, 1.0, (0, 0), False, words)

    # Among the first candidates: the grade (or the quote step) turned it down. Only in the fallback's: retrieval.
    graded_down = row([("d2", "retriever"), ("d1", "retriever")])
    missed = row([("d2", "retriever"), ("d1", "bm25")])
    assert graded_down["gold_retrieved"] is True and missed["gold_retrieved"] is False
    # A system whose trace lists no candidates is read by its context; a question with no document of its own,
    # or an abstention with nothing listed, says nothing.
    assert row([], context=("d1",))["gold_retrieved"] is True
    assert row([("d1", "retriever")], kind=UNANSWERABLE)["gold_retrieved"] is None
    assert row([])["gold_retrieved"] is None
    figures = summarize([graded_down, missed, row([], context=("d1",)), row([])], ["crag"])["crag"]
    assert figures["false_abstention"] == 0.75 and figures["false_abstention_retrieved"] == pytest.approx(1 / 3)


def test_an_out_of_corpus_question_answered_from_another_passage_that_holds_its_answer_is_right() -> None:
    # SQuAD repeats facts across an article's paragraphs: hiding the question's own passage left this one.
    quote = "Unemployment can harm growth not only because it is a waste of resources, but also ..."
    question = EvalQuestion(
        Question("q1", "Why does unemployment harm growth?", answers=["waste of resources"], relevant_doc_ids=["d1"]),
        ("waste of resources",),
    )
    unanswerable = EvalQuestion(Question("q2", "Why does unemployment harm trade?", answerable=False), ())

    def row(kind: str, answer: str, question: EvalQuestion = question, abstained: bool = False) -> Dict[str, Any]:
        trace = {"abstained": abstained, "action": "correct", "answered_by": "extract", "answer_mode": "extract",
                 "quotes": [{"text": answer}], "timings_ms": {}}  # fmt: skip
        node = NodeWithScore(node=TextNode(text=answer, metadata={"doc_id": "d2"}), score=1.0)
        response = Response(answer, source_nodes=[node], metadata={"crag": trace})
        return make_row("crag", kind, question, response, 1.0, (0, 0), False, words)

    right = row(OUT_OF_CORPUS, quote)
    assert right["correct"] is True and truthfulness(right) == 1 and right["answer_in_context"] is True
    wrong = row(OUT_OF_CORPUS, "High and persistent unemployment has a negative effect on long-run growth.")
    assert wrong["correct"] is False and truthfulness(wrong) == -1 and wrong["answer_in_context"] is False
    assert row(OUT_OF_CORPUS, "", abstained=True)["correct"] is True
    # An unanswerable question has no answer to find: the same quote is wrong there.
    assert row(UNANSWERABLE, quote, question=unanswerable)["correct"] is False
    figures = summarize([right, wrong], ["crag"])["crag"]
    assert figures["answered_right_out_of_corpus"] == 0.5 and figures["truthfulness"] == 0.0
    assert figures["unsupported_answers"] == 0.5


def test_a_quoted_answer_to_a_claim_is_right_only_when_it_quotes_its_rationale() -> None:
    rationale = "RESULTS Serum homocysteine fell by 25% with 0.8 mg of folic acid per day."
    claim = EvalQuestion(Question("c1", "Folic acid lowers homocysteine.", relevant_doc_ids=["d1"]), (rationale,))

    def scored(*quotes: str, answered_by: str = "extract", question: EvalQuestion = claim) -> Optional[bool]:
        trace = {"abstained": False, "action": "correct", "answered_by": answered_by, "answer_mode": "extract",
                 "quotes": [{"text": q} for q in quotes], "timings_ms": {}}  # fmt: skip
        response = Response("\n".join(quotes), source_nodes=[], metadata={"crag": trace})
        return make_row("crag", ANSWERABLE, question, response, 1.0, (0, 0), False, words)["correct"]

    assert scored("Fasting blood samples were taken after 3 months.", rationale) is True
    assert scored("Serum homocysteine fell by 25% with 0.8 mg") is True  # a part of the sentence, five words or more
    assert scored("Fasting blood samples for serum homocysteine were taken after 3 months.") is False
    assert scored("Serum homocysteine fell") is False  # too short to say which sentence it quotes
    assert scored(rationale, answered_by="generate") is None  # a generated answer to a claim is not scored
    squad = EvalQuestion(Question("q1", "How much did it fall?", answers=["25%"]), ("25%",))
    assert scored(rationale, question=squad) is True  # a set with short answers is scored by them


class InventingLLM(JudgingLLM):
    """Judges and rewrites as the scripted LLM does, but answers with figures no passage holds."""

    def _text(self, prompt: str) -> str:
        text = super()._text(prompt)
        return "It was 7,700,000 dollars, decided in 1987 by Oskar Brandt." if text.startswith("ANSWER:") else text


def crag_only(dataset: Path, out: Path, **answer_step: Any) -> EvalConfig:
    """An evaluation of CRAG alone over the tiny dataset, with the answer step given."""
    return EvalConfig(dataset=dataset, out=out, systems=["crag"], cache_dir=out.parent, progress=False, **answer_step)


def test_eval_lifts_the_correction_time_limits_unless_told_or_set(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CRAG_CORRECTION_TIMEOUT_S", raising=False)
    monkeypatch.delenv("CRAG_REWRITE_TIMEOUT_S", raising=False)
    lifted = run_evaluation(crag_only(dataset, tmp_path / "lifted"), JudgingLLM(), count_tokens=words)
    assert lifted["meta"]["time_limits"] == {"correction_timeout_s": MAX_TIMEOUT_S, "rewrite_timeout_s": MAX_TIMEOUT_S}
    assert "time limits on the correction path lifted" in (tmp_path / "lifted" / "report.md").read_text()
    assert "--time-limits" not in lifted["meta"]["command"]
    kept = run_evaluation(crag_only(dataset, tmp_path / "kept", time_limits=True), JudgingLLM(), count_tokens=words)
    assert kept["meta"]["time_limits"] == {"correction_timeout_s": 30.0, "rewrite_timeout_s": None}
    assert "--time-limits" in kept["meta"]["command"]
    assert "correction 30.0 s, each rewrite 15.0 s" in (tmp_path / "kept" / "report.md").read_text()
    # A limit the user set is kept; rows run under other limits are not reused.
    monkeypatch.setenv("CRAG_REWRITE_TIMEOUT_S", "2")
    config = crag_only(dataset, tmp_path / "lifted")
    assert config.lifted_limits() == {"correction_timeout_s": MAX_TIMEOUT_S}
    again = JudgingLLM()
    chosen = run_evaluation(config, again, count_tokens=words)
    assert chosen["meta"]["time_limits"] == {"correction_timeout_s": MAX_TIMEOUT_S, "rewrite_timeout_s": 2.0}
    assert again.calls["answer"] > 0


@pytest.mark.parametrize(("policy", "outcome"), [("flag", "flagged"), ("extract", "extract"), ("abstain", "abstain")])
def test_eval_runs_crag_with_the_answer_check_policy_it_is_given(
    dataset: Path, tmp_path: Path, policy: str, outcome: str
) -> None:
    config = crag_only(dataset, tmp_path / "out", answer_mode="generate", on_ungrounded=policy)
    results = run_evaluation(config, InventingLLM(), count_tokens=words)
    checked = [r for r in results["rows"] if r["check_outcome"] is not None]
    assert checked, "CRAG generated at least one answer, and it was checked"
    assert all(r["grounded"] is False and r["check_outcome"] == outcome for r in checked)
    answered = [r for r in checked if not r["abstained"]]
    if outcome == "flagged":
        assert answered == checked and all("7,700,000" in r["answer"] for r in answered)
        assert results["figures"]["crag"]["flagged_answers"] > 0
    elif outcome == "abstain":
        assert not answered
    else:  # replaced by the quotes, or an abstention where nothing could be quoted
        assert answered and all(r["answered_by"] == "extract" and "7,700,000" not in r["answer"] for r in answered)
    assert results["meta"]["answer_step"] == {"answer_mode": "generate", "check_answers": True, "on_ungrounded": policy}
    assert f"--on-ungrounded {policy}" in results["meta"]["command"]
    assert f"an ungrounded one becomes `{policy}`" in (tmp_path / "out" / "report.md").read_text()


def test_eval_with_extract_never_asks_the_generator_for_crag_and_unchecked_keeps_the_answer(
    dataset: Path, tmp_path: Path
) -> None:
    quoting = InventingLLM()
    config = crag_only(dataset, tmp_path / "q", answer_mode="extract")
    rows = run_evaluation(config, quoting, count_tokens=words)["rows"]
    assert quoting.calls["answer"] == 0
    assert {r["answered_by"] for r in rows if not r["abstained"]} == {"extract"}
    # Every quoted answer was graded as a whole, and only an abstention can have had its quotes withheld.
    assert all(r["quote_grade"] is not None and not r["quotes_withheld"] for r in rows if not r["abstained"])
    assert all(r["quote_grade"] is not None for r in rows if r["quotes_withheld"])
    unchecked = crag_only(dataset, tmp_path / "u", answer_mode="generate", check_answers=False)
    assert unchecked.fingerprint() != config.fingerprint()
    rows = run_evaluation(unchecked, InventingLLM(), count_tokens=words)["rows"]
    answered = [r for r in rows if not r["abstained"]]
    assert answered and all("7,700,000" in r["answer"] and r["check_outcome"] is None for r in answered)


def test_rows_graded_under_other_crag_settings_in_the_environment_are_not_reused(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = crag_only(dataset, tmp_path / "q", answer_mode="extract")
    monkeypatch.delenv("CRAG_LOWER", raising=False)
    monkeypatch.delenv("CRAG_UPPER", raising=False)
    first = run_evaluation(config, InventingLLM(), count_tokens=words)["rows"]
    assert any(r["action"] == "correct" for r in first)
    before = config.fingerprint()
    # Every batch under 0.99 is INCORRECT now: rows graded at the defaults must not be reported under these.
    monkeypatch.setenv("CRAG_LOWER", "0.99")
    monkeypatch.setenv("CRAG_UPPER", "0.995")
    monkeypatch.setenv("CRAG_API_KEY", "s3cret")
    assert config.fingerprint() != before and "s3cret" not in json.dumps(config.fingerprint())
    again = run_evaluation(config, InventingLLM(), count_tokens=words)["rows"]
    assert {r["action"] for r in again} != {r["action"] for r in first}
    assert "s3cret" not in (tmp_path / "q" / "run.json").read_text()


def test_eval_answers_as_the_engine_would_for_its_generator_and_checks_no_skipped_answer(
    dataset: Path, tmp_path: Path
) -> None:
    # Unset, the answer mode is the engine's for the generator given, not for the meter in front of it.
    results = run_evaluation(crag_only(dataset, tmp_path / "d"), MockLLM(), count_tokens=words)
    assert results["meta"]["answer_step"]["answer_mode"] == "extract"
    assert {r["answered_by"] for r in results["rows"] if not r["abstained"]} == {"extract"}
    assert "--answer-mode" not in results["meta"]["command"]
    # With generation skipped, the fixed text is answered unchecked, so the run measures the grading alone.
    skipped = crag_only(dataset, tmp_path / "s", answer_mode="generate", generate=False)
    results = run_evaluation(skipped, InventingLLM(), count_tokens=words)
    answered = [r for r in results["rows"] if not r["abstained"]]
    assert answered and all(r["answer"] == SKIPPED_ANSWER and r["check_outcome"] is None for r in answered)
    assert results["meta"]["answer_step"]["check_answers"] is False
    assert "with generation skipped they are not checked" in (tmp_path / "s" / "report.md").read_text()
    assert all(r["correct"] is None for r in answered), "a skipped generation's answer cannot be scored"
    # Quotes need no generator: skipping generation still scores every quoted answer and abstention.
    quoted = crag_only(dataset, tmp_path / "q", answer_mode="extract", generate=False)
    results = run_evaluation(quoted, InventingLLM(), count_tokens=words)
    assert all(r["correct"] is not None for r in results["rows"])
    assert results["figures"]["crag"]["accuracy"] is not None


def test_a_policy_applied_to_a_flag_run_changes_only_the_flagged_answers() -> None:
    def row(kind: str, outcome: Optional[str], answer: str, correct: bool, abstained: bool = False) -> Dict[str, Any]:
        return {"kind": kind, "check_outcome": outcome, "answer": answer, "correct": correct, "abstained": abstained}

    flagged = {
        (ANSWERABLE, "a"): row(ANSWERABLE, "kept", "Porto", True),
        (ANSWERABLE, "b"): row(ANSWERABLE, "flagged", "7,700,000 dollars", False),
        (UNANSWERABLE, "c"): row(UNANSWERABLE, "flagged", "made up", False),
        (OUT_OF_CORPUS, "d"): row(OUT_OF_CORPUS, None, "", True, abstained=True),
    }
    quoted = {
        (ANSWERABLE, "b"): row(ANSWERABLE, None, '"3.2 million euros"', True),
        (UNANSWERABLE, "c"): row(UNANSWERABLE, None, "", True, abstained=True),
    }
    assert apply_policy(flagged, quoted, "flag") == list(flagged.values())
    abstained = apply_policy(flagged, quoted, "abstain")
    assert [(r["abstained"], r["correct"]) for r in abstained] == [
        (False, True),
        (True, False),
        (True, True),
        (True, True),
    ]
    extracted = apply_policy(flagged, quoted, "extract")
    assert [r["answer"] for r in extracted] == ["Porto", '"3.2 million euros"', "", ""]
    assert [truthfulness(r) for r in extracted] == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="unknown policy"):
        apply_policy(flagged, quoted, "ignore")


# --- design and check halves -------------------------------------------------------------------------------------


def test_the_halves_cut_by_document_keep_a_question_with_its_documents_and_cover_the_set(dataset: Path) -> None:
    halves = {split: (load_documents(dataset, split), load_questions(dataset, split)) for split in ("design", "check")}
    documents = [d.doc_id for docs, _ in halves.values() for d in docs]
    assert sorted(documents) == sorted(DOCS) and len(set(documents)) == len(DOCS)
    assert sorted(q.qid for _, qs in halves.values() for q in qs) == [q["qid"] for q in QUESTIONS]
    for docs, questions in halves.values():
        ids = {d.doc_id for d in docs}
        assert all(set(q.relevant_doc_ids) <= ids for q in questions)
    # The cut is a hash: the same in every run and on every machine.
    assert [half_of(d) for d in sorted(DOCS)] == [half_of(d) for d in sorted(DOCS)]
    assert load_documents(dataset, "all") == load_documents(dataset)


def test_documents_one_question_names_together_fall_in_one_half() -> None:
    questions = [
        Question("q1", "a?", relevant_doc_ids=["d1", "d2"]),
        Question("q2", "b?", relevant_doc_ids=["d2", "d3"]),
        Question("q3", "c?", relevant_doc_ids=["d9"]),
    ]
    halves = Halves.of_questions(questions, "check")
    assert len({halves.half_of_document(d) for d in ("d1", "d2", "d3")}) == 1
    assert halves.half_of_document("d1") == half_of("d1")  # the group falls by its smallest id
    assert [halves.keeps_question(q) for q in questions[:2]] == [halves.keeps_document("d3")] * 2
    with pytest.raises(DatasetError, match="unknown split 'test'"):
        Halves.of_questions(questions, "test")


def test_eval_on_a_half_indexes_and_asks_only_that_half(dataset: Path, tmp_path: Path) -> None:
    config = EvalConfig(
        dataset=dataset, out=tmp_path / "out", systems=["crag"], split="design", generate=False, progress=False,
        cache_dir=tmp_path / "cache",
    )  # fmt: skip
    results = run_evaluation(config, ScriptedLLM())
    asked = {r["qid"] for r in results["rows"]}
    assert {"q1", "q2", "q3"} <= asked and len(load_documents(dataset, "design")) < len(DOCS)
    assert asked == {q.qid for q in load_questions(dataset, "design")}
    assert results["meta"]["dataset"]["documents"] == len(load_documents(dataset, "design"))
    assert results["meta"]["dataset"]["split"] == "design" and "--split design" in results["meta"]["command"]
    indexed = {d for r in results["rows"] for d in r["context_doc_ids"]}
    assert indexed <= {d.doc_id for d in load_documents(dataset, "design")}
