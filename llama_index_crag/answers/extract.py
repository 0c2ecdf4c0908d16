"""The answer step: the strips of the context that answer the question, quoted verbatim with their sources.

Which strips answer is a learned model's call, not a stack of hand rules; nothing is generated. The
model (first in this module) is a small neural network over features of one (question, strip) pair:
the evidence scorer's word features of the strip (the question's words it holds, weighted by the
corpus's IDF, its bigrams, the kind of answer it holds, the question's figures it keeps or contradicts),
and what a quote needs besides (whether the question asks for a kind of answer and the strip holds
one, whether it states the question's codes and names, whether it refers back, how long it is,
whether it is a question itself). The network is trained on human-labelled sentence pairs
(``llama-crag train-answers``; the packaged one on QNLI, SQuAD 2.0 and HotpotQA sentences, with
negatives made by swapping the figure or name a question asks about), so what it weighs was learned,
not written while reading evaluation rows. It reads words, not embeddings, so a strip costs
microseconds: the answer step adds no model call to a query, on any path.

``EvidenceQuoter`` (below the model) is the step the loop calls: it breaks the kept passages into
strips, asks the model which answer, and quotes those it is sure enough of, with their sources.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from llama_index.core.schema import NodeWithScore

from llama_index_crag.errors import ConfigError
from llama_index_crag.presets import QUOTE_PRESETS, QuoteRule
from llama_index_crag.scorers.answer_type import asked_kinds, asking_sentence, asks, holds_kind, strict_kind
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.scorers.bi_encoder import bi_encoder_of
from llama_index_crag.scorers.evidence import WORD_FEATURES, EvidenceScorer
from llama_index_crag.text.headings import heading
from llama_index_crag.text.patterns import (
    CODE_SUFFIX,
    FIGURES_AND_CODES,
    IDENTIFIER,
    NAME,
    NOT_NAMES,
    NUMBER_RANGE,
    STATED_DEFAULT,
    UNIT_GAP,
)
from llama_index_crag.text.strips import Strip, decompose, kept_strips, refers_back

# ----------------------------------------------------------------------------------------------------
# The answer model: features of a (question, strip) pair, and the network that reads them.
# ----------------------------------------------------------------------------------------------------

#: The features, in the order the network reads them.
ANSWER_FEATURES = (
    *WORD_FEATURES,
    "asks_kind",
    "holds_kind",
    "codes_stated",
    "names_stated",
    "refers_back",
    "log_words",
    "is_question",
    "is_claim",
)
#: What the ranker reads besides ``ANSWER_FEATURES``: how far each strip leads the best of the other strips on the
#: question's words (``leads``). Which sentence of a right passage answers is told by what it holds that its
#: neighbours do not; whether any sentence answers is not, so only the ranking reads these.
RANK_FEATURES = ("coverage_lead", "sentence_coverage_lead", "rare_coverage_lead", "bigram_coverage_lead")
#: How far below the lower threshold and above the upper one a grade still moves the quote threshold, in bands.
PLACE_RANGE = (-1.0, 2.0)
#: Where the packaged network lives, with its checksum and NOTICE.
PACKAGED_DIR = Path(__file__).resolve().parent.parent / "data" / "answer_model"
WEIGHTS_FILE = "answer_model.npz"
META_FILE = "answer_model.json"


@dataclass(frozen=True)
class Candidate:
    """One strip the answer step may quote: its text, the text it is graded as (with the subject it refers back
    to), and what its passage said before it (its title and text up to the strip's end)."""

    text: str
    graded_text: str
    said_before: str = ""
    #: The last heading above the strip in its passage (a section's title, or a definition-list term as the
    #: readers write it: "vacuum_freeze_min_age (integer)"); "" when none.
    entry: str = ""


def asked_names(question: str) -> List[str]:
    """The names ``question`` asks about, casefolded: its capitalised words but the first, and not an owner.

    An owner ("Scotland's voting population") is the frame of the question, often the whole document's subject,
    and a passage may write it another way ("Scottish") or leave it unsaid."""
    rest = question.strip().split(None, 1)[1:]
    found = (n.casefold() for n in NAME.findall(rest[0] if rest else "") if not re.search(r"['’]s?$", n))
    return list(dict.fromkeys(n for n in found if n not in NOT_NAMES))


def states_codes(question: str, text: str) -> bool:
    """Whether ``text`` states every figure or code ``question`` names ("Q2 2023", "EU-2", "7.2.1").

    A number may stand apart from its unit ("40 mg" states "40mg"), a code may be written with or without its
    hyphens ("SHP-2" and "SHP2") and without a word that only describes it ("SF1" states "SF1-expressing"), and a
    range of numbers is stated when both of its ends are ("76-85%" by "76.3% to 85.4%")."""
    lowered = UNIT_GAP.sub("", text.casefold())
    for code in FIGURES_AND_CODES.findall(question.casefold()):
        if NUMBER_RANGE.fullmatch(code):
            if not all(end in lowered for end in code.split("-")):
                return False
        elif not _states_code(code, lowered):
            return False
    return True


def _states_code(code: str, text: str) -> bool:
    """Whether casefolded ``text`` states ``code`` as written, or as a word of its own with its hyphens moved
    and without a describing suffix ("gata-3" states "gata3"; "ap-1" does not state "p1")."""
    if code in text:
        return True
    core = CODE_SUFFIX.sub("", code).replace("-", "")
    return bool(core) and re.search(r"(?<![^\W_])" + "-?".join(map(re.escape, core)), text) is not None


def answer_features(question: str, candidates: Sequence[Candidate], scorer: EvidenceScorer) -> np.ndarray:
    """``ANSWER_FEATURES`` of each candidate for ``question``, one row a candidate: words, kinds and figures
    only, so that reading a strip costs microseconds and no embedding."""
    if not candidates:
        return np.zeros((0, len(ANSWER_FEATURES)))
    words = scorer.word_features(question, [c.graded_text for c in candidates])
    kinds = asked_kinds(question)
    names = asked_names(question)
    claim = not asks(question)
    rows = []
    for candidate in candidates:
        said = f"{candidate.said_before} {candidate.graded_text}".casefold()
        named = sum(1 for n in names if n in said) / len(names) if names else 1.0
        length = len(candidate.text.split())
        rows.append(
            [
                0.0 if kinds is None else 1.0,
                1.0 if kinds is not None and holds_kind(kinds, candidate.graded_text, question) else 0.0,
                1.0 if states_codes(question, said) else 0.0,
                named,
                1.0 if refers_back(candidate.text) else 0.0,
                math.log1p(length),
                1.0 if candidate.text.rstrip().endswith("?") else 0.0,
                1.0 if claim else 0.0,
            ]
        )
    return np.hstack([words, np.asarray(rows, dtype=np.float64)])


@lru_cache(maxsize=4096)
def asked_identifiers(question: str) -> Tuple[str, ...]:
    """The software identifiers ``question`` asks about (``IDENTIFIER``: "checkpoint_segments", "--strict-names"),
    each once, in question order; read once a question, however many strips are weighed against them. Only its
    ``asking_sentence`` counts: "app_user" in "I ran CREATE ROLE app_user and now it can't log in. Which login
    attribute ...?" is the user's own name, which no page of the documents holds."""
    return tuple(dict.fromkeys(IDENTIFIER.findall(asking_sentence(question))))


def unnamed_identifiers(question: str, candidates: Sequence[Candidate]) -> List[str]:
    """The software identifiers ``question`` names ("checkpoint_segments", "--strict-names": ``IDENTIFIER``)
    that none of the candidates' passages names, in question order.

    When there is one, no strip of them answers the question, however probable the network finds it: the strip
    answers a near miss (a neighbouring setting's default for a setting the documents do not have). The whole
    context is searched, not each strip's own passage, because documentation states one object's facts under a
    sibling's name ("pg_stat_user_tables: same as pg_stat_all_tables"). Names, figures and codes stay inputs the
    network weighs (a country may be named another way); an identifier is written one way only."""
    identifiers = asked_identifiers(question)
    if not identifiers:
        return []
    context = " ".join(f"{c.said_before} {c.graded_text}" for c in candidates).casefold()
    return [i for i in identifiers if i.casefold() not in context]


def entry_above(passage: str, end: int) -> str:
    """The last heading of ``passage`` before ``end`` (its title, marks left out), or "": a heading as the chunker
    reads it (``text.headings.heading``), so that a comment line of a script is no entry here either."""
    lines = passage.split("\n")
    found, at = "", 0
    for i, line in enumerate(lines):
        if at >= end:
            break
        at += len(line) + 1
        title = heading(line, lines[i - 1] if i else None, lines[i + 1] if i + 1 < len(lines) else None)
        found = title[1] if title else found
    return found


def other_entry(question: str, candidate: Candidate) -> Optional[str]:
    """The heading of the entry ``candidate`` stands in, when that entry is another identifier's than the ones
    ``question`` names; else None.

    Reference pages describe one setting, option or function an entry (a heading or a definition-list term:
    "vacuum_freeze_min_age (integer)"), and the entries beside it read alike: "The default is 50 million
    transactions." under vacuum_freeze_min_age is no answer to "autovacuum_freeze_max_age default value?", even
    where it names autovacuum_freeze_max_age ("... half the value of autovacuum_freeze_max_age"). The entry is the
    last heading of the passage above the strip (``entry_above``); one that names no identifier of a form the
    question names (a section's title; an option's entry for a question about its program) says nothing."""
    asked = [i.casefold() for i in asked_identifiers(question)]
    entry = candidate.entry
    if not asked or not entry:
        return None
    forms = {_form(i) for i in asked}
    named = [i for i in IDENTIFIER.findall(entry) if _form(i) in forms]
    if not named or any(i in entry.casefold() for i in asked):
        return None
    return entry


def _form(identifier: str) -> str:
    """An identifier's form: a long option, or a name. A question that names a program ("pg_ctl") is answered in
    the entries of its options ("-m mode --mode=mode"), which are not another program's."""
    return "option" if identifier.startswith("--") else "name"


def states_no_default(question: str, candidate: Candidate) -> bool:
    """Whether ``question`` asks for a default ("What is the default value of work_mem?") and ``candidate``
    states none: "autovacuum_vacuum_scale_factor (floating point) Specifies a fraction of the table size ..."
    names the setting and answers something else. A default is stated in a few set ways (``STATED_DEFAULT``:
    "The default is 0.2", "defaults to", "(default 100)", "... is the default", "... by default")."""
    return strict_kind(question) == "default" and not STATED_DEFAULT.search(candidate.text)


def names_no_file(question: str, candidate: Candidate) -> bool:
    """Whether ``question`` asks for a file ("Which file maps user names to roles?") and ``candidate`` names none
    besides the question's own: "a user name map can be applied to map the operating system user name" is about
    the thing, and only a strip that names the file ("... named pg_ident.conf") answers."""
    return strict_kind(question) == "file" and not holds_kind(frozenset({"file"}), candidate.text, question)


def leads(features: np.ndarray) -> np.ndarray:
    """``RANK_FEATURES`` of each row of ``features`` (``ANSWER_FEATURES`` of one question's candidates): its
    coverage figures less the highest of the other rows' (0 for a lone row, and for rows that tie at the top)."""
    words = np.asarray(features, dtype=np.float64)[:, : len(RANK_FEATURES)]
    if len(words) < 2:
        return np.zeros_like(words)
    ordered = np.sort(words, axis=0)
    top, second = ordered[-1], ordered[-2]
    others = np.where(words == top, second, top)
    return words - others


def evidence_place(grade: Optional[float], upper: float, lower: float) -> Optional[float]:
    """Where the grader's grade of the evidence sits between its two thresholds: 0 at ``lower``, 1 at ``upper``
    (clipped to ``PLACE_RANGE``), so that a decision fitted on one scorer's grades reads another's; None without a
    grade."""
    if grade is None:
        return None
    place = (float(grade) - lower) / (upper - lower) if upper > lower else (1.0 if grade >= upper else 0.0)
    return min(max(place, PLACE_RANGE[0]), PLACE_RANGE[1])


@dataclass(frozen=True)
class QuoteDecision:
    """When the best strip is quoted: its probability must reach a threshold that falls as the grader's grade of
    its evidence rises, ``sigmoid(bias - grade_weight * place)`` (``place`` from ``evidence_place``), and never
    falls under ``floor``.

    One stacked decision over the two things the engine knows of an answer, the passage's grade and the strip's
    probability: a strip of a passage graded well above ``upper`` is quoted at a low probability (but not under
    ``floor``), one of a passage graded near ``lower`` must show much more. Its three numbers are fitted on the
    design halves of the development sets (``benchmarks/quote_threshold.py``); evidence of unknown grade is read at
    the lower threshold (place 0).
    """

    grade_weight: float
    bias: float
    floor: float = 0.0

    def threshold(self, place: Optional[float]) -> float:
        """The probability the best strip needs, for evidence at ``place``."""
        return float(self.thresholds(np.asarray([0.0 if place is None else place]))[0])

    def thresholds(self, places: np.ndarray) -> np.ndarray:
        """``threshold`` at each of ``places`` at once (replaying the decision on evaluation rows)."""
        logits = np.clip(self.bias - self.grade_weight * places, -40.0, 40.0)
        return np.maximum(self.floor, 1.0 / (1.0 + np.exp(-logits)))

    @classmethod
    def constant(cls, threshold: float) -> QuoteDecision:
        """The same threshold whatever the grade (``quote_threshold``, ``train-answers --threshold``)."""
        if not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"a quote threshold is a probability, from 0 to 1, got {threshold}")
        clipped = min(max(threshold, 1e-12), 1.0 - 1e-12)
        return cls(0.0, math.log(clipped / (1.0 - clipped)))

    def to_dict(self) -> Dict[str, float]:
        """As stored in the model's metadata."""
        return {"grade_weight": self.grade_weight, "bias": self.bias, "floor": self.floor}


_LAYERS = ("mean", "scale", "w1", "b1", "w2", "b2")
#: The ranker's arrays are stored beside the network's, under this prefix.
RANKER = "rank_"


class AnswerModel:
    """A one-hidden-layer network from ``ANSWER_FEATURES`` to the probability that a strip answers the question,
    and optionally a second one, the ranker, that also reads how each strip leads the others (``RANK_FEATURES``).

    The probability decides whether anything is quoted (``decision``); the ranker only orders the strips that
    pass: read against its neighbours, a sentence that holds what they do not is told apart from them better than
    read alone, but the best of a batch of wrong sentences leads its neighbours too, so the lead says nothing of
    whether the batch answers at all (``llama-crag train-answers`` reports both).

    Args:
        parameters: ``mean`` and ``scale`` (feature standardisation), ``w1``, ``b1`` (hidden layer, ReLU),
            ``w2``, ``b2`` (output logit); the ranker's the same, prefixed ``rank_``.
        info: What it was trained on and how it measured (held-out AUROC by source).
    """

    def __init__(self, parameters: Mapping[str, np.ndarray], info: Optional[Dict[str, Any]] = None) -> None:
        self.parameters = {k: np.asarray(parameters[k], dtype=np.float64) for k in _LAYERS}
        _check_width(self.parameters, len(ANSWER_FEATURES))
        self.ranker: Optional[Dict[str, np.ndarray]] = None
        if all(RANKER + k in parameters for k in _LAYERS):
            self.ranker = {k: np.asarray(parameters[RANKER + k], dtype=np.float64) for k in _LAYERS}
            _check_width(self.ranker, len(ANSWER_FEATURES) + len(RANK_FEATURES))
        self.info = dict(info or {})

    @property
    def decision(self) -> QuoteDecision:
        """When a strip is quoted (``QuoteDecision``): the model's own, fitted on the development sets' design
        halves; for a folder ``train-answers`` wrote before decisions, its threshold (the strictest of its verdicts'),
        whatever the grade; else 0.5."""
        chosen = self.info.get("decision")
        if isinstance(chosen, Mapping):
            return QuoteDecision(float(chosen["grade_weight"]), float(chosen["bias"]), float(chosen.get("floor", 0.0)))
        older = self.info.get("thresholds")
        if isinstance(older, Mapping) and older:
            return QuoteDecision.constant(max(float(v) for v in older.values()))
        return QuoteDecision.constant(0.5)

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """The probability that each row's strip answers its question."""
        return _forward(self.parameters, features)

    def ranks(self, features: np.ndarray, probabilities: Optional[np.ndarray] = None) -> np.ndarray:
        """The order in which one question's candidates (the rows of ``features``) are quoted, as a score (higher
        first): the mean of each strip's probability and the ranker's reading of it against the others; the
        probability alone for a model without a ranker."""
        alone = self.probabilities(features) if probabilities is None else np.asarray(probabilities)
        if self.ranker is None or len(features) == 0:
            return alone
        return (alone + self.read_against(features)) / 2.0

    def read_against(self, features: np.ndarray, lead: Optional[np.ndarray] = None) -> np.ndarray:
        """The ranker's probability that each row's strip answers, read with how it leads the others (``lead``:
        ``RANK_FEATURES``, by default ``leads(features)``, every row one question's candidate)."""
        if self.ranker is None:
            raise ConfigError("this answer model has no ranker: train it again (llama-crag train-answers)")
        return _forward(self.ranker, np.hstack([features, leads(features) if lead is None else lead]))

    def save(self, folder: Path | str) -> None:
        """Write the network and its metadata (with the weights' checksum) to ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        arrays: Dict[str, Any] = {k: v.astype(np.float32) for k, v in self.parameters.items()}
        arrays.update({RANKER + k: v.astype(np.float32) for k, v in (self.ranker or {}).items()})
        np.savez(folder / WEIGHTS_FILE, **arrays)
        meta = {**self.info, "features": list(ANSWER_FEATURES), "sha256": _sha256(folder / WEIGHTS_FILE)}
        if self.ranker is not None:
            meta["rank_features"] = list(RANK_FEATURES)
        (folder / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, folder: Path | str) -> AnswerModel:
        """The network saved in ``folder``, its checksum and features checked."""
        folder = Path(folder)
        try:
            meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{folder} holds no readable answer model ({META_FILE}): {exc}") from exc
        weights = folder / WEIGHTS_FILE
        if not weights.is_file() or _sha256(weights) != meta.get("sha256"):
            raise ConfigError(f"{weights} is missing or does not match its checksum in {META_FILE}: reinstall it")
        if meta.get("features") != list(ANSWER_FEATURES):
            raise ConfigError(f"the answer model in {folder} reads other features: train it again")
        with np.load(weights) as data:
            arrays = {k: data[k] for k in data.files}
        if any(k.startswith(RANKER) for k in arrays) and meta.get("rank_features") != list(RANK_FEATURES):
            raise ConfigError(f"the answer model's ranker in {folder} reads other features: train it again")
        return cls(arrays, meta)


@lru_cache(maxsize=1)
def packaged_answer_model() -> AnswerModel:
    """The network that ships in the package (trained on human-labelled sentence pairs; see its NOTICE)."""
    return AnswerModel.load(PACKAGED_DIR)


def _forward(p: Mapping[str, np.ndarray], features: np.ndarray) -> np.ndarray:
    hidden = np.maximum(0.0, ((features - p["mean"]) / p["scale"]) @ p["w1"] + p["b1"])
    logits = (hidden @ p["w2"]).reshape(-1) + p["b2"].reshape(-1)[0]
    return 1.0 / (1.0 + np.exp(-np.clip(logits, -40.0, 40.0)))


def _check_width(p: Mapping[str, np.ndarray], width: int) -> None:
    if p["w1"].shape[0] != width:
        raise ConfigError(
            f"the answer model reads {p['w1'].shape[0]} features, not the {width} this version computes: "
            "train it again (llama-crag train-answers)"
        )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------------------------------
# The quoted answer: the strips the model says answer, verbatim, with their sources.
# ----------------------------------------------------------------------------------------------------


def source_name(node: NodeWithScore) -> str:
    """A short name for where a passage comes from: its file name or title, and its document id."""
    meta = node.node.metadata
    name = shown_value(meta.get("file_name") or meta.get("title"))
    doc_id = shown_value(meta.get("doc_id") or node.node.ref_doc_id or node.node.node_id.split("#strips")[0])
    if meta.get("url"):
        name = f"{name}, {shown_value(meta['url'])}" if name else shown_value(meta["url"])
    return f"{name}, {doc_id}" if name and doc_id and doc_id not in name else str(name or doc_id)


def shown_value(value: Any) -> str:
    """A metadata value as a reader sees it: a database may give a number, a list of authors or nothing."""
    if isinstance(value, (list, tuple)):
        return ", ".join(part for part in map(shown_value, value) if part)
    return "" if value is None else str(value)


#: The line that opens every quoted answer, so that nobody reads it as generated text.
QUOTED_HEADER = "Quoted from the documents (not generated):"


@dataclass(frozen=True)
class Quote:
    """One quoted strip: its text as it stands in the source, where it comes from, and its grade."""

    text: str
    source: str
    node_id: str
    score: float
    #: The entry the strip stands in, when the strip does not say it: the heading above it on its page ("The
    #: default is 30 seconds." under "max_standby_streaming_delay (integer)"); "" otherwise.
    entry: str = ""

    @property
    def cited(self) -> str:
        """Where the quote comes from, as the answer says it: its source, and the entry it stands in."""
        return f"{self.source}, under {self.entry}" if self.entry else self.source


@dataclass(frozen=True)
class QuotedAnswer:
    """The quotes of an extractive answer, in document order.

    ``grade`` is the answer model's probability that the best strip answers the question
    (None when the context held no strip); ``threshold`` the probability a strip needed,
    given ``evidence``, where the grader's grade of the passages sat between its
    thresholds (0 at lower, 1 at upper; None when not given); ``withheld`` holds the best
    strip when it fell under the threshold, or when ``unnamed`` holds identifiers the question names and no
    passage does (``unnamed_identifiers``), and nothing was quoted; ``set_aside`` up to three strips
    that could not answer whatever their probability (``set_aside_why``), each with ``text`` and ``why``;
    ``elsewhere`` the identifiers the question names when nothing was quoted and a strip was set aside for standing
    in another identifier's entry: the passages are the asked one's neighbours, and its own entry is to be searched
    for by name.
    """

    quotes: List[Quote]
    grade: Optional[float] = None
    withheld: List[Quote] = field(default_factory=list)
    threshold: float = 0.0
    evidence: Optional[float] = None
    unnamed: List[str] = field(default_factory=list)
    set_aside: List[Dict[str, str]] = field(default_factory=list)
    elsewhere: List[str] = field(default_factory=list)
    set_aside_kinds: List[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The answer as a reader sees it: a header, then each quote with its source."""
        if not self.quotes:
            return ""
        lines = [f'"{q.text}" ({q.cited})' for q in self.quotes]
        return "\n".join([QUOTED_HEADER, *lines])

    @property
    def all_set_aside_for(self) -> FrozenSet[str]:
        """When nothing was quoted because every strip that could answer was set aside, the kinds of why
        (``SetAside.kind``); else empty."""
        return frozenset(self.set_aside_kinds) if not self.quotes and not self.withheld else frozenset()

    def why_withheld(self) -> str:
        """Why the best strip was withheld, as the trace says it: the identifiers no passage names, else its
        probability under the threshold."""
        if self.unnamed:
            return (
                f"the passages do not name {', '.join(self.unnamed)}, which the question asks about, so the answer "
                f"model's best strip ({self.grade:.3f}) answers something else"
            )
        if self.set_aside and not self.withheld:
            return f"every strip that could answer was set aside ({self.set_aside[0]['why']})"
        return f"the answer model gives its best strip {self.grade:.3f}, under the quote threshold {self.threshold:.3f}"

    def to_list(self) -> List[Dict[str, Any]]:
        """The quotes as JSON-ready dicts (for the trace)."""
        return [asdict(q) for q in self.quotes]

    def check(self) -> Optional[Dict[str, Any]]:
        """The answer step's check for the trace: the best strip's probability, the threshold it needed at the
        evidence's place, the question's identifiers no passage names, what was withheld and what set aside."""
        if self.grade is None and not self.set_aside:
            return None
        return {
            "grade": self.grade,
            "threshold": self.threshold,
            "evidence_place": self.evidence,
            "passed": not self.withheld,
            "unnamed": list(self.unnamed),
            "withheld": [asdict(q) for q in self.withheld],
            "set_aside": list(self.set_aside),
            "elsewhere": list(self.elsewhere),
        }


def quoted(strip: Strip) -> str:
    """A strip as the answer model reads it: a sentence window on one line, a table or code block with its lines
    and indentation."""
    return strip.text.strip() if strip.whole_block else " ".join(strip.text.split())


def shown(strip: Strip, passage: str) -> str:
    """A strip as quoted to the reader: ``quoted``, less the Markdown marks of the headings it holds ("wal_level
    (enum) Sets ...", not "#### wal_level (enum) Sets ..."): marks that open a line of ``passage``, where the
    readers write headings ("Grange # 1" and "# 242" inside a sentence stay)."""
    if strip.whole_block:
        return quoted(strip)
    text = strip.text.strip()
    start = passage.find(text[:80])
    lines = text.split("\n")
    opens_a_line = start == 0 or (start > 0 and passage[start - 1] == "\n")
    kept = [_HEADING_MARKS.sub("", line) if i or opens_a_line else line for i, line in enumerate(lines)]
    return " ".join(" ".join(kept).split())


#: The marks that open a Markdown heading line ("#### "), which the readers write and nobody quotes.
_HEADING_MARKS = re.compile(r"^[ \t]*#{1,6}[ \t]+")


class SetAside(NamedTuple):
    """Why a strip cannot answer a question whatever its probability: ``kind`` (``OTHER_ENTRY``: it stands in
    another identifier's entry; ``NO_DEFAULT``: the question asks for a default it does not state; ``NO_FILE``: for
    a file it does not name; ``TURNED_ROUND``: it turns a negated question round where another strip does not,
    ``turned_against``) and ``why``, the reason as the trace gives it."""

    kind: str
    why: str


OTHER_ENTRY = "other_entry"
NO_DEFAULT = "no_default"
NO_FILE = "no_file"
TURNED_ROUND = "turned_round"
TURNED_ROUND_WHY = (
    "it turns the question round (states what a negated question asks against), where a strip with as many of its "
    "words does not"
)
_TURNED = ANSWER_FEATURES.index("turned_round")
_SENTENCE_COVERAGE = ANSWER_FEATURES.index("sentence_coverage")


def turned_against(features: np.ndarray) -> List[int]:
    """The candidates (rows of their ``ANSWER_FEATURES``) that turn the question round where another holding at
    least as many of the question's words does not: of "The default GIN operator class supports the key-exists
    operators" and "The non-default class jsonb_path_ops does not support the key-exists operators", only the
    second answers "Which class cannot serve the key-exists operator?", though the answer model, which learned
    from questions whose answers seldom repeat their negation, ranks the first higher. Where no strip keeps the
    question's way round, none is set aside: the network weighs ``turned_round`` with the rest."""
    rows = np.asarray(features, dtype=np.float64)
    if not len(rows):
        return []
    kept = rows[:, _TURNED] == 0.0
    if not kept.any() or kept.all():
        return []
    best_kept = float(rows[kept, _SENTENCE_COVERAGE].max())
    return [i for i in np.flatnonzero(~kept).tolist() if rows[i, _SENTENCE_COVERAGE] <= best_kept + 1e-9]


def set_aside_why(question: str, candidate: Candidate) -> Optional[SetAside]:
    """Why ``candidate`` cannot answer ``question`` whatever the answer model's probability, or None: it stands in
    another identifier's entry (``other_entry``), or the question asks for a default it does not state, or for a
    file it does not name."""
    entry = other_entry(question, candidate)
    if entry is not None:
        return SetAside(OTHER_ENTRY, f"it stands in the entry for {entry}")
    if states_no_default(question, candidate):
        return SetAside(NO_DEFAULT, "it states no default, which the question asks for")
    if names_no_file(question, candidate):
        return SetAside(NO_FILE, "it names no file, which the question asks for")
    return None


class EvidenceQuoter:
    """Answers with the strips of the context that answer the question, instead of generating.

    Every context passage is split into knowledge strips (the refiner's ``decompose``;
    a refined passage gives the strips the refiner kept), and the answer model gives each
    the probability that it answers the question (``answers.extract``). The first
    ``max_quotes`` strips at or above the quote threshold, in the model's ranking (which
    also reads how each strip leads the others), are quoted, a passage's sentences in
    their own order; when none reaches it, nothing is quoted, the most probable strip is
    kept in the trace as withheld, and the engine abstains. The threshold follows the
    grader's grade of the evidence (the model's ``QuoteDecision``: a strip of passages
    graded near the lower threshold must show more than one of passages graded above the
    upper), or is ``answer_threshold`` whatever the grade.

    Args:
        scorer: The grader's scorer: its word statistics and bi-encoder give the model's features (another kind
            of scorer lends its bi-encoder, with every word weighed the same).
        max_quotes: The most strips quoted.
        strip_min_tokens: Strip size, as the refiner's.
        answer_threshold: The probability a strip must reach to be quoted, whatever the grade; None: the model's
            own decision, fitted on the design halves of the development sets.
        model: The answer model (the packaged one by default).
        preset: Rules a corpus opts into (``presets.QUOTE_PRESETS``): ``structured_abstracts``.
    """

    def __init__(
        self,
        scorer: RelevanceScorer,
        max_quotes: int = 2,
        strip_min_tokens: int = 8,
        answer_threshold: Optional[float] = None,
        model: Optional[AnswerModel] = None,
        preset: Optional[str] = None,
    ) -> None:
        self.scorer = scorer
        self.evidence = _evidence_scorer(scorer)
        self.model = model or packaged_answer_model()
        self.max_quotes = max_quotes
        self.strip_min_tokens = strip_min_tokens
        self.decision: QuoteDecision = (
            self.model.decision if answer_threshold is None else QuoteDecision.constant(float(answer_threshold))
        )
        if preset is not None and preset not in QUOTE_PRESETS:
            raise ConfigError(f"unknown quote preset {preset!r}: choose {', '.join(QUOTE_PRESETS)}")
        self.rules: Tuple[QuoteRule, ...] = QUOTE_PRESETS[preset] if preset else ()

    def candidates(self, nodes: Sequence[NodeWithScore]) -> List[Tuple[Candidate, NodeWithScore, int, int, str]]:
        """Every strip of ``nodes`` as the answer model reads it, with its node, its place (rank, position) and
        its text as quoted (``shown``)."""
        found = []
        for rank, node in enumerate(nodes):
            title = str(node.node.metadata.get("title") or "")
            kept = kept_strips(node)
            whole = node.node.get_content()
            strips: List[Strip] = [s for s, _ in kept] if kept else decompose(whole, self.strip_min_tokens, title)
            for position, strip in enumerate(strips):
                text = quoted(strip)
                if not text:
                    continue
                start = whole.find(strip.text.strip()[:80])
                said = whole if start < 0 else whole[: start + len(strip.text.strip())]
                entry = entry_above(whole, len(said))
                candidate = Candidate(text, strip.graded_text, f"{title} {said}", entry)
                found.append((candidate, node, rank, position, shown(strip, whole)))
        return found

    def threshold(self, place: Optional[float] = None) -> float:
        """The probability a strip needs to be quoted from evidence at ``place`` between the grader's thresholds
        (``evidence_place``: 0 at lower, 1 at upper; read as 0 when not known)."""
        return self.decision.threshold(place)

    def quote(self, question: str, nodes: Sequence[NodeWithScore], place: Optional[float] = None) -> QuotedAnswer:
        """The quoted answer to ``question`` from ``nodes`` (empty when they hold no text), their grade at
        ``place``."""
        threshold = round(self.threshold(place), 4)
        evidence = None if place is None else round(place, 4)
        found = self.candidates(nodes)
        if not found:
            return QuotedAnswer([], threshold=threshold, evidence=evidence)
        features = answer_features(question, [f[0] for f in found], self.evidence)
        probabilities = self.model.probabilities(features)
        order = self.model.ranks(features, probabilities)
        unnamed = unnamed_identifiers(question, [f[0] for f in found])
        ranked = sorted(range(len(found)), key=lambda i: -order[i])
        ranked = [i for i in ranked if not any(rule(question, found[i][0].text) for rule in self.rules)]
        why = {i: set_aside_why(question, found[i][0]) for i in ranked}
        for i in turned_against(features):
            if i in why:  # a strip a preset's rule left out stays out, and is not listed as set aside
                why[i] = why[i] or SetAside(TURNED_ROUND, TURNED_ROUND_WHY)
        set_aside = [{"text": found[i][4], "why": w.why} for i, w in why.items() if w][:3]
        kinds = sorted({w.kind for w in why.values() if w})
        elsewhere = list(asked_identifiers(question)) if any(w and w.kind == OTHER_ENTRY for w in why.values()) else []
        ranked = [i for i in ranked if not why[i]]
        if not ranked:
            return QuotedAnswer(
                [],
                threshold=threshold,
                evidence=evidence,
                set_aside=set_aside,
                elsewhere=elsewhere,
                set_aside_kinds=kinds,
            )
        seen: set[str] = set()
        chosen: List[int] = []
        for i in ranked:  # the ranker orders the strips; each quoted one must pass the threshold itself
            if len(chosen) == self.max_quotes:
                break
            if not unnamed and probabilities[i] >= threshold and found[i][0].text not in seen:
                seen.add(found[i][0].text)
                chosen.append(i)
        strongest = max(ranked, key=lambda i: probabilities[i])
        best = round(float(probabilities[strongest]), 4)
        if not chosen:
            withheld = [_quote(found[strongest], probabilities[strongest])]
            return QuotedAnswer(
                [],
                grade=best,
                withheld=withheld,
                threshold=threshold,
                evidence=evidence,
                unnamed=unnamed,
                set_aside=set_aside,
                elsewhere=elsewhere,
            )
        chosen.sort(key=lambda i: found[i][2:4])
        quotes = [_quote(found[i], probabilities[i]) for i in chosen]
        return QuotedAnswer(quotes, grade=best, threshold=threshold, evidence=evidence, set_aside=set_aside)

    async def aquote(
        self, question: str, nodes: Sequence[NodeWithScore], place: Optional[float] = None
    ) -> QuotedAnswer:
        """``quote`` off the event loop (reading strips is CPU-bound)."""
        return await asyncio.to_thread(self.quote, question, nodes, place)


def _quote(found: Tuple[Candidate, NodeWithScore, int, int, str], probability: float) -> Quote:
    node, entry = found[1], _entry_unsaid(found[0].entry, found[4])
    return Quote(
        text=found[4],
        source=source_name(node),
        node_id=node.node.node_id,
        score=round(float(probability), 4),
        entry=entry,
    )


#: The longest entry a quote names (a heading longer than that is a sentence, not a name).
MAX_ENTRY_CHARS = 80


def _entry_unsaid(entry: str, shown: str) -> str:
    """``entry`` (a heading's text) when the quote ``shown`` does not hold it and it is short enough to name
    something, else ""."""
    entry = " ".join(entry.split())
    if not entry or len(entry) > MAX_ENTRY_CHARS or entry.casefold() in " ".join(shown.split()).casefold():
        return ""
    return entry


def _evidence_scorer(scorer: RelevanceScorer) -> EvidenceScorer:
    """The evidence scorer whose features the answer model reads: the grader's own, or one over its bi-encoder."""
    if isinstance(scorer, EvidenceScorer):
        return scorer
    bi_encoder = bi_encoder_of(scorer)
    return EvidenceScorer(embed_model=bi_encoder.embed_model if bi_encoder is not None else None)
