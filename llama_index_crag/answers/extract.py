"""Quoted-evidence answers: the best graded strips of the context, verbatim, with their sources; no generation."""

from __future__ import annotations

import asyncio
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from llama_index.core.schema import NodeWithScore

from llama_index_crag.answers.names import names_what_is_asked
from llama_index_crag.answers.sources import source_name
from llama_index_crag.scorers.answer_type import asked_kinds, asks, holds_kind
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.text.split import split_sentences
from llama_index_crag.text.strips import Strip, decompose, kept_strips

#: Figures and codes a question names: years, quarters, versions, regions ("2023", "Q2", "7.2.1", "EU-2").
_CODES = re.compile(r"[\w-]*\d(?:[\w-]|\.\d)*")
#: A range of plain numbers ("76-85"): each end must be stated, as written or as a decimal ("76.3% to 85.4%").
_NUMBER_RANGE = re.compile(r"\d+(?:\.\d+)?-\d+(?:\.\d+)?")
#: The space a text may put between a number and its unit ("40 mg" for "40mg").
_UNIT_GAP = re.compile(r"(?<=\d)\s+(?=[^\W\d_])")
#: A word that describes a code rather than belongs to it ("SF1-expressing neurons", "UCP1-dependent", "M2-like").
_CODE_SUFFIX = re.compile(
    r"-(?:(?:in)?dependent|expressing|like|induced|mediated|deficient|positive|negative|specific|related|associated"
    r"|containing|derived|type)$"
)
#: Where a structured abstract's section label stands: first, after punctuation, a line break, or a line break
#: written out as the two characters ``\n`` (as abstracts exported to JSON twice over hold it).
_LABEL_START = r"^(?:[\W_]|(?<=\\)n\b)*"
#: What a writer says it set out to learn, and has not yet answered: a labelled objective, a hypothesis or aim in
#: the first person ("We hypothesized that ..."), a study's own aim ("This study sought to ..."), or a question.
_OWN_AIM = re.compile(
    _LABEL_START + r"(?:objectives?|aims?|purpose|hypothes[ie]s)\s*[:.\-]?\s"
    r"|\bwe\s+(?:hypothesi[sz]ed|hypothesi[sz]e|aimed|aim|sought|seek|set\s+out|wanted|wished|asked)\b"
    r"|\bwe\s+(?:investigated|examined|tested|assessed|evaluated|determined|explored)\s+whether\b"
    r"|\b(?:the|our)\s+(?:primary\s+|main\s+)?(?:aim|purpose|objective|goal)s?\s+of\s+(?:this|the\s+present|our)\s"
    r"|\b(?:this|the\s+present|our)\s+(?:study|trial|review|analysis|work|research)\s+"
    r"(?:aimed|aims|sought|seeks|was\s+designed|is\s+designed)\s+to\b"
    r"|^[^\"“”]*\?\W*$",
    re.IGNORECASE,
)
#: The sections of a structured abstract that say how a study was done, and never what it found: "DESIGN",
#: "SETTING AND PARTICIPANTS", "MAIN OUTCOME MEASURES", "Methods:".
_METHOD_SECTION = (
    r"(?:design|settings?|participants|patients|subjects|population|methods?|methodology|materials|interventions?|exposures?"
    r"|main\s+outcomes?(?:\s+and)?(?:\s+measures?|\s+measurements?)?|outcome\s+measures?|measurements"
    r"|data\s+(?:sources?|extraction|collection|synthesis)|study\s+selection|studies\s+reviewed|funding"
    r"|(?:clinical\s+)?trial\s+registration(?:\s+url)?|review\s+(?:methods|registration)"
    r"|eligibility\s+criteria(?:\s+for\s+(?:selecting|including)\s+studies)?)"
)
#: Such a label opening a strip, alone or joined to others by commas or "and" ("DESIGN, SETTING, AND
#: PARTICIPANTS"; in "INTERVENTION Participants received ..." the label ends before the sentence's first word);
#: group 2 is the colon that may follow it, group 3 the character that opens the section's text.
_METHODS_LABEL = re.compile(
    _LABEL_START + rf"({_METHOD_SECTION}(?:(?:\s*,\s*(?:and\s+)?|\s+and\s+){_METHOD_SECTION})*)(\s*:)?\s+(\S)",
    re.IGNORECASE,
)
#: A sentence that says what a study did, labelled or not: "We enrolled 1,200 patients ...", "Serum samples were
#: collected at baseline", "Participants were randomly assigned to ...".
_PROCEDURE = re.compile(
    r"\bwe\s+(?:\w+ly\s+)?(?:enrolled|recruited|randomi[sz]ed|assigned|allocated|conducted|performed|measured"
    r"|analy[sz]ed|collected|used|followed|studied|surveyed|selected|included|obtained|screened|genotyped|sequenced"
    r"|interviewed|searched|reviewed|compared|calculated|estimated|applied|developed|designed|generated|constructed"
    r"|tested|evaluated|assessed|examined|investigated|determined|characteri[sz]ed|quantified|monitored|treated"
    r"|administered|exposed|injected|fed|isolated|extracted|pooled|combined|model+ed|simulated|linked|matched"
    r"|defined|classified|categori[sz]ed|stratified|adjusted|fit(?:ted)?|undertook|carried\s+out|created"
    r"|utili[sz]ed|employed|implemented|recorded|retrieved|abstracted)\b"
    r"|\b(?:was|were)\s+(?:\w+ly\s+)?(?:enrolled|recruited|randomi[sz]ed|assigned|allocated|conducted|performed"
    r"|measured|analy[sz]ed|collected|used|followed(?:\s+up)?|studied|surveyed|selected|included|obtained|screened"
    r"|genotyped|sequenced|interviewed|searched|reviewed|calculated|estimated|applied|administered|injected|fed"
    r"|isolated|extracted|pooled|recorded|retrieved|abstracted|stratified|adjusted|fitted|defined|classified"
    r"|categori[sz]ed|matched|identified\s+(?:from|through|using|by|in)|assessed|evaluated|determined|quantified"
    r"|monitored|treated|exposed|given|tested|examined|investigated|carried\s+out|undertaken|compared|taken|drawn"
    r"|sampled|invited|asked)\b",
    re.IGNORECASE,
)
#: What a sentence that reports a finding holds: a comparison, an effect, an association, a significance, a
#: share or a p-value ("... were more likely to ...", "was associated with ...", "(95% CI ...)", "P < .001").
_FINDING = re.compile(
    r"\b(?:significant(?:ly)?|increas\w*|decreas\w*|reduc\w*|higher|lower|greater|less|more|fewer|improv\w*"
    r"|associat\w*|correlat\w*|linked|risks?|ratios?|odds|hazards?|show(?:s|ed|n)?|found|finds?|findings?"
    r"|reveal\w*|demonstrat\w*|suggest\w*|indicat\w*|conclu\w*|results?|resulted|led|leads?|caus\w*|induc\w*"
    r"|inhibit\w*|prevent\w*|promot\w*|enhanc\w*|impair\w*|requir\w*|depend\w*|no\s+(?:difference|effect|evidence)"
    r"|not|effect(?:ive|s)?|prevalence|incidence)\b|%|\bp\s*[<=>]|\bCI\b",
    re.IGNORECASE,
)
#: The sections of a structured abstract that say what was known before the study, and never what it found:
#: "BACKGROUND", "CONTEXT", "Importance", "BACKGROUND & AIMS", "Background and Purpose".
_BACKGROUND_LABEL = re.compile(
    _LABEL_START + r"((?:background|context|introduction|importance|rationale)"
    r"(?:\s*(?:,|&|\band\b)\s*(?:aims?|objectives?|purpose|goals?|importance|context|rationale|significance))*)"
    r"(\s*:)?\s+(\S)",
    re.IGNORECASE,
)
#: What earlier work found or what is generally held, as an abstract's background reports it: "A recent study has
#: shown ...", "Numerous reports have demonstrated ...", "is thought to ...", "accumulating evidence", "the dogma".
_PRIOR_WORK = re.compile(
    r"\b(?:(?:previous|prior|earlier|recent|several|many|numerous|other)\s+(?:\w+\s+)?(?:studies|reports|work|research"
    r"|investigations|trials|data|findings|evidence|observations)\s+(?:have|has|had|suggest|suggested|show|showed"
    r"|shown|indicate|indicated|demonstrate|demonstrated|support)"
    r"|(?:a|one)\s+recent\s+(?:study|report|trial|analysis)\s+(?:has|had)"
    r"|(?:has|have)\s+(?:been\s+)?(?:previously|recently|widely|extensively|repeatedly|long)\s+(?:been\s+)?(?:shown"
    r"|reported|suggested|proposed|implicated|described|demonstrated|recogni[sz]ed|studied|known|established|observed"
    r"|considered|thought|believed|used)"
    r"|(?:is|are|was|were)\s+(?:widely\s+|well\s+|generally\s+|commonly\s+)?(?:known|thought|believed|considered"
    r"|recogni[sz]ed|accepted|established)\s+(?:to|that|as)"
    r"|it\s+(?:is|has\s+been)\s+(?:well\s+)?(?:known|established|accepted|recogni[sz]ed|shown|suggested|proposed)\s+that"
    r"|there\s+(?:have|has)\s+been\s+(?:many|several|numerous|some|few|growing|increasing)"
    r"|(?:accumulating|growing|increasing|emerging|mounting)\s+(?:body\s+of\s+)?evidence"
    r"|the\s+dogma)\b",
    re.IGNORECASE,
)
#: A later label that reports what was found: a strip that runs on into it states a finding.
_FINDINGS_LABEL = re.compile(r"(?:^|[.;]\s+|\\n\s*)(?:results?|conclusions?|findings|interpretation)\b\s*:?\s+\S", re.I)
#: What a writer says is not yet known, the gap a study sets out to fill: "the role of AMPK in fibrosis is not well
#: understood", "whether they are associated with outcomes remains unknown", "little is known about ...".
_UNKNOWN = re.compile(
    r"\b(?:remains?|remained)\s+(?:largely\s+|still\s+|as\s+yet\s+)?(?:unknown|unclear|elusive|uncertain|unexplored"
    r"|obscure|controversial|to\s+be\s+(?:determined|established|elucidated|clarified))\b"
    r"|\b(?:is|are|was|were|has\s+been|have\s+been)\s+(?:still\s+|largely\s+|currently\s+|as\s+yet\s+)?"
    r"(?:not\s+(?:well\s+|fully\s+|yet\s+|completely\s+)?(?:understood|known|established|characteri[sz]ed|defined|clear)"
    r"|(?:poorly|incompletely|little)\s+(?:understood|known|characteri[sz]ed|studied|defined)"
    r"|unknown|unclear|uncertain|undetermined|unexplored|elusive)\b"
    r"|\blittle\s+is\s+known\b",
    re.IGNORECASE,
)
#: A question about aims themselves ("What did the study set out to find?") may be answered by one.
_ASKS_AN_AIM = re.compile(r"\b(?:aim|purpose|goal|objective|hypothes|intend|intent|seek|sought|set\s+out|why)", re.I)
#: The line that opens every quoted answer, so that nobody reads it as generated text.
QUOTED_HEADER = "Quoted from the documents (not generated):"


@dataclass(frozen=True)
class Quote:
    """One quoted strip: its text as it stands in the source, where it comes from, and its grade."""

    text: str
    source: str
    node_id: str
    score: float


@dataclass(frozen=True)
class QuotedAnswer:
    """The quotes of an extractive answer, in document order.

    ``grade`` is the quotes read together as one passage and graded against the question
    (None when that check is off or nothing was found); ``withheld`` holds the quotes that
    were found but not given because that grade fell under the quote threshold.
    """

    quotes: List[Quote]
    grade: Optional[float] = None
    withheld: List[Quote] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The answer as a reader sees it: a header, then each quote with its source."""
        if not self.quotes:
            return ""
        lines = [f'"{q.text}" ({q.source})' for q in self.quotes]
        return "\n".join([QUOTED_HEADER, *lines])

    def to_list(self) -> List[Dict[str, Any]]:
        """The quotes as JSON-ready dicts (for the trace)."""
        return [asdict(q) for q in self.quotes]

    def check(self, threshold: float) -> Optional[Dict[str, Any]]:
        """The quotes' check for the trace: their grade together, the threshold, and what was withheld."""
        if self.grade is None:
            return None
        return {
            "grade": self.grade,
            "threshold": threshold,
            "passed": not self.withheld,
            "withheld": [asdict(q) for q in self.withheld],
        }


def quoted(strip: Strip) -> str:
    """A strip as quoted: a sentence window on one line, a table or code block with its lines and indentation."""
    return strip.text.strip() if strip.whole_block else " ".join(strip.text.split())


def states_what_is_asked(question: str, text: str) -> bool:
    """Whether ``text`` can answer ``question`` as a quote: it holds the kind of answer asked (a duration for
    "how long", a date for "when", a name for "who"), and every figure or code the question names ("Q2 2023",
    "EU-2", "7.2.1"). A strip about Q3 does not answer a question about Q2, however well it grades.

    A number may stand apart from its unit ("40 mg" states "40mg"), a code may be written with or without its
    hyphens ("SHP-2" and "SHP2", "GATA3" and "GATA-3") and without a word that only describes it ("SF1" states
    "SF1-expressing"), and a range of numbers is stated when both of its ends are ("76-85%" by "76.3% to 85.4%").

    A claim asks for no kind of answer (``asked_kinds``), so only its figures must be stated."""
    kinds = asked_kinds(question)
    if kinds is not None and not holds_kind(kinds, text, question):
        return False
    lowered = _UNIT_GAP.sub("", text.casefold())
    for code in _CODES.findall(question.casefold()):
        if _NUMBER_RANGE.fullmatch(code):
            if not all(end in lowered for end in code.split("-")):
                return False
        elif not _states_code(code, lowered):
            return False
    return True


def _states_code(code: str, text: str) -> bool:
    """Whether casefolded ``text`` states ``code`` as written, or as a word of its own with its hyphens moved
    and without a describing suffix ("gata-3" states "gata3", "sf1 neurons" states "sf1-expressing"; "ap-1" does
    not state "p1")."""
    if code in text:
        return True
    core = _CODE_SUFFIX.sub("", code).replace("-", "")
    return bool(core) and re.search(r"(?<![^\W_])" + "-?".join(map(re.escape, core)), text) is not None


def states_an_aim(question: str, text: str) -> bool:
    """Whether ``text`` only says what its writer set out to learn (``_OWN_AIM``): "We hypothesized that
    cell-free mtDNA levels would be associated with mortality" shares every word of the claim that they are, and
    verifies nothing. Quoted, it reads as the answer. A question about aims ("What did the trial aim to show?")
    is answered by one, so for it no text is an aim."""
    return not _ASKS_AN_AIM.search(question) and bool(_OWN_AIM.search(text.strip()))


def describes_methods(question: str, text: str) -> bool:
    """Whether ``text`` only says how a study was done and ``question`` is a claim (``asks``): a structured
    abstract's methods section (``_METHODS_LABEL``), or, unlabelled, a strip that states what was done
    (``_PROCEDURE``: "Fasting blood samples ... were taken", "We compared amitriptyline in 82 patients") and no
    finding (``_FINDING``: no comparison, effect, association, significance, share or p-value). "DESIGN
    Randomised controlled trial in 36 medical centres" names the claim's drug and disease and verifies nothing
    about them; a question ("How many patients took part?") may be answered by it.

    The label is written in capitals ("DESIGN"), followed by a colon ("Design:"), or in title case before a
    capital or a figure ("Design, Setting, and Participants Prospective cohort ..."): "Patients were ..." is a
    sentence, not a label. A strip that runs on into its results ("MAIN OUTCOMES Colorectal cancer. RESULTS
    Regular use of aspirin was associated with ...") states a finding."""
    if asks(question):
        return False
    stripped = text.strip()
    if _PROCEDURE.search(stripped) and not _FINDING.search(stripped):
        return True
    return _opens_section(_METHODS_LABEL, stripped)


def gives_background(question: str, text: str) -> bool:
    """Whether ``text`` is only a structured abstract's background section ("BACKGROUND", "CONTEXT",
    "Importance", "BACKGROUND & AIMS"; ``_BACKGROUND_LABEL``) and ``question`` is a claim (``asks``): what was
    known or worried about before the study ("BACKGROUND Bariatric surgery is becoming a more widespread
    treatment for obesity."), not what it found. It shares the claim's subject and grades with it. Labels are
    read as ``describes_methods`` reads them, and a strip that runs on into its results states a finding.
    Unlabelled, a strip that reports what earlier work found or what is generally held (``_PRIOR_WORK``: "A
    recent study has shown an increased autophagic activity ...", "the dogma remains that ...") is background
    too."""
    return not asks(question) and (_opens_section(_BACKGROUND_LABEL, text.strip()) or bool(_PRIOR_WORK.search(text)))


def _opens_section(label_pattern: re.Pattern[str], text: str) -> bool:
    """Whether ``text`` opens with a section label of ``label_pattern`` (group 1 the label's words, group 2 the
    colon that may follow, group 3 the character that opens the section's text) written as a label: in capitals,
    followed by a colon, or in title case before a capital or a figure. A strip that runs on into a results or
    conclusions label states a finding, whatever opened it."""
    label = label_pattern.match(text)
    if not label or _FINDINGS_LABEL.search(text, label.end(3)):
        return False
    words, opening = label.group(1), label.group(3)
    return bool(label.group(2) or words.isupper() or (words[:1].isupper() and (opening.isupper() or opening.isdigit())))


def states_a_gap(question: str, text: str) -> bool:
    """Whether ``text`` opens with what is not yet known (``_UNKNOWN``: "However, the role of AMPK in fibrosis is not
    well understood", "Organ-specific functions of macrophages in the heart are unknown", "the determinants of AR
    overexpression are poorly defined") and ``question`` is a claim (``asks``). It shares the claim's subject and
    verifies nothing about it. A question may be answered by one ("Is the cause known?", or "The Rhine was not known
    to Herodotus" for "Who did not know of the Rhine?")."""
    if asks(question):
        return False
    # Its first sentence says what a strip is: one that opens with findings and names a gap further on (a
    # graphical abstract's highlights run together) states the findings.
    first = split_sentences(text.strip())[:1]
    return bool(first and _UNKNOWN.search(first[0]))


class EvidenceQuoter:
    """Answers with the context's best strips instead of generating.

    Every context passage is split into knowledge strips (the refiner's ``decompose``),
    all strips are scored against the question in one batch with the grader's scorer,
    and the best ``max_quotes`` of those that state what is asked (``states_what_is_asked``),
    not only what their writer set out to learn (``states_an_aim``) or, for a claim, how its study was done
    (``describes_methods``), what was known before it (``gives_background``) or what is not yet known
    (``states_a_gap``), and clear ``threshold``
    (the strip threshold: what the refiner would keep) are quoted. When none does, nothing
    is quoted and the engine abstains. Quotes are
    ordered as the context is (by grade), and within a passage as the text is, so a
    passage's sentences read in their own order.

    Then the quotes are read together, as one passage under its title, and graded against
    the question once more: a strip can clear the strip threshold by sharing the question's subject,
    but what is quoted must answer it as a passage must (the engine passes ``lower``
    as ``answer_threshold``). Under it the quotes are withheld and the engine abstains.

    Args:
        scorer: The grader's scorer.
        max_quotes: The most strips quoted.
        threshold: The score a strip must reach to be quoted.
        strip_min_tokens: Strip size, as the refiner's.
        answer_threshold: The grade the quotes together must reach; 0 skips that check.
    """

    def __init__(
        self,
        scorer: RelevanceScorer,
        max_quotes: int = 2,
        threshold: float = 0.5,
        strip_min_tokens: int = 8,
        answer_threshold: float = 0.0,
    ) -> None:
        self.scorer = scorer
        self.max_quotes = max_quotes
        self.threshold = threshold
        self.strip_min_tokens = strip_min_tokens
        self.answer_threshold = answer_threshold

    def quote(self, question: str, nodes: Sequence[NodeWithScore]) -> QuotedAnswer:
        """The quoted answer to ``question`` from ``nodes`` (empty when they hold no text)."""
        # (rank, position, strip, node, score): a refined passage's strips carry the score the refiner gave them.
        found: List[Tuple[int, int, Strip, NodeWithScore, Optional[float]]] = []
        for rank, node in enumerate(nodes):
            title = str(node.node.metadata.get("title") or "")
            # A refined passage is quoted from the strips the refiner kept, with the context and score it gave them.
            kept = kept_strips(node)
            strips: List[Tuple[Strip, Optional[float]]] = (
                list(kept)
                if kept
                else [(s, None) for s in decompose(node.node.get_content(), self.strip_min_tokens, title)]
            )
            found += [(rank, position, strip, node, score) for position, (strip, score) in enumerate(strips)]
        found = [f for f in found if f[2].text.strip()]
        if not found:
            return QuotedAnswer([])
        fresh = [i for i, f in enumerate(found) if f[4] is None]
        scored = self.scorer.score_texts(question, [found[i][2].graded_text for i in fresh]) if fresh else []
        scores = [f[4] or 0.0 for f in found]
        for i, score in zip(fresh, scored):
            scores[i] = float(score)
        ranked = sorted(range(len(found)), key=lambda i: -scores[i])
        seen: set[str] = set()
        chosen: List[int] = []
        for i in ranked:
            # Best first: a strip under the threshold, or past the quotes wanted, is never quoted.
            if len(chosen) == self.max_quotes or not scores[i] >= self.threshold:
                break
            strip, node = found[i][2], found[i][3]
            text = quoted(strip)
            if (
                text not in seen
                and not states_an_aim(question, text)
                and not describes_methods(question, text)
                and not gives_background(question, text)
                and not states_a_gap(question, text)
                and states_what_is_asked(question, f"{node.node.metadata.get('title') or ''} {strip.graded_text}")
                and names_what_is_asked(question, node, strip)
            ):
                seen.add(text)
                chosen.append(i)
        chosen.sort(key=lambda i: found[i][:2])
        quotes = [
            Quote(
                text=quoted(found[i][2]),
                source=source_name(found[i][3]),
                node_id=found[i][3].node.node_id,
                score=round(float(scores[i]), 4),
            )
            for i in chosen
        ]
        if not quotes or self.answer_threshold <= 0.0:
            return QuotedAnswer(quotes)
        # Read as a passage is: under its title, where the quoted passages have one.
        titles = list(dict.fromkeys(str(found[i][3].node.metadata.get("title") or "").strip() for i in chosen))
        heading = "; ".join(t for t in titles if t)
        joint = " ".join(q.text for q in quotes)
        grade = round(float(self.scorer.score_texts(question, [f"{heading}. {joint}" if heading else joint])[0]), 4)
        if grade < self.answer_threshold:
            return QuotedAnswer([], grade=grade, withheld=quotes)
        return QuotedAnswer(quotes, grade=grade)

    async def aquote(self, question: str, nodes: Sequence[NodeWithScore]) -> QuotedAnswer:
        """``quote`` off the event loop (scoring is CPU-bound)."""
        return await asyncio.to_thread(self.quote, question, nodes)
