"""Evidence scorer: a learned combination of semantic, lexical and answer-type evidence (the offline default)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from llama_index.core.base.embeddings.base import BaseEmbedding
from numpy.typing import ArrayLike
from rapidfuzz import process
from rapidfuzz.distance import DamerauLevenshtein

from llama_index_crag.errors import ConfigError
from llama_index_crag.scorers.answer_type import answer_type, constraints, turned_round
from llama_index_crag.scorers.base import RelevanceScorer, finite_numbers, fit_logistic, sigmoid
from llama_index_crag.scorers.bi_encoder import LONG_WARNING_START, BiEncoderScorer
from llama_index_crag.text.split import split_sentences, terms

FEATURES = (
    "cosine",
    "coverage",
    "sentence_coverage",
    "rare_coverage",
    "bigram_coverage",
    "answer_type",
    "constraints",
    "turned_round",
    "cosine_lift",
    "coverage_lift",
    "sentence_coverage_lift",
)
#: The features that need no embedding and no other passage: what the answer step reads of a strip (``word_features``).
WORD_FEATURES = FEATURES[1:8]
#: Features added since calibration files were first written. A file fitted without one weighs it 0, which is
#: the model it was fitted as, so an older calibration still loads and scores as it did.
ADDED_FEATURES = ("turned_round",)
#: The features whose lift over the other candidates of the same batch is a feature too.
_LIFTED = (0, 1, 2)

#: The shortest word stem read as a possible misspelling of a passage's word one edit away ("kelven", "kalven").
MISSPELT_MIN_LENGTH = 6


def idf(size: int, document_frequency: int) -> float:
    """A word's inverse document frequency in a corpus of ``size`` texts, ``document_frequency`` of which hold it."""
    return math.log((size + 1) / (document_frequency + 0.5))


class EvidenceScorer(RelevanceScorer):
    """Judges whether a passage holds what the query asks, from evidence a small model can see.

    Eleven features per (query, passage): bi-encoder cosine (bundled MiniLM); the share of
    the query's content words (weighted by corpus IDF) found in the passage, in its best
    single sentence, and among the query's rare words (a word the corpus never uses is
    found where a passage spells it out, "CEO", or spells it one edit away, a misspelt
    "Kelven" for "Kalven"); query bigrams found in the passage; whether the passage
    holds the kind of answer the question asks for (a length for "how long is", a
    duration for "how long did it last", a year, a date, a count, an amount, a
    percentage, a person rather than an organisation, a place) and whether it keeps the
    question's years, numbers and quoted names or contradicts them with near values;
    whether the passage turns the question round (a negated question whose best
    sentence negates nothing, an opposite word: ``scorers/answer_type.py``); and, for
    the cosine and the two word shares, the passage's lead over the mean of the other
    candidates scored with it (the passage that answers stands out from the rest of
    what retrieval found; when the answer is not in the index, nothing does). A
    logistic model combines them. A passage scored alone has no lead (zero), so score
    a retrieval's candidates together, as the grader does. The weights are learned by
    ``llama-crag calibrate`` on a labelled set of the user's own data and stored in the
    calibration file; the defaults were fitted on the design halves of three public sets,
    see docs/grading.md.

    Normalisation: the logistic model's probability that the passage is relevant.

    Args:
        embed_model: The embedding model for the cosine feature (bundled MiniLM by default).
        weights: One weight per feature in ``FEATURES`` order, then the bias.
        corpus: Texts whose document frequencies give the IDF weights; without one,
            every word weighs the same until ``fit_corpus`` is called.
    """

    normalization = "logistic-model probability over eleven evidence features"
    feature_names: Tuple[str, ...] = FEATURES
    #: Fitted on the design halves of the three shared sets, each counting the same (the check halves are only
    #: ever measured): ``llama-crag calibrate --dataset squad2 --dataset clapnq --dataset scifact --split design
    #: --target-precision 0.65 --max-false-reject 0.05`` (docs/grading.md). Calibrate on your own data.
    DEFAULT_WEIGHTS = (
        6.263163,
        2.710833,
        1.530757,
        0.266736,
        -0.064353,
        -0.280078,
        -0.65874,
        -3.153329,
        4.136565,
        1.708225,
        0.722885,
        -5.730242,
    )
    #: The same fit's thresholds: ``lower`` leaves at most 5% of the batches that hold the answer under it;
    #: ``upper`` is where 65% of the batches graded CORRECT hold it, so that CORRECT, the branch that adds no
    #: cost, holds 79 to 91% of the answering batches of each design half (at 75% it held 44 to 73% and the
    #: median SQuAD query paid for refinement; 90% is met on no SQuAD threshold: on-topic passages without
    #: the answer score as high there); the strip threshold best separates the strips that hold the answer
    #: in the same questions' gold passages.
    DEFAULT_THRESHOLDS = {"upper": 0.783669, "lower": 0.499077, "strip_threshold": 0.319893}
    #: What a typical non-answering candidate's cosine, coverage and best-sentence coverage are (fitted with
    #: the weights): a lone candidate's lead is measured against it.
    DEFAULT_RIVAL_MEANS = (0.366333, 0.204611, 0.176753)

    def __init__(
        self,
        embed_model: Optional[BaseEmbedding] = None,
        weights: Optional[Sequence[float]] = None,
        corpus: Optional[Iterable[str]] = None,
    ) -> None:
        self.bi_encoder: BiEncoderScorer = BiEncoderScorer(embed_model)
        self.name = self.bi_encoder.name.replace("bi-encoder:", "evidence:", 1)
        self.weights = np.asarray(weights if weights is not None else self.DEFAULT_WEIGHTS, dtype=np.float64)
        names = self.feature_names
        if self.weights.shape != (len(names) + 1,):
            raise ValueError(f"{type(self).__name__} needs {len(names) + 1} weights ({', '.join(names)}, bias)")
        self.default_thresholds: Optional[Dict[str, float]] = (
            dict(self.DEFAULT_THRESHOLDS) if self.bi_encoder.default_thresholds is not None else None
        )
        self.rival_means = np.asarray(self.DEFAULT_RIVAL_MEANS, dtype=np.float64)
        self._idf: Mapping[str, float] = {}
        #: Passages of the corpus (``fit_corpus``, or the stats of an index folder) longer than the model's window.
        self.over_window: Optional[int] = None
        self._unseen_idf = 1.0
        self._rare_idf = math.inf
        if corpus is not None:
            self.fit_corpus(corpus)

    def fit_corpus(self, texts: Iterable[str]) -> EvidenceScorer:
        """Learn IDF weights from the corpus the engine searches, and count its passages longer than the embedding
        model's window (``over_window``: a warning on every trace when there are any)."""
        frequencies: Counter[str] = Counter()
        size = 0
        long: List[str] = []
        for text in texts:
            frequencies.update(set(terms(text)))
            size += 1
            if len(text) > self.bi_encoder.window.tokens:  # fewer characters hold fewer word pieces
                long.append(text)
        self.over_window = sum(self.bi_encoder.window.over(long)) if long else 0
        self.bi_encoder.note_long_passages(self.over_window)
        self._take_warnings()
        return self.use_idf({w: idf(size, c) for w, c in frequencies.items()}, size)

    def _take_warnings(self) -> None:
        """The bi-encoder's warning about passages longer than its window, among this scorer's own."""
        said = [w for w in self.bi_encoder.warnings if w.startswith(LONG_WARNING_START)]
        if said and not any(w.startswith(LONG_WARNING_START) for w in self.warnings):
            self.warnings = (*self.warnings, *said)

    def use_idf(self, weights: Mapping[str, float], size: int) -> EvidenceScorer:
        """Weigh words by ``weights`` (word to IDF, as ``idf`` computes it) for a corpus of ``size`` texts.

        ``weights`` may be any mapping: a store that looks words up as they are asked for
        (``llama_index_crag.stores.postgres.StoredIdf``) serves a corpus too large to hold in memory.
        """
        self._idf = weights
        self._unseen_idf = math.log(size + 1) if size else 1.0
        self._rare_idf = math.log((size + 1) / max(1.0, size / 50)) if size else math.inf
        return self

    def corpus_stats(self) -> Dict[str, Any]:
        """The IDF table ``fit_corpus`` learned, as JSON-ready data (``llama-crag ingest`` persists it)."""
        rare = None if math.isinf(self._rare_idf) else self._rare_idf
        stats: Dict[str, Any] = {"idf": {w: round(v, 6) for w, v in self._idf.items()}, "unseen": self._unseen_idf}
        stats["rare"] = rare
        if self.over_window is not None:
            stats["over_window"] = self.over_window
            stats["window"] = self.bi_encoder.window.tokens
        return stats

    def load_corpus_stats(self, stats: Mapping[str, Any]) -> EvidenceScorer:
        """Use an IDF table written by ``corpus_stats`` instead of reading the corpus again."""
        self._idf = {str(w): float(v) for w, v in stats["idf"].items()}
        self._unseen_idf = float(stats["unseen"])
        self._rare_idf = math.inf if stats["rare"] is None else float(stats["rare"])
        if stats.get("over_window") is not None:
            self.over_window = int(stats["over_window"])
            self.bi_encoder.note_long_passages(self.over_window)
            self._take_warnings()
        return self

    def _misspelt(self, query_terms: Iterable[str]) -> FrozenSet[str]:
        """Query words the corpus never uses, long enough to be a misspelling of one it does ("Kelven Report"
        where the documents say "Kalven Report"): such a word also counts as found where a passage has a word
        one edit (an insertion, a deletion, a substitution or two letters swapped) away from it."""
        return frozenset(
            t for t in query_terms if self._idf and t not in self._idf and len(t) >= MISSPELT_MIN_LENGTH and t.isalpha()
        )

    def _found(
        self, words: FrozenSet[str], tokens: Tuple[str, ...], expandable: FrozenSet[str], misspelt: FrozenSet[str]
    ) -> FrozenSet[str]:
        """The words of a passage (or sentence) the query's words are matched against, with the query's
        abbreviations and misspellings that it spells out or spells right."""
        if expandable:
            words = words | (expandable & _acronyms(tokens))
        if misspelt:
            words = words | {t for t in misspelt if _one_edit_from(t, words)}
        return words

    def _expandable(self, query_terms: Iterable[str]) -> FrozenSet[str]:
        """Query words the corpus never uses that may abbreviate words it does use ("CEO" where the documents
        say "chief executive officer"): such a word also counts as found where its expansion is."""
        return frozenset(
            t for t in query_terms if self._idf and t not in self._idf and 2 <= len(t) <= 5 and t.isalpha()
        )

    def features(self, query: str, texts: Sequence[str]) -> np.ndarray:
        """The ``FEATURES`` of each passage for ``query``, one row a passage."""
        return self._stack(query, texts, self._read_features(query, texts)[0])

    def word_features(self, query: str, texts: Sequence[str]) -> np.ndarray:
        """The ``WORD_FEATURES`` of each passage, one row a passage: what the answer step reads of each strip."""
        return self._own_features(query, texts, [0.0] * len(texts))[0][:, 1:]

    def _read_features(self, query: str, texts: Sequence[str]) -> Tuple[np.ndarray, List[Optional[str]]]:
        """``features``, and for each passage what turns the question round in it (``turned_round``), or None."""
        own, reasons = self._own_features(query, texts)
        return np.hstack([own, _lift(own[:, _LIFTED], self.rival_means)]), reasons

    def _own_features(
        self, query: str, texts: Sequence[str], cosines: Optional[Sequence[float]] = None
    ) -> Tuple[np.ndarray, List[Optional[str]]]:
        if cosines is None:
            cosines = self.bi_encoder.score_texts(query, texts) if texts else []
            if self.bi_encoder.long_passages:
                self._take_warnings()
        query_terms = set(terms(query))
        weight = {t: self._idf.get(t, self._unseen_idf) for t in query_terms}
        expandable, misspelt = self._expandable(query_terms), self._misspelt(query_terms)
        total = sum(weight.values()) or 1.0
        rare = {t for t, w in weight.items() if w >= self._rare_idf}
        q_tokens = terms(query)
        q_bigrams = set(zip(q_tokens, q_tokens[1:]))
        rows, reasons = [], []
        for text, cosine in zip(texts, cosines):
            view = _passage(text)
            words = self._found(view.words, view.tokens, expandable, misspelt)
            coverage = sum(w for t, w in weight.items() if t in words) / total
            best_sentence, best, tied = text, -1.0, []
            for sentence, sentence_words, sentence_tokens in view.sentences:
                sentence_words = self._found(sentence_words, sentence_tokens, expandable, misspelt)
                found = sum(w for t, w in weight.items() if t in sentence_words) / total
                if found > best + _TIE:
                    best_sentence, best, tied = sentence, found, [sentence]
                elif found >= best - _TIE:
                    tied.append(sentence)
            bigrams = len(q_bigrams & view.bigrams) / len(q_bigrams) if q_bigrams else 0.0
            rare_cov = len(rare & words) / len(rare) if rare else coverage
            reasons.append(turned_round_by_all(query, tied or [best_sentence], text))
            rows.append(
                [
                    cosine,
                    coverage,
                    max(best, 0.0),
                    rare_cov,
                    bigrams,
                    answer_type(query, best_sentence, text),
                    constraints(query, text),
                    0.0 if reasons[-1] is None else 1.0,
                ]
            )
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(FEATURES) - len(_LIFTED)), reasons

    def _stack(self, query: str, texts: Sequence[str], evidence: np.ndarray) -> np.ndarray:
        return evidence  # a scorer that adds features of its own to these (the reader) adds them here

    def score_texts(self, query: str, texts: Sequence[str]) -> List[float]:
        if not texts:
            return []
        logits = self.features(query, texts) @ self.weights[:-1] + self.weights[-1]
        return [sigmoid(float(v)) for v in logits]

    def explain(self, query: str, texts: Sequence[str]) -> List[Dict[str, Any]]:
        """Each passage's features, what each adds to the logit, and the query words it lacks.

        ``contributions`` are weight times value for each feature; with ``bias`` they sum to the logit whose
        sigmoid is ``score``. ``missing_terms`` are the query's content words (lower-cased, lightly stemmed) the
        passage does not contain, rarest in the corpus first: usually the first thing to read when a passage that
        looks right scored low. ``turned_round`` is what in the passage turns the question round, or None.
        """
        if not texts:
            return []
        evidence, reasons = self._read_features(query, texts)
        rows = self._stack(query, texts, evidence)
        query_terms = set(terms(query))
        expandable, misspelt = self._expandable(query_terms), self._misspelt(query_terms)
        rarest_first = sorted(query_terms, key=lambda t: (-self._idf.get(t, self._unseen_idf), t))
        explanations = []
        for text, row, reason in zip(texts, rows, reasons):
            view = _passage(text)
            words = self._found(view.words, view.tokens, expandable, misspelt)
            contributions = row * self.weights[:-1]
            explanations.append(
                {
                    "score": round(sigmoid(float(contributions.sum() + self.weights[-1])), 4),
                    "features": {name: round(float(v), 4) for name, v in zip(self.feature_names, row)},
                    "contributions": {name: round(float(v), 4) for name, v in zip(self.feature_names, contributions)},
                    "bias": round(float(self.weights[-1]), 4),
                    "missing_terms": [t for t in rarest_first if t not in words],
                    "turned_round": reason,
                }
            )
        return explanations

    def fit(self, features: np.ndarray, labels: ArrayLike, weights: Optional[ArrayLike] = None) -> EvidenceScorer:
        """Learn the weights from labelled (query, passage) features (relevant = True), and the typical rival
        (``weights``: one a row, as when several sets are fitted together and each must count the same)."""
        y = np.asarray(labels, dtype=bool)
        self.weights = fit_logistic(features, y, weights)
        if (~y).any():
            w = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=np.float64)
            self.rival_means = np.average(features[~y][:, _LIFTED], axis=0, weights=w[~y])
        return self

    def state(self) -> Dict[str, Any]:
        """The learned part, for the calibration file."""
        return {
            "features": list(self.feature_names),
            "weights": [round(float(w), 6) for w in self.weights],
            "rival_means": [round(float(v), 6) for v in self.rival_means],
        }

    def load_state(self, state: Mapping[str, Any]) -> EvidenceScorer:
        """Load weights written by ``state`` (refusing a different feature set, and numbers that are not finite:
        a NaN weight would score every passage 0, and the engine would abstain on everything)."""
        if not isinstance(state, Mapping) or "weights" not in state:
            raise ConfigError("the calibration's scorer_state holds no weights: calibrate again")
        self.weights = align_weights(state.get("features", []), state["weights"], self.feature_names)
        if "rival_means" in state:
            means = finite_numbers(state["rival_means"], "rival_means")
            if means.shape != np.shape(self.rival_means):
                raise ConfigError(
                    f"the calibration's rival_means has {means.size} values, not {np.size(self.rival_means)}"
                )
            self.rival_means = means
        return self


def align_weights(fitted_for: Sequence[str], weights: Sequence[float], names: Sequence[str]) -> np.ndarray:
    """Weights fitted for the features ``fitted_for`` (then the bias), laid out for ``names``.

    A feature of ``ADDED_FEATURES`` that the fit did not have weighs 0; any other
    difference in the features is refused, since the weights would mean something else.
    """
    fitted_for = list(fitted_for)
    values = finite_numbers(weights, "weights")
    expected = [n for n in names if n not in ADDED_FEATURES or n in fitted_for]
    if fitted_for != expected or len(values) != len(fitted_for) + 1:
        raise ConfigError(f"calibration weights are for features {fitted_for}, not {list(names)}")
    by_name = dict(zip(fitted_for, values))
    return np.asarray([by_name.get(n, 0.0) for n in names] + [values[-1]], dtype=np.float64)


def _lift(values: np.ndarray, rivals: np.ndarray) -> np.ndarray:
    """Each row's lead over the mean of the other rows; a lone candidate's lead over ``rivals``.

    The passage that holds the answer stands out from the rest of what retrieval
    found; when the answer is not in the index, the best candidate is just one of
    several on-topic look-alikes. The mean (not the max) of the others keeps a
    duplicated relevant passage from cancelling its twin out. A candidate with no
    rivals (``similarity_top_k=1``, a one-document index, a narrow filter) is compared
    with what a typical rival looks like instead (the mean of the non-answering
    candidates seen in calibration), not punished for standing alone.
    """
    n = len(values)
    if n < 2:
        return values - rivals
    return values - (values.sum(axis=0, keepdims=True) - values) / (n - 1)


@dataclass(frozen=True)
class _Passage:
    """What the features need of a passage, computed once per distinct text."""

    words: FrozenSet[str]
    bigrams: FrozenSet[Tuple[str, str]]
    sentences: Tuple[Tuple[str, FrozenSet[str], Tuple[str, ...]], ...]
    tokens: Tuple[str, ...]


#: Passages whose words are kept between calls: the ones retrieval keeps returning. About 40 KB each for a
#: 250-word abstract (measured on SciFact), so this bounds the cache near 160 MB.
PASSAGE_CACHE_SIZE = 4096


#: Two shares of the query's words closer than this are the same share.
_TIE = 1e-9


def turned_round_by_all(query: str, best_sentences: Sequence[str], passage: str) -> Optional[str]:
    """What turns the question round in ``passage`` (``turned_round``) when each of its sentences holding the most
    of the question's words does, else None. A long passage often has two such sentences ("The default GIN operator
    class for jsonb supports the key-exists operators", "The non-default class jsonb_path_ops does not support the
    key-exists operators"): the first alone says nothing of whether the passage answers "Which class cannot serve
    the key-exists operator?"."""
    first: Optional[str] = None
    for sentence in best_sentences:
        reason = turned_round(query, sentence, passage)
        if reason is None:
            return None
        first = first or reason
    return first


@lru_cache(maxsize=PASSAGE_CACHE_SIZE)
def _passage(text: str) -> _Passage:
    split = [s for s in split_sentences(text) if s.strip()] or [text]
    per_sentence = [terms(s) for s in split]
    # The sentences are consecutive slices of the text, so their words in order are the text's words.
    tokens = [t for words in per_sentence for t in words]
    return _Passage(
        words=frozenset(tokens),
        bigrams=frozenset(zip(tokens, tokens[1:])),
        sentences=tuple((s, frozenset(words), tuple(words)) for s, words in zip(split, per_sentence)),
        tokens=tuple(tokens),
    )


@lru_cache(maxsize=256)
def _acronyms(tokens: Tuple[str, ...]) -> FrozenSet[str]:
    """The initials of every run of 2 to 5 consecutive content words ("chief executive officer" gives "ceo")."""
    initials = "".join(t[0] for t in tokens)
    return frozenset(initials[i : i + n] for n in range(2, 6) for i in range(len(initials) - n + 1))


def _one_edit_from(term: str, words: FrozenSet[str]) -> bool:
    """Whether one of ``words`` is at most one edit from ``term`` (Damerau-Levenshtein)."""
    return process.extractOne(term, words, scorer=DamerauLevenshtein.distance, score_cutoff=1) is not None
