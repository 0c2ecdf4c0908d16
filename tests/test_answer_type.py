"""The answer-type and constraint evidence: does the passage hold the kind of thing asked, on the question's terms."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_index_crag.scorers.answer_type import answer_type, asked_kinds, constraints, holds_kind, turned_round
from llama_index_crag.scorers.evidence import FEATURES, EvidenceScorer

from .check_halves import check_half

BRIDGE_DATE = "The Kestrel Bridge in Farrow opened in 1887."
BRIDGE_LENGTH = "The Kestrel Bridge in Farrow spans 312 metres across the Lune estuary."


#: Filler words that hold no figure, date or name, for text around a value a test inserts.
FILLER = st.lists(
    st.sampled_from("the report said that our green river office walked quietly across an old bridge with".split()),
    max_size=8,
).map(" ".join)
FIGURES = st.one_of(
    st.integers(min_value=0, max_value=10**7).map(str),
    st.integers(min_value=1000, max_value=10**7).map("{:,}".format),
    st.builds("{}.{}".format, st.integers(0, 99), st.integers(0, 9)),
)
NUMBERS = st.one_of(
    FIGURES,
    st.sampled_from(["three", "twenty-one", "forty five", "a dozen", "hundreds", "several", "a few", "one hundred"]),
)
DAYS = st.integers(min_value=1, max_value=28)
HOURS = st.integers(min_value=1, max_value=12)
#: A question that asks for each kind, and values of that kind as passages write them.
ASKED = {
    "count": ("How many people came to the meeting?", NUMBERS),
    "length": (
        "How tall is the tower?",
        st.builds(
            "{} {}".format,
            NUMBERS,
            st.sampled_from(["metres", "km", "feet", "miles", "nautical miles", "acres", "bytes", "MB", "characters"]),
        ),
    ),
    "duration": (
        "How long did the siege last?",
        st.builds("{} {}".format, NUMBERS, st.sampled_from(["seconds", "minutes", "hours", "days", "weeks", "years"])),
    ),
    "percent": (
        "What percentage of members voted?",
        st.builds("{}{}".format, FIGURES, st.sampled_from(["%", " per cent"])),
    ),
    "amount": (
        "How much did the bridge cost?",
        st.one_of(st.integers(1, 10**6).map("${}".format), st.integers(1, 999).map("{} million".format)),
    ),
    "year": ("In what year did the bridge open?", st.integers(min_value=1000, max_value=2099).map(str)),
    "date": (
        "When did the office open?",
        st.one_of(
            st.integers(min_value=1000, max_value=2099).map(str),
            st.sampled_from(["March", "October", "Sunday", "noon", "six in the morning"]),
            st.builds("{}/{}/2021".format, DAYS, st.integers(1, 12)),
            st.builds("{}:{:02d}".format, HOURS, st.integers(0, 59)),
            st.builds("{} pm".format, HOURS),
        ),
    ),
    # A manual's question about a setting's default, answered where the text states the default and its value.
    "default": (
        "What is the default value of the retry limit?",
        st.builds(
            lambda form, value: form.format(value),
            st.sampled_from(
                ["the default is {}", "it defaults to {}", "(default {})", "{} is the default", "{} by default"]
            ),
            st.one_of(FIGURES, st.sampled_from(["4MB", "replica", "Read Committed", "on"])),
        ),
    ),
    "person": (
        "Who chairs the cooperative?",
        st.builds(
            "{} {}".format, st.sampled_from(["Ingrid", "Miriam", "Tomas"]), st.sampled_from(["Halvorsen", "Okafor"])
        ),
    ),
}


@pytest.mark.parametrize("kind", list(ASKED))
@settings(max_examples=60, deadline=None)
@given(data=st.data(), before=FILLER, after=FILLER)
def test_a_value_of_the_kind_asked_is_found_wherever_it_stands_in_a_passage(
    kind: str, data: st.DataObject, before: str, after: str
) -> None:
    question, values = ASKED[kind]
    kinds = asked_kinds(question)
    assert kinds is not None and kind in kinds
    value = data.draw(values)
    assert holds_kind(kinds, f"the {before} {value} {after}.", question)
    assert not holds_kind(kinds, f"the {before} {after}.", question)


def test_the_kind_a_question_asks_is_the_kind_of_its_own_answer_far_more_often_than_another_questions() -> None:
    # SQuAD 2.0's check half, the answerable questions that ask a kind: each gold answer against the kinds asked by
    # the next question that asks another. Measured 2026-12: 13 of 20 against 3 of 20.
    questions, _ = check_half("squad2")
    asking = [q for q in questions if q.answerable and asked_kinds(q.question)]
    kinds = [k for k in (asked_kinds(q.question) for q in asking) if k is not None]
    own = other = 0
    for i, question in enumerate(asking):
        others = kinds[i + 1 :] + kinds[:i]
        another = next((k for k in others if k != kinds[i]), kinds[i])
        own += any(holds_kind(kinds[i], a, question.question) for a in question.answers)
        other += any(holds_kind(another, a, question.question) for a in question.answers)
    assert len(asking) >= 15 and own >= 3 * other and own >= len(asking) / 2, (own, other, len(asking))


@pytest.mark.parametrize(
    "question",
    [
        "What is the default value of work_mem?",
        "whats the defualt work_mem",
        "autovacuum_freeze_max_age default value?",
        # what a program does when an option is left out is its default
        "If I run pg_ctl stop without -m, which shutdown mode is used?",
        "Which output format does pg_dump write when no -F is given?",
        "What does the dump hold without the --format option?",
        # and as people ask it of a manual
        "Which login attribute does CREATE ROLE give by default?",
        "What does listen_addresses default to?",
        "What's the out-of-the-box shared_buffers size?",
        "What fillfactor does a B-tree index get when I don't specify one?",
        "Which wal_level does the server use if nobody ever changes the setting?",
        "What does the transaction_timeout setting do, and what is its default?",
    ],
)
def test_a_setting_mentioned_with_default_but_no_stated_default_does_not_answer_a_default_question(
    question: str,
) -> None:
    # The passages a default question finds name the setting and the word; only the one that states it answers.
    kinds = asked_kinds(question)
    assert kinds == frozenset({"default"})
    assert not holds_kind(kinds, "Be careful not to set the default value too high for work_mem.", question)
    assert not holds_kind(kinds, "The memory used could be many times the value of work_mem.", question)
    assert holds_kind(
        kinds,
        "If this value is specified without units, it is taken as kilobytes. The default is four megabytes (4MB).",
        question,
    )


@pytest.mark.parametrize(
    "claim",
    [
        "BRCA 1 mutation carriers' risk of breast and ovarian cancer depends on where the mutation is located.",
        "Students who perform poorly in the early years of medical school are at increased risk of misconduct.",
        "qSOFA scores are associated with length of stay in emergency department patients.",
    ],
)
def test_a_claim_asks_for_no_kind_of_answer(claim: str) -> None:
    # Its "who" and "where" open clauses; a passage that verifies it need name no person and no place.
    assert asked_kinds(claim) is None
    assert answer_type(claim, "Risk varied with the mutation's site.", "Risk varied with the mutation's site.") == 0.5


def test_a_when_that_opens_a_clause_asks_for_no_date() -> None:
    assert asked_kinds("What is the resultant force called when two forces act on a particle?") is None


def test_until_when_is_answered_by_a_date_or_an_event_so_it_asks_for_no_kind() -> None:
    # SQuAD 2.0: "The price of oil is usually a stable commodity until when?" -> "the oil shock".
    assert asked_kinds("The price of oil is usually a stable commodity until when?") is None
    assert asked_kinds("The office stayed open till when?") is None


def test_how_many_days_asks_for_a_duration_that_a_dates_day_does_not_answer() -> None:
    question = "how many days did the warsaw uprising last"
    kinds = asked_kinds(question)
    assert kinds is not None and holds_kind(kinds, "The struggle went on for 63 days.", question)
    assert not holds_kind(kinds, "On 1 August 1944 the Warsaw Uprising began.", question)


def test_a_length_asked_and_only_a_date_present_is_not_an_answer() -> None:
    question = "How long is the Kestrel Bridge in Farrow?"
    assert answer_type(question, BRIDGE_DATE, BRIDGE_DATE) == 0.0
    assert answer_type(question, BRIDGE_LENGTH, BRIDGE_LENGTH) == 1.0


def test_a_duration_asked_is_not_answered_by_a_length_or_a_year() -> None:
    question = "How long did the outage last?"
    assert answer_type(question, "The outage in 2023 hit the EU-2 region.", "The outage in 2023 hit EU-2.") == 0.0
    assert answer_type(question, "The outage lasted 4 hours.", "The outage lasted 4 hours.") == 1.0


def test_a_person_asked_and_only_an_organisation_present_is_not_an_answer() -> None:
    question = "Who founded the dairy?"
    organisation = "The dairy was founded by the Ostmoor Farming Association."
    person = "The dairy was founded by Ingrid Halvorsen."
    assert answer_type(question, organisation, organisation) == 0.0
    assert answer_type(question, person, person) == 1.0


def test_an_answer_only_outside_the_best_sentence_counts_for_less() -> None:
    question = "How long is the Kestrel Bridge?"
    passage = f"{BRIDGE_DATE} It spans 312 metres."
    assert answer_type(question, BRIDGE_DATE, passage) == 0.75


def test_a_year_asked_and_another_year_present_contradicts_the_question() -> None:
    question = "What was the cooperative's revenue in 2017?"
    assert constraints(question, "The cooperative's revenue in 2021 was 4 million crowns.") == 0.0
    assert constraints(question, "The cooperative's revenue in 2017 was 4 million crowns.") == 1.0
    assert constraints(question, "The cooperative's revenue was 4 million crowns.") == 0.25
    assert constraints("What is the cooperative's revenue?", "Revenue in 2021 was 4 million.") == 0.5


COMMITTEES = "The members of each committee reflect the balance of parties across Parliament."


def test_a_negated_question_is_not_answered_by_a_passage_that_states_the_thing() -> None:
    # SQuAD 2.0's annotators made unanswerable questions so: "not" put into an answerable one.
    question = "Which committees do not reflect the balance of parties across Parliament?"
    assert turned_round(question, COMMITTEES, COMMITTEES) == "the question is negated and its passage states it"
    assert turned_round("Which committees reflect the balance of parties?", COMMITTEES, COMMITTEES) is None


@pytest.mark.parametrize(
    "sentence",
    [
        "Two committees do not reflect the balance of parties across Parliament.",
        "The Scottish Parliament is unable to legislate on such issues.",
        "The crown's refusal to allow non-Catholics to settle slowed the colony's growth.",
        "The Wankel engine is a pistonless rotary engine.",
    ],
)
def test_a_negated_question_is_answered_by_a_passage_that_negates_in_its_own_words(sentence: str) -> None:
    assert turned_round("What was not allowed?", sentence, sentence) is None


@pytest.mark.parametrize(
    "question",
    [
        "Who starred in No One Would Tell?",  # a title, not a negation
        "What does Mighty No. 9 resemble?",
        "Did the plan ship, or not?",
        "What may or may not make a Turing machine more powerful?",
        "Which band not only toured but recorded in 1976?",
    ],
)
def test_what_only_looks_like_a_negation_turns_nothing_round(question: str) -> None:
    sentence = "The band toured Europe and recorded an album in 1976."
    assert turned_round(question, sentence, sentence) is None


@pytest.mark.parametrize(
    "question",
    [
        # A negation in a condition, an exclusion, or what the user says happened first: not what is asked.
        "Which committees reflect the balance of parties when no election is held?",
        "Which committees reflect the balance of parties if nobody changes the rules?",
        "If I don't change the rules, which committees reflect the balance of parties?",
        "Which committees reflect the balance of parties but not the regions?",
        "I read the rules and they don't say. Which committees reflect the balance of parties?",
    ],
)
def test_a_negation_outside_the_clause_that_asks_turns_nothing_round(question: str) -> None:
    assert turned_round(question, COMMITTEES, COMMITTEES) is None
    # The same negation in the clause that asks still does.
    asked = question.replace("committees reflect", "committees do not reflect")
    assert turned_round(asked, COMMITTEES, COMMITTEES) == "the question is negated and its passage states it"


def test_an_opposite_word_turns_the_question_round_only_where_the_passage_lacks_the_word() -> None:
    lower = "Antibody production is lower than normal in newborns."
    assert turned_round("When is antibody production higher than normal?", lower, lower) == (
        'the question says "higher", its passage says "lower"'
    )
    both = f"{lower} It is higher than normal after a vaccine."
    assert turned_round("When is antibody production higher than normal?", lower, both) is None
    # "At least" is an idiom, not the opposite of "the most".
    arms = "The Rhine formed at least two arms."
    assert turned_round("What is the most common arm of the Rhine?", arms, arms) is None
    # Capitalised, a direction is part of a name: "South America" does not turn "north" round.
    south = "Huguenot refugees settled in South Africa."
    assert turned_round("Where in the north did Huguenot refugees settle?", south, south) is None


def test_codes_and_versions_are_not_numbers_to_keep() -> None:
    # "EU-2" and "Q3" name things; a passage about the EU-2 outage that gives its length does not contradict "2".
    assert constraints("How long did the EU-2 outage in Q3 last?", "The EU-2 outage lasted 4 hours.") == 0.5


def test_quoted_names_in_the_question_must_be_in_the_passage() -> None:
    question = 'Who wrote "The Salt Road"?'
    assert constraints(question, "The Salt Road was written by Anna Berg.") == 1.0
    assert constraints(question, "The Iron Road was written by Anna Berg.") == 0.25


def test_the_evidence_scorer_prefers_the_passage_that_holds_the_kind_asked() -> None:
    scorer = EvidenceScorer(corpus=[BRIDGE_DATE, BRIDGE_LENGTH, "Farrow is a town on the Lune estuary."])
    question = "How long is the Kestrel Bridge in Farrow?"
    rows = scorer.features(question, [BRIDGE_DATE, BRIDGE_LENGTH])
    kind = FEATURES.index("answer_type")
    assert rows[0, kind] == 0.0 and rows[1, kind] == 1.0
    date_score, length_score = scorer.score_texts(question, [BRIDGE_DATE, BRIDGE_LENGTH])
    assert length_score > date_score


def test_a_claim_is_not_turned_round_by_the_passage_that_refutes_it() -> None:
    # The passage that says the opposite of a claim is the evidence a user checking the claim needs.
    sentence = "Folic acid supplements lowered the rate of kidney disease."
    assert turned_round("Folic acid supplements do not lower the rate of kidney disease.", sentence, sentence) is None
    assert turned_round("Which supplements do not lower the rate of kidney disease?", sentence, sentence)
    # A claim's "which" or "when" opens a clause; it does not make the claim a question.
    claim = "Folic acid, which is a vitamin, does not lower the rate of kidney disease when taken daily."
    assert turned_round(claim, sentence, sentence) is None
    assert turned_round("Folic acid starred in what film that is not a comedy", sentence, sentence)


def test_the_evidence_scorer_grades_down_a_passage_that_turns_the_question_round() -> None:
    scorer = EvidenceScorer(corpus=[COMMITTEES, "Parliament meets in Edinburgh.", "Committees meet weekly."])
    negated = "Which committees do not reflect the balance of parties across Parliament?"
    plain = "Which committees reflect the balance of parties across Parliament?"
    turned = FEATURES.index("turned_round")
    assert scorer.features(negated, [COMMITTEES])[0, turned] == 1.0
    assert scorer.features(plain, [COMMITTEES])[0, turned] == 0.0
    logits = [math.log(p / (1 - p)) for p in (scorer.score_texts(q, [COMMITTEES])[0] for q in (negated, plain))]
    assert logits[0] < logits[1] - 2.0  # the shipped weight of turned_round, not a rounding of the others


def test_the_explanation_says_what_turns_the_question_round() -> None:
    scorer = EvidenceScorer(corpus=[COMMITTEES, "Parliament meets in Edinburgh.", "Committees meet weekly."])
    negated = "Which committees do not reflect the balance of parties across Parliament?"
    turned, kept = (scorer.explain(q, [COMMITTEES])[0] for q in (negated, negated.replace(" not", "")))
    assert turned["turned_round"] == "the question is negated and its passage states it"
    assert turned["features"]["turned_round"] == 1.0 and turned["contributions"]["turned_round"] < -2.0
    assert kept["turned_round"] is None and kept["features"]["turned_round"] == 0.0
    lower = "Antibody production is lower in winter than in summer."
    higher = scorer.explain("When is antibody production higher?", [lower])[0]
    assert higher["turned_round"] == 'the question says "higher", its passage says "lower"'


@pytest.mark.parametrize(
    "question",
    [
        "What happens without sleep?",  # no option: a word
        "Who wrote it without help?",
        "How far is Rio de Janeiro from Sao Paulo without traffic?",
        "Which hyphen-minus rules apply when no dash is given?",
        "What is the e-mail address of the support desk?",
    ],
)
def test_leaving_out_something_that_is_not_an_option_asks_no_default(question: str) -> None:
    assert asked_kinds(question) != frozenset({"default"})


@pytest.mark.parametrize(
    "sentence",
    [
        "Fast mode (the default) does not wait for clients to disconnect.",
        "B-trees use a default fillfactor of 90, but any integer value from 10 to 100 can be selected.",
        "The default value is replica.",
        "NOLOGIN is the default, except when CREATE ROLE is invoked as CREATE USER.",
    ],
)
def test_a_default_stated_as_manuals_state_it_answers_a_default_question(sentence: str) -> None:
    kinds = asked_kinds("What is the default value of the setting?")
    assert kinds == frozenset({"default"}) and holds_kind(kinds, sentence, "What is the default value of the setting?")


@pytest.mark.parametrize(
    ("question", "file"),
    [
        ("Which file maps user names to roles?", True),
        ("What configuration file does ALTER SYSTEM write to?", True),
        ("For a restore, which file do I create in the data directory?", True),
        ("Which files are large?", False),  # asks about files, not for one
        ("What does the file hold?", False),
        ("What file format does pg_dump write by default?", False),  # a format, not a file
        ("Which file system should the WAL live on?", False),
        ("Which file name does the server write its PID to?", True),
    ],
)  # fmt: skip
def test_a_question_for_a_file_is_answered_where_a_file_is_named(question: str, file: bool) -> None:
    kinds = asked_kinds(question)
    assert (kinds == frozenset({"file"})) is file
    if file:
        assert holds_kind(kinds, "Maps are defined in the ident map file, named pg_ident.conf by default.", question)
        assert holds_kind(kinds, "Create a file recovery.signal in the data directory.", question)
        assert not holds_kind(kinds, "A user name map can be applied, e.g. to map names; see Section 25.3.", question)


def test_a_default_question_is_not_answered_by_the_word_default_alone() -> None:
    kinds = asked_kinds("What is the default value of the setting?")
    for sentence in [
        "A default fillfactor can be lowered for tables that see many updates.",
        "The default of this setting depends on the platform.",  # says what it depends on, not what it is
        "A value of 0 selects the operating system's default.",
    ]:
        assert not holds_kind(kinds, sentence, "What is the default value of the setting?"), sentence
