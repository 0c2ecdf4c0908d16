"""The offline scorers, threshold calibration and the grade report."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, List

import numpy as np
import pytest
from llama_index.core.prompts import PromptTemplate

from llama_index_crag.calibration.fit import (
    fit_strip_threshold,
    labelled_batches,
    labelled_strips,
    strip_outcome,
)
from llama_index_crag.calibration.thresholds import fit_thresholds
from llama_index_crag.cli import main
from llama_index_crag.datasets import SAMPLE_DIR, load_documents, normalise_text, words_in
from llama_index_crag.errors import ConfigError
from llama_index_crag.scorers import EvidenceScorer, LLMJudgeScorer
from llama_index_crag.scorers.evidence import FEATURES
from llama_index_crag.scorers.llm_judge import JUDGE_PROMPT
from llama_index_crag.text.split import terms

from .conftest import ALPHA, BETA, GAMMA, ScriptedLLM, assert_engine_loads_calibration, make_engine


def test_thresholds_meet_their_targets_on_the_rows_they_were_fitted_on() -> None:
    rng = np.random.default_rng(0)
    scores = np.concatenate([rng.uniform(0.5, 1.0, 200), rng.uniform(0.0, 0.6, 200)])
    kinds = ["in-corpus"] * 200 + ["out-of-corpus"] * 200
    truth = np.array([True] * 200 + [False] * 200)
    fitted = fit_thresholds(scores, kinds, target_precision=0.95, target_recall=0.9)
    assert fitted["precision_correct"] >= 0.95 and fitted["recall_incorrect"] >= 0.9
    assert fitted["lower"] <= fitted["upper"]
    assert ((scores >= fitted["upper"]) & ~truth).sum() <= 0.05 * (scores >= fitted["upper"]).sum()


def test_a_false_reject_cap_holds_lower_down_where_the_recall_target_would_raise_it() -> None:
    rng = np.random.default_rng(1)
    answered = rng.uniform(0.3, 1.0, 100)  # overlaps the out-of-corpus scores: the two targets disagree
    scores = np.concatenate([answered, rng.uniform(0.0, 0.6, 100)])
    kinds = ["in-corpus"] * 100 + ["out-of-corpus"] * 100
    free = fit_thresholds(scores, kinds, target_recall=0.95)
    assert free["false_reject"] > 0.05  # the recall target alone rejects more than the cap allows
    for cap in (0.0, 0.03, 0.05):
        capped = fit_thresholds(scores, kinds, target_recall=0.95, max_false_reject=cap)
        assert (answered < capped["lower"]).mean() <= cap
        assert capped["false_reject"] == pytest.approx((answered < capped["lower"]).mean())
        assert capped["lower"] < free["lower"] and capped["recall_incorrect"] < free["recall_incorrect"]
    # Where the recall target already rejects less than the cap, the cap changes nothing.
    assert fit_thresholds(scores, kinds, target_recall=0.5, max_false_reject=0.5)["lower"] == pytest.approx(
        fit_thresholds(scores, kinds, target_recall=0.5)["lower"]
    )
    with pytest.raises(ValueError, match="max_false_reject"):
        fit_thresholds(scores, kinds, max_false_reject=1.0)


def test_a_weighted_batch_counts_as_that_many_copies_of_it() -> None:
    rng = np.random.default_rng(2)
    scores = np.round(np.concatenate([rng.uniform(0.3, 1.0, 60), rng.uniform(0.0, 0.7, 60)]), 3)
    kinds = np.array(["in-corpus"] * 60 + ["out-of-corpus"] * 30 + ["unanswerable"] * 30)
    copies = rng.integers(1, 4, len(scores))
    for targets in ({}, {"target_precision": 0.8, "target_recall": 0.7}, {"max_false_reject": 0.05}):
        weighted = fit_thresholds(scores, kinds, weights=copies, **targets)
        repeated = fit_thresholds(np.repeat(scores, copies), np.repeat(kinds, copies), **targets)
        assert weighted == pytest.approx(repeated)
    assert fit_thresholds(scores, kinds, weights=np.ones(len(scores))) == fit_thresholds(scores, kinds)
    for bad in (np.ones(3), -np.ones(len(scores)), np.full(len(scores), np.nan)):
        with pytest.raises(ConfigError, match="one positive number a batch"):
            fit_thresholds(scores, kinds, weights=bad)


def test_a_weighted_row_fits_the_scorer_as_that_many_copies_of_it() -> None:
    rng = np.random.default_rng(3)
    features = rng.normal(size=(80, len(FEATURES)))
    labels = features[:, 0] + rng.normal(scale=0.5, size=80) > 0
    copies = np.repeat([2, 0], 40)  # the first half twice, the second not at all: as many rows as unweighted
    weighted = EvidenceScorer().fit(features, labels, weights=copies)
    repeated = EvidenceScorer().fit(np.repeat(features, copies, axis=0), np.repeat(labels, copies))
    assert weighted.weights == pytest.approx(repeated.weights, abs=1e-3)
    assert weighted.rival_means == pytest.approx(repeated.rival_means)


def test_thresholds_need_both_classes() -> None:
    with pytest.raises(ValueError, match="both with and without"):
        fit_thresholds([0.1, 0.2], ["in-corpus", "in-corpus"])


def test_the_strip_threshold_separates_evidence_strips_and_passes_a_passage_with_none_whole() -> None:
    scores = [[0.9, 0.2, 0.3], [0.7, 0.1], [0.25, 0.6]]
    labels = [[True, False, False], [True, False], [False, True]]
    fitted = fit_strip_threshold(scores, labels)
    assert 0.3 < fitted["strip_threshold"] <= 0.6
    assert fitted["evidence_kept"] == 1.0 and fitted["other_dropped"] == 1.0
    # Above every strip of a passage, the refiner keeps the passage whole: nothing is dropped there.
    assert strip_outcome(scores, labels, 0.95) == {"evidence_kept": 1.0, "other_dropped": 0.0}
    with pytest.raises(ValueError, match="both evidence and other strips"):
        fit_strip_threshold([[0.5, 0.6]], [[True, True]])


def test_the_strip_threshold_is_fitted_as_the_refiner_keeps_strips_and_capped_at_lower() -> None:
    scores = [[0.95, 0.5], [0.9, 0.45], [0.3, 0.1], [0.28, 0.12], [0.6, 0.55]]
    labels = [[True, False], [True, False], [True, False], [True, False], [False, False]]
    # Counting strips one by one, 0.9 separates best (half the evidence kept, every other strip dropped). But the
    # refiner passes a passage whole when none of its strips clears the threshold, so at 0.9 the last three
    # passages are kept whole and only 2 of 6 other strips go; at 0.6, 3 of 6 go and all evidence stays.
    assert strip_outcome(scores, labels, 0.9) == {"evidence_kept": 1.0, "other_dropped": pytest.approx(2 / 6)}
    fitted = fit_strip_threshold(scores, labels)
    assert fitted["strip_threshold"] == 0.6
    assert fitted["evidence_kept"] == 1.0 and fitted["other_dropped"] == pytest.approx(3 / 6)
    # A cap (the passage threshold lower) bounds it; the best threshold under the cap is chosen.
    capped = fit_strip_threshold([[0.9, 0.1], [0.8, 0.7]], [[True, False], [True, False]], at_most=0.6)
    assert capped["strip_threshold"] <= 0.6 and capped["other_dropped"] == 0.5
    assert fit_strip_threshold([[0.9, 0.1], [0.8, 0.7]], [[True, False], [True, False]])["strip_threshold"] > 0.7


def test_strips_are_labelled_by_the_answer_they_hold() -> None:
    batches = labelled_batches(SAMPLE_DIR, progress=False).batches
    strips = labelled_strips(SAMPLE_DIR, batches, 8)
    assert len(strips) > 10
    for question, graded, texts, labels in zip(strips.questions, strips.strips, strips.kept, strips.labels):
        answers = next(b.question.answers for b in batches if b.question.question == question)
        assert len(texts) > 1 and any(labels)
        for seen, text, label in zip(graded, texts, labels):
            # Labelled by its own text, graded with whatever context it carries.
            assert seen.endswith(text)
            said = normalise_text(text)
            assert label == any(re.search(rf"\b{re.escape(normalise_text(a))}\b", said) for a in answers), text


def test_an_answer_labels_a_strip_only_as_whole_words() -> None:
    # "2.1" inside "Q2 1.9" or "19" inside "in 1998" is not the answer; the same words between others are.
    assert not words_in(normalise_text("2.1"), normalise_text("Release Q2 1.9 shipped"))
    assert not words_in("19", normalise_text("founded in 1998"))
    assert words_in(normalise_text("2.1"), normalise_text("Version 2.1 shipped in Q2."))
    assert words_in("1998", normalise_text("founded in 1998."))
    assert not words_in("", "anything")


def test_an_acronym_the_corpus_never_uses_is_found_where_its_expansion_is() -> None:
    texts = [d.text for d in load_documents()]
    scorer = EvidenceScorer(corpus=texts)
    overview = next(t for t in texts if "chief executive officer" in t)
    others = [t for t in texts if "chief executive officer" not in t][:4]
    ceo = scorer.score_texts("Who is the CEO of Harbor Analytics?", [overview, *others])
    assert ceo[0] > 0.8 and max(ceo[1:]) < 0.5
    # An unseen word with no expansion in the corpus still counts against every passage.
    assert scorer.score_texts("Who is the CFO of Harbor Analytics?", [overview])[0] < 0.5
    # Only words the corpus never uses are read as acronyms.
    assert not EvidenceScorer().features("the ceo", ["Chief executive officer."])[0][1]


def test_a_misspelt_name_the_corpus_never_uses_is_found_where_it_is_spelt_right() -> None:
    texts = [d.text for d in load_documents()]
    scorer = EvidenceScorer(corpus=texts)
    overview = next(t for t in texts if "Miriam Okafor" in t)
    others = [t for t in texts if "Okafor" not in t][:4]
    right = scorer.score_texts("Who is Miriam Okafor?", [overview, *others])
    misspelt = scorer.score_texts("Who is Miriam Okafro?", [overview, *others])  # two letters swapped
    lower = EvidenceScorer.DEFAULT_THRESHOLDS["lower"]
    assert misspelt[0] > lower + 0.2 and misspelt[0] >= right[0] - 0.02  # found, as the name spelt right is
    assert max(misspelt[1:]) < lower
    assert "okafro" not in scorer.explain("Who is Miriam Okafro?", [overview])[0]["missing_terms"]
    # Two edits away is another word, and still counts against the passage.
    far = scorer.explain("Who is Miriam Ocafro?", [overview])[0]
    assert "ocafro" in far["missing_terms"] and far["score"] < misspelt[0]
    # Only words the corpus never uses are read as misspellings: a word it uses elsewhere is another word.
    elsewhere = EvidenceScorer(corpus=[*texts, "The Okafro is a river."])
    assert "okafro" in elsewhere.explain("Who is Miriam Okafro?", [overview])[0]["missing_terms"]


def test_terms_keep_content_words_in_any_script() -> None:
    assert terms("What was the churn of Harbor Pro in Q1?") == ["churn", "harbor", "pro", "q1"]
    assert terms("Quel est le budget?")[-1] == "budget"
    assert terms("東京の本社") == ["東京の本社"]


def test_a_passage_read_sentence_by_sentence_has_the_words_of_the_whole_text() -> None:
    from llama_index_crag.scorers.evidence import _passage

    # The scorer tokenises each sentence once and joins them; on every sample document (prose, tables, code)
    # that must give the same words and bigrams as tokenising the whole text.
    for document in load_documents():
        tokens = terms(document.text)
        view = _passage(document.text)
        assert view.words == frozenset(tokens), document.doc_id
        assert view.bigrams == frozenset(zip(tokens, tokens[1:])), document.doc_id


def test_evidence_features_see_coverage_and_answer_type() -> None:
    scorer = EvidenceScorer(corpus=[ALPHA.text, BETA.text, GAMMA.text])
    rows = scorer.features("When did the gamma office open?", [GAMMA.text, BETA.text])
    assert rows.shape == (2, len(FEATURES))
    named = dict(zip(FEATURES, rows[0]))
    assert named["coverage"] == pytest.approx(1.0) and named["answer_type"] == 1.0
    assert rows[1][FEATURES.index("coverage")] < 0.5
    scores = scorer.score_texts("When did the gamma office open?", [GAMMA.text, BETA.text])
    assert scores[0] > scores[1]


def test_a_passage_that_stands_out_from_the_other_candidates_scores_higher() -> None:
    scorer = EvidenceScorer(corpus=[ALPHA.text, BETA.text, GAMMA.text])
    question = "When did the gamma office open?"
    rows = scorer.features(question, [GAMMA.text, BETA.text, ALPHA.text])
    lifts = [FEATURES.index(f) for f in ("cosine_lift", "coverage_lift", "sentence_coverage_lift")]
    # Each lead is over the mean of the other candidates: the answer's passage leads, the others trail.
    coverage = rows[:, FEATURES.index("coverage")]
    assert rows[0, FEATURES.index("coverage_lift")] == pytest.approx(coverage[0] - coverage[1:].mean())
    assert (rows[0, lifts] > 0).all() and (rows[1:, lifts] < 0).all()
    # Alone, a passage leads the typical rival instead; among unrelated candidates it stands out.
    alone_rows = scorer.features(question, [GAMMA.text])
    own = [FEATURES.index(f) for f in ("cosine", "coverage", "sentence_coverage")]
    assert alone_rows[0, lifts] == pytest.approx(alone_rows[0, own] - scorer.rival_means)
    among = scorer.score_texts(question, [GAMMA.text, BETA.text, ALPHA.text])
    assert among[0] > max(among[1:])
    # A duplicate of the relevant passage does not cancel its twin: both still lead the rest.
    twins = scorer.score_texts(question, [GAMMA.text, GAMMA.text, BETA.text, ALPHA.text])
    assert twins[0] == twins[1] > max(twins[2:]) and twins[0] >= scorer.DEFAULT_THRESHOLDS["upper"]


VELL = "The Ostmoor creamery ages Vell Blue for nine weeks."
FERRY = "The harbour ferry leaves at noon every Tuesday from the north pier."


def test_a_lone_candidate_is_not_punished_for_having_no_rivals() -> None:
    question = "How long is Vell Blue aged?"
    scorer = EvidenceScorer(corpus=[VELL])  # a one-document index
    alone = scorer.score_texts(question, [VELL])[0]
    assert alone >= scorer.DEFAULT_THRESHOLDS["lower"]
    with_rival = EvidenceScorer(corpus=[VELL, FERRY]).score_texts(question, [VELL, FERRY])[0]
    assert abs(with_rival - alone) < 0.35
    # The same lone passage without the answer's words stays far below it.
    assert scorer.score_texts(question, [FERRY])[0] < 0.1


def test_inflections_of_a_word_match_each_other() -> None:
    assert terms("aged") == terms("ages") == terms("ageing") == terms("age")
    assert terms("priced") == terms("prices")
    missing = EvidenceScorer(corpus=[VELL, FERRY]).explain("How long is Vell Blue aged?", [VELL])[0]["missing_terms"]
    assert missing == terms("long")


def test_the_evidence_scorer_explains_each_score_by_its_parts() -> None:
    scorer = EvidenceScorer(corpus=[ALPHA.text, BETA.text, GAMMA.text])
    question = "When did the gamma office open in Lisbon?"
    texts = [GAMMA.text, BETA.text]
    explained = scorer.explain(question, texts)
    scores = scorer.score_texts(question, texts)
    for explanation, score, row in zip(explained, scores, scorer.features(question, texts)):
        # The contributions and the bias add up to the logit of the very score the grader uses.
        assert sum(explanation["contributions"].values()) + explanation["bias"] == pytest.approx(
            math.log(score / (1 - score)), abs=1e-2
        )
        assert explanation["score"] == pytest.approx(score, abs=1e-4)
        assert list(explanation["features"]) == list(FEATURES)
        assert list(explanation["features"].values()) == pytest.approx(list(row), abs=1e-4)
    # What the passage lacks, rarest first: Porto's passage lacks "lisbon"; the menu lacks nearly everything.
    assert explained[0]["missing_terms"] == ["lisbon"]
    assert explained[1]["missing_terms"][0] == "lisbon" and set(terms("gamma office")) <= set(
        explained[1]["missing_terms"]
    )
    assert scorer.explain(question, []) == []
    # A scorer built on one model logit has nothing more to say.
    assert LLMJudgeScorer(ScriptedLLM()).explain(question, texts) is None


def test_evidence_scorer_learns_weights_and_round_trips_them() -> None:
    from llama_index_crag.scorers.evidence import FEATURES

    scorer = EvidenceScorer()
    x = np.random.default_rng(0).uniform(0.0, 1.0, (8, len(FEATURES)))
    x[:4] += 0.5  # the relevant rows stand out on every feature
    state = scorer.fit(x, [True] * 4 + [False] * 4).state()
    assert len(state["weights"]) == len(FEATURES) + 1
    other = EvidenceScorer().load_state(state)
    assert other.weights.tolist() == pytest.approx(state["weights"])
    with pytest.raises(ValueError, match="features"):
        EvidenceScorer().load_state({"features": ["cosine"], "weights": [1.0, 0.0]})


def test_a_calibration_fitted_before_a_feature_was_added_weighs_it_zero() -> None:
    # Calibration files written before "turned_round" existed still load, and score as they were fitted.
    from llama_index_crag.scorers.evidence import ADDED_FEATURES, FEATURES

    older = [name for name in FEATURES if name not in ADDED_FEATURES]
    weights = [float(i + 1) for i in range(len(older))] + [-3.0]
    scorer = EvidenceScorer().load_state({"features": older, "weights": weights})
    by_name = dict(zip(FEATURES, scorer.weights))
    assert all(by_name[name] == 0.0 for name in ADDED_FEATURES)
    assert [by_name[name] for name in older] == weights[:-1] and scorer.weights[-1] == -3.0
    # Any other difference in the features is still refused: the weights would mean something else.
    with pytest.raises(ValueError, match="features"):
        EvidenceScorer().load_state({"features": list(reversed(older)), "weights": weights})
    with pytest.raises(ValueError, match="features"):
        EvidenceScorer().load_state({"features": older, "weights": weights[:-1]})


def test_llm_judge_grades_all_passages_in_one_structured_call() -> None:
    llm = ScriptedLLM(rewrite="unused")
    llm_calls: List[str] = []

    class Judge(ScriptedLLM):
        def _text(self, prompt: str) -> str:
            llm_calls.append(prompt)
            return '{"relevant": ["yes", "no"]}'

    scores = LLMJudgeScorer(Judge()).score_texts("alpha budget?", [ALPHA.text, BETA.text, GAMMA.text])
    assert scores == [1.0, 0.0, 0.5] and len(llm_calls) == 1
    assert "[3]" in llm_calls[0]
    assert llm.calls["answer"] == 0


def test_llm_judge_reads_verdicts_from_prose_when_json_fails() -> None:
    class Chatty(ScriptedLLM):
        def _text(self, prompt: str) -> str:
            return "Sure! Passage 1: Yes. Passage 2: no"

    assert LLMJudgeScorer(Chatty()).score_texts("q", ["a", "b"]) == [1.0, 0.0]


def test_the_judge_prompt_is_a_prompt_of_the_scorer_and_of_an_engine_grading_with_it() -> None:
    sent: List[str] = []

    class Judge(ScriptedLLM):
        def _text(self, prompt: str) -> str:
            sent.append(prompt)
            return '{"relevant": ["yes"]}'

    scorer = LLMJudgeScorer(Judge())
    assert scorer.get_prompts()["judge_prompt"].get_template() == JUDGE_PROMPT.get_template()
    engine = make_engine(scorer, ScriptedLLM(), primary=[ALPHA])
    assert engine.get_prompts()["scorer:judge_prompt"].get_template() == JUDGE_PROMPT.get_template()
    engine.update_prompts({"scorer:judge_prompt": PromptTemplate("MY JUDGE {query_str} over {context_str}")})
    assert engine.query("What is the alpha project budget?").metadata["crag"]["action"] == "correct"
    assert sent[0].startswith("MY JUDGE What is the alpha project budget? over [1] The alpha project budget")
    with pytest.raises(ConfigError, match=r"\{context_str\}"):
        scorer.update_prompts({"judge_prompt": PromptTemplate("Is it relevant to {query_str}?")})


def test_llm_judge_on_a_local_model_file_is_named_by_the_file_not_the_machine_path() -> None:
    from llama_index.core.base.llms.types import LLMMetadata

    class Local(ScriptedLLM):
        @property
        def metadata(self) -> LLMMetadata:
            return LLMMetadata(model_name="/opt/models/SmolLM2-135M-Instruct.Q4_1.gguf")

    assert LLMJudgeScorer(Local()).name == "llm-judge:SmolLM2-135M-Instruct.Q4_1.gguf"
    assert LLMJudgeScorer(ScriptedLLM()).name == "llm-judge:scripted"


def test_calibrate_fits_one_file_on_several_sets(tmp_path: Path) -> None:
    """Two sets, each over its own corpus: one fit, both named, every batch of both counted and its qid kept."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "corpus.jsonl").write_text((SAMPLE_DIR / "corpus.jsonl").read_text())
    rows = [json.loads(line) for line in (SAMPLE_DIR / "questions.jsonl").read_text().splitlines()][:20]
    (other / "questions.jsonl").write_text("".join(json.dumps({**r, "qid": "other-" + r["qid"]}) + "\n" for r in rows))
    alone, both = tmp_path / "alone.json", tmp_path / "both.json"
    assert main(["calibrate", "--dataset", str(SAMPLE_DIR), "--out", str(alone), "--no-progress"]) == 0
    argv = ["calibrate", "--dataset", str(SAMPLE_DIR), "--dataset", str(other), "--out", str(both), "--no-progress"]
    assert main(argv) == 0
    one, two = json.loads(alone.read_text()), json.loads(both.read_text())
    assert two["dataset"] == f"{SAMPLE_DIR}, {other}"
    assert sum(two["samples"].values()) > sum(one["samples"].values())
    assert {q for q in two["fitted_qids"] if q.startswith("other-")} == {"other-" + r["qid"] for r in rows}
    assert two["scorer_state"]["weights"] != one["scorer_state"]["weights"]
    assert_engine_loads_calibration(both)
    synthetic = ["calibrate", "--dataset", str(SAMPLE_DIR), "--dataset", str(other), "--synthetic", "10"]
    assert main(synthetic + ["--out", str(tmp_path / "s.json")]) == 2


def test_calibrate_then_report_on_the_sample_set(tmp_path: Path, capsys: Any) -> None:
    calibration = tmp_path / "calibration.json"
    assert main(["calibrate", "--dataset", str(SAMPLE_DIR), "--out", str(calibration), "--no-progress"]) == 0
    data = json.loads(calibration.read_text())
    assert data["version"] == 1 and data["scorer"] == "evidence:all-MiniLM-L6-v2"
    assert data["thresholds"]["lower"] <= data["thresholds"]["upper"]
    assert set(data["samples"]) == {"in-corpus", "out-of-corpus", "unanswerable"}
    assert len(data["scorer_state"]["weights"]) == len(FEATURES) + 1
    # The sample set has short answers: the strips holding one are the evidence the strip threshold is fitted on.
    assert 0.0 < data["thresholds"]["strip_threshold"] < 1.0
    assert data["strips"]["passages"] > 10 and data["strips"]["evidence_kept"] > 0.5
    assert (
        main(
            [
                "grade-report",
                "--dataset",
                str(SAMPLE_DIR),
                "--out",
                str(tmp_path / "r"),
                "--folds",
                "3",
                "--max-false-reject",
                "0.1",
                "--no-progress",
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "r" / "grade-report.json").read_text())
    from llama_index_crag.scorers.registry import default_scorer

    # The first row is the engine's default scorer, whatever --scorers names; no scorer is measured twice.
    assert report["results"][0]["default"] and report["results"][0]["scorer"] == default_scorer().name
    assert len({r["scorer"] for r in report["results"]}) == len(report["results"]) >= 2
    rows = {r["scorer"]: r["rows"] for r in report["results"]}
    assert 0.5 < rows["evidence:all-MiniLM-L6-v2"]["out-of-corpus"]["auroc"] <= 1.0
    evidence = {r["scorer"]: r for r in report["results"]}["evidence:all-MiniLM-L6-v2"]
    # Every batch's score and verdict is in the JSON, and the ceiling is the best single threshold over them.
    kinds = [b["kind"] for b in evidence["batches"]]
    assert sum(k == "in-corpus" for k in kinds) == evidence["rows"]["out-of-corpus"]["batches"] - kinds.count(
        "out-of-corpus"
    )
    right = [
        b["verdict"] != "incorrect" if b["kind"] == "in-corpus" else b["verdict"] == "incorrect"
        for b in evidence["batches"]
    ]
    assert sum(right) / len(right) == pytest.approx(evidence["three_band_accuracy"])
    best = max(
        sum((b["score"] >= t) == (b["kind"] == "in-corpus") for b in evidence["batches"])
        for t in [b["score"] for b in evidence["batches"]] + [2.0]
    )
    assert evidence["accuracy_ceiling"]["accuracy"] == pytest.approx(best / len(kinds), abs=1e-6)
    strips = evidence["strips"]
    assert strips["evidence_strips"] > 10 and strips["other_strips"] > strips["evidence_strips"]
    assert 0.0 <= strips["evidence_kept"] <= 1.0 and 0.0 <= strips["at_lower"]["other_dropped"] <= 1.0
    assert (tmp_path / "r" / "grade-report.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "| evidence:all-MiniLM-L6-v2" in printed and "| out-of-corpus |" in printed and "(default) |" in printed
    incorrect = [b["verdict"] == "incorrect" for b in evidence["batches"] if b["kind"] == "in-corpus"]
    assert evidence["false_reject"] == pytest.approx(sum(incorrect) / len(incorrect))
    assert f"/ {evidence['false_reject']:.3f} |" in printed
    # At the cap: the highest lower that leaves at most a tenth of the answering batches under it, over the
    # very scores in the JSON, and what it catches of each other kind.
    at_cap = evidence["at_cap"]
    answering = sorted(b["score"] for b in evidence["batches"] if b["kind"] == "in-corpus")
    lower = round(at_cap["lower"], 6)  # the JSON's batch scores are rounded to 6 places
    under = [s < lower for s in answering]
    assert sum(under) <= 0.1 * len(answering) < sum(under) + 1 and lower in answering
    for other in ("out-of-corpus", "unanswerable"):
        scores = [b["score"] for b in evidence["batches"] if b["kind"] == other]
        caught = sum(s < lower for s in scores) / len(scores)
        assert evidence["rows"][other]["caught_at_cap"] == at_cap["caught"][other] == pytest.approx(caught)
    assert "caught at the cap: " in printed and f"| {at_cap['caught']['unanswerable']:.3f} / " in printed
    with pytest.raises(ValueError, match="calibrate on a split"):
        from llama_index_crag.calibration.report import run_report

        run_report(
            SAMPLE_DIR,
            ["evidence"],
            calibration,
            tmp_path / "again",
            5,
            3,
            None,
            0,
            {"target_precision": 0.9, "target_recall": 0.9},
            8,
            progress=False,
        )


def test_calibrate_with_a_false_reject_cap_writes_it_and_what_it_reached(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "capped.json"
    argv = ["calibrate", "--dataset", str(SAMPLE_DIR), "--no-progress", "--target-recall", "0.99"]
    assert main([*argv, "--max-false-reject", "0.0", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["targets"]["max_false_reject"] == 0.0 and data["achieved"]["false_reject"] == 0.0
    assert "with the answer graded INCORRECT 0.000" in capsys.readouterr().out
    assert main([*argv, "--out", str(tmp_path / "free.json")]) == 0
    free = json.loads((tmp_path / "free.json").read_text())
    assert free["achieved"]["false_reject"] > 0.0  # so the cap above did hold lower down
    assert data["thresholds"]["lower"] < free["thresholds"]["lower"]
    assert main([*argv, "--max-false-reject", "1.5", "--out", str(out)]) == 2
    assert "--max-false-reject must be at least 0 and below 1" in capsys.readouterr().err


def test_a_judge_limit_too_small_to_measure_the_judge_says_to_raise_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setattr("llama_index_crag.local.models.default_llm", lambda *args: (ScriptedLLM(), "scripted"))
    argv = ["grade-report", "--dataset", str(SAMPLE_DIR), "--scorers", "llm-judge", "--judge-limit", "1"]
    assert main([*argv, "--folds", "3", "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llama-crag: llm-judge: --judge-limit 1 leaves ") and err.strip().endswith(
        "raise --judge-limit"
    )


def test_each_scorer_is_set_against_the_default_with_a_paired_bootstrap_interval() -> None:
    from llama_index_crag.calibration.report_figures import against_default, table

    rng = np.random.default_rng(1)
    kinds = ["in-corpus"] * 60 + ["out-of-corpus"] * 60
    answering = np.asarray([k == "in-corpus" for k in kinds], dtype=float)
    noisy = answering * 0.2 + rng.random(120)  # tells the kinds apart, with many errors

    def result(scores: Any, default: bool = False) -> dict:
        batches = [{"qid": f"q{i % 60}", "kind": k, "score": float(s)} for i, (k, s) in enumerate(zip(kinds, scores))]
        return {"scorer": "s", "default": default, "batches": batches, "rows": {"out-of-corpus": {}}}

    default, same, better = result(noisy, default=True), result(noisy), result(answering + 0.1 * rng.random(120))
    against_default([default, same, better])
    assert "against_default" not in default["rows"]["out-of-corpus"]
    unchanged = same["rows"]["out-of-corpus"]["against_default"]
    assert unchanged["difference"] == 0.0 and unchanged["interval"] == [0.0, 0.0] and unchanged["questions"] == 60
    gained = better["rows"]["out-of-corpus"]["against_default"]
    low, high = gained["interval"]
    assert 0.0 < low < gained["difference"] < high <= 1.0, "a scorer that separates the kinds is told apart"
    for values in (default, same, better):
        values.update(three_band_accuracy=0.5, accuracy_ceiling={"accuracy": 0.5}, pairs_per_second=1.0)
        values["rows"]["out-of-corpus"].update(auroc=0.5, accuracy=0.5, batches=120)
    assert f"| +{gained['difference']:.3f} [+{low:.3f}, +{high:.3f}] |" in table([default, same, better])


def test_the_accuracy_ceiling_is_the_best_single_threshold() -> None:
    from llama_index_crag.calibration.report_figures import accuracy_ceiling

    scores = np.asarray([0.9, 0.8, 0.7, 0.7, 0.4, 0.2])
    answerable = np.asarray([True, False, True, False, True, False])
    # Answering from 0.4 up gets the three answerable and 0.2 right (4 of 6); from 0.9 up, 0.9 and the three
    # unanswerable below it (4 of 6); from 0.7 up only 3. The first best, in score order, is 0.4.
    ceiling = accuracy_ceiling(scores, answerable)
    assert ceiling["accuracy"] == pytest.approx(4 / 6)
    assert ceiling["lower"] == 0.4
    # Perfectly separated classes reach 1.0 with the threshold at the lowest answerable score.
    assert accuracy_ceiling(np.asarray([0.1, 0.2, 0.8, 0.9]), np.asarray([False, False, True, True])) == {
        "accuracy": 1.0,
        "lower": 0.8,
    }
    # All negative: the threshold goes above every score.
    none_answerable = accuracy_ceiling(np.asarray([0.3, 0.5]), np.asarray([False, False]))
    assert none_answerable["accuracy"] == 1.0 and none_answerable["lower"] > 0.5
    assert accuracy_ceiling(np.asarray([]), np.asarray([], dtype=bool)) == {"accuracy": None, "lower": None}


def test_caught_at_the_cap_is_the_highest_lower_within_the_cap() -> None:
    from llama_index_crag.calibration.report_figures import caught_at_cap

    kinds = np.asarray(["in-corpus"] * 10 + ["out-of-corpus"] * 4 + ["unanswerable"] * 2)
    answering = [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.3, 0.2]
    scores = np.asarray(answering + [0.1, 0.25, 0.5, 0.62] + [0.55, 0.99])
    # A fifth of ten may fall under: lower is the third lowest answering score, 0.6, and 0.2 and 0.3 are under it.
    found = caught_at_cap(scores, kinds, 0.2)
    assert found is not None and found["lower"] == 0.6 and found["answering_under"] == pytest.approx(0.2)
    assert found["caught"] == {"out-of-corpus": pytest.approx(0.75), "unanswerable": pytest.approx(0.5)}
    # No answering batch may fall under: lower is the lowest of them.
    none = caught_at_cap(scores, kinds, 0.0)
    assert none is not None and none["lower"] == 0.2 and none["caught"]["out-of-corpus"] == pytest.approx(0.25)
    # A cap of every answering batch puts lower just above the highest of them (0.99 is higher still).
    every = caught_at_cap(scores, kinds, 1.0)
    assert every is not None and every["answering_under"] == 1.0 and 0.95 < every["lower"] < 0.99
    assert every["caught"] == {"out-of-corpus": 1.0, "unanswerable": 0.5}
    # No answering batch, no bound.
    assert caught_at_cap(scores[10:], kinds[10:], 0.05) is None


def test_the_engine_loads_learned_weights_from_its_calibration_file(tmp_path: Path) -> None:
    calibration = tmp_path / "calibration.json"
    main(["calibrate", "--dataset", str(SAMPLE_DIR), "--out", str(calibration), "--no-progress"])
    assert_engine_loads_calibration(calibration)


def test_a_snippet_set_labels_the_snippets_that_hold_the_answer(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "snippets"
    assert main(["snippets", "--dataset", str(SAMPLE_DIR), "--out", str(out), "--min-words", "20"]) == 0
    assert "snippets and" in capsys.readouterr().out
    corpus = {row["doc_id"]: row["text"] for row in map(json.loads, (out / "corpus.jsonl").read_text().splitlines())}
    originals = {d.doc_id: d.text for d in load_documents()}
    # Every snippet is a piece of one document; prose ones are at least 20 words unless the document is shorter
    # (a table or code block stays whole, as the refiner keeps it).
    assert len(corpus) > len(originals)
    for snippet_id, text in corpus.items():
        source = originals[snippet_id.split("#")[0]]
        assert text in source
        assert len(text.split()) >= 20 or len(source.split()) < 40 or text.lstrip()[:1] in "`|"
    questions = [json.loads(line) for line in (out / "questions.jsonl").read_text().splitlines()]
    answerable = [q for q in questions if q["answerable"]]
    assert answerable and len(answerable) < len(questions)
    for question in answerable:
        assert question["relevant_doc_ids"]
        for snippet_id in question["relevant_doc_ids"]:
            assert any(a.lower() in corpus[snippet_id].lower() for a in question["answers"]), question
        # The document's other snippets are the on-topic noise: they stay in the corpus, unlabelled.
        document = question["relevant_doc_ids"][0].split("#")[0]
        siblings = [s for s in corpus if s.split("#")[0] == document and s not in question["relevant_doc_ids"]]
        for snippet_id in siblings:
            assert not any(a.lower() in corpus[snippet_id].lower() for a in question["answers"])


def test_a_snippet_set_reads_its_rows_as_every_other_command_does(tmp_path: Path, capsys: Any) -> None:
    source = tmp_path / "set"
    source.mkdir()
    (source / "corpus.jsonl").write_text(json.dumps({"doc_id": 7, "text": "Mice lack the protein in this study."}))
    rows = [
        {"qid": "a", "question": "What do mice lack?", "answers": ["the protein"], "relevant_doc_ids": ["7"]},
        {"qid": "b", "question": "Why?", "answers": None, "relevant_doc_ids": ["7"]},
    ]
    (source / "questions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["snippets", "--dataset", str(source), "--out", str(tmp_path / "a"), "--min-words", "3"]) == 0
    # "answers": null reads as no answers (it was a TypeError); a row the loader refuses is named in one line.
    (source / "corpus.jsonl").write_text(json.dumps({"text": "Mice lack the protein."}) + "\n")
    assert main(["snippets", "--dataset", str(source), "--out", str(tmp_path / "b")]) == 2
    assert "corpus.jsonl:1 has no 'doc_id' text" in capsys.readouterr().err


def test_a_snippet_set_labels_evidence_sentences_by_index(tmp_path: Path) -> None:
    from llama_index_crag.evaluation.snippets import snippet_set

    source = tmp_path / "set"
    source.mkdir()
    sentences = [f"Sentence {i} says something about mice and proteins in this study." for i in range(6)]
    (source / "corpus.jsonl").write_text(
        json.dumps({"doc_id": "7", "title": "Mice lack the protein", "sentences": sentences}) + "\n"
    )
    claims = [
        {
            "qid": "a",
            "claim": "Mice lack the protein.",
            "evidence": {"7": {"sentences": [3]}},
            "relevant_doc_ids": ["7"],
        },
        {"qid": "b", "claim": "Nothing here.", "answerable": False, "relevant_doc_ids": []},
    ]
    (source / "questions.jsonl").write_text("".join(json.dumps(c) + "\n" for c in claims))
    counts = snippet_set(source, tmp_path / "out", min_words=20)
    assert counts == {"snippets": 3, "questions": 2, "left_out": 0}
    # The title states the claim: carried into every snippet, it would make each one look like evidence.
    snippets = [json.loads(line) for line in (tmp_path / "out" / "corpus.jsonl").read_text().splitlines()]
    assert all("title" not in s and "Mice lack" not in s["text"] for s in snippets)
    rows = [json.loads(line) for line in (tmp_path / "out" / "questions.jsonl").read_text().splitlines()]
    # Sentences 2 and 3 form the second snippet (two 10-word sentences a snippet).
    assert rows[0]["relevant_doc_ids"] == ["7#1"] and rows[0]["question"] == "Mice lack the protein."
    assert rows[1] == {
        "qid": "b",
        "question": "Nothing here.",
        "answers": [],
        "answerable": False,
        "relevant_doc_ids": [],
    }
    with pytest.raises(ValueError, match="min_words"):
        snippet_set(source, tmp_path / "bad", min_words=0)


def _held_out_titles(count: int) -> List[str]:
    """Article titles whose pairs the stable hash holds out (a tenth of all titles are)."""
    from llama_index_crag.calibration.labelled import is_held_out

    titles = (f"Article {i}" for i in range(10_000))
    return [t for t in titles if is_held_out({"source": "s", "title": t, "question": "q"})][:count]


def test_grade_pairs_cross_validates_by_article_and_says_so_when_there_is_only_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Per article: two questions, each with the passage that answers it and one that does not.
    cases = (("gamma", GAMMA.text, 1), ("gamma", BETA.text, 0), ("alpha", ALPHA.text, 1), ("alpha", GAMMA.text, 0))

    def pairs(titles: List[str]) -> Path:
        rows = [
            {"question": f"In which city is the {word} office?", "passage": passage, "label": label, "source": "s",
             "title": title}
            for title in titles
            for word, passage, label in cases
        ]  # fmt: skip
        path = tmp_path / f"pairs-{len(titles)}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    one, two = _held_out_titles(1), _held_out_titles(2)
    argv = ["grade-pairs", "--scorers", "evidence", "--no-progress"]
    assert main([*argv, "--pairs-file", str(pairs(one))]) == 2
    assert f"all 4 come from 's|title:{one[0]}'" in capsys.readouterr().err
    out = tmp_path / "two.json"
    assert main([*argv, "--pairs-file", str(pairs(two)), "--out", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["protocol"] == "2-fold cross-validation by article or question"
    assert result["figures"]["all"]["pairs"] == 8


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"[1, 2]", "is not a calibration"),
        (b"null", "is not a calibration"),
        (b'{"version": 1, "thresholds": null}', "is not a calibration"),
        (b"\xff\xfe{}", "is not valid JSON"),
    ],
)
def test_a_calibration_file_of_another_shape_is_a_config_error(tmp_path: Path, content: bytes, said: str) -> None:
    from llama_index_crag.errors import ConfigError
    from llama_index_crag.settings_sources import read_calibration

    (tmp_path / "cal.json").write_bytes(content)
    with pytest.raises(ConfigError, match=said):
        read_calibration(tmp_path / "cal.json", None)
    with pytest.raises(ConfigError, match="is a folder"):
        read_calibration(tmp_path, None)


def test_a_nan_upstream_score_is_an_error_not_an_order_dependent_verdict() -> None:
    from llama_index.core.schema import NodeWithScore, QueryBundle

    from llama_index_crag.scorers.reuse import UpstreamScoreScorer

    scorer = UpstreamScoreScorer(normalization="sigmoid")
    for scores in ([math.nan, 5.0], [5.0, math.nan]):
        nodes = [NodeWithScore(node=n, score=s) for n, s in zip((ALPHA, BETA), scores)]
        with pytest.raises(ValueError, match="NaN score"):
            scorer.score_nodes(QueryBundle("alpha project budget"), nodes)


@pytest.mark.parametrize(
    ("row", "said"),
    [
        ({"question": "Why?", "passage": "Because.", "label": 0.9}, "label of 0 or 1, not 0.9"),
        ({"question": "Why?", "passage": "Because.", "label": True}, "label of 0 or 1, not True"),
        ({"question": None, "passage": "Because.", "label": 1}, "each non-empty text"),
        ({"question": "Why?", "passage": ["a", "b"], "label": 1}, "each non-empty text"),
    ],
)
def test_a_pair_is_read_as_written_never_coerced(tmp_path: Path, row: dict, said: str) -> None:
    from llama_index_crag.calibration.labelled import read_rows
    from llama_index_crag.errors import DatasetError

    (tmp_path / "pairs.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=f"pairs.jsonl:1: needs a .*{said}"):
        list(read_rows(tmp_path / "pairs.jsonl"))
    (tmp_path / "pairs.jsonl").write_bytes(b'{"question": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match="pairs.jsonl:1 is not UTF-8"):
        list(read_rows(tmp_path / "pairs.jsonl"))


def test_calibrate_refuses_a_target_no_threshold_can_meet_and_snippets_its_own_dataset(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["calibrate", "--dataset", str(SAMPLE_DIR), "--target-precision", "1.5"]) == 2
    assert "--target-precision is a share: more than 0 and at most 1, got 1.5" in capsys.readouterr().err
    assert main(["snippets", "--dataset", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "would overwrite the dataset" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("state", "said"),
    [
        ({"weights": [math.nan] * (len(FEATURES) + 1), "features": list(FEATURES)}, "weights must be finite numbers"),
        ({"weights": ["a"] * (len(FEATURES) + 1), "features": list(FEATURES)}, "weights are not a list of numbers"),
        ({"features": list(FEATURES)}, "scorer_state holds no weights"),
        ([1, 2, 3], "scorer_state holds no weights"),
        (
            {"weights": [0.5] * (len(FEATURES) + 1), "features": list(FEATURES), "rival_means": [0.1]},
            "rival_means has 1 values, not 3",
        ),
    ],
)
def test_a_damaged_fitted_state_in_a_calibration_file_stops_the_engine(
    embed_model: Any, tmp_path: Path, state: Any, said: str
) -> None:
    from llama_index_crag import CorrectiveQueryEngine
    from llama_index_crag.errors import ConfigError

    scorer = EvidenceScorer(embed_model)
    calibration = {"version": 1, "scorer": scorer.name, "thresholds": {"upper": 0.8, "lower": 0.4}}
    (tmp_path / "cal.json").write_text(json.dumps({**calibration, "scorer_state": state}))
    with pytest.raises(ConfigError, match=said):  # NaN weights would score every passage 0: abstain on everything
        CorrectiveQueryEngine.from_defaults(
            nodes=[ALPHA, BETA], embed_model=embed_model, scorer=scorer, calibration_path=str(tmp_path / "cal.json")
        )
