"""Engine settings, resolved in one order: constructor, then CRAG_* environment, then calibration file."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional, Tuple

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from llama_index_crag.answers.policy import AnswerMode, OnUngrounded
from llama_index_crag.errors import ConfigError
from llama_index_crag.presets import QuotePreset
from llama_index_crag.settings_sources import (
    ENV_PREFIX,
    Environment,
    Flag,
    OwnSources,
    Sources,
    Values,
    calibrate_command,
    current_sources,
    described,
    load_calibration,
    reading,
)

if TYPE_CHECKING:
    from llama_index_crag.core.grader import RelevanceGrader
    from llama_index_crag.core.refiner import StripRefiner

CALIBRATION_ENV = f"{ENV_PREFIX}CALIBRATION"
#: The longest time budget a setting takes, in seconds: a day.
MAX_TIMEOUT_S = 86400.0


class CragSettings(OwnSources):
    """Every knob of the corrective loop, with its default.

    Built from, highest first: constructor arguments, ``CRAG_<FIELD>`` variables, the
    calibration file (``CRAG_CALIBRATION``), a scorer's defaults, then these defaults.
    ``upper`` and ``lower`` have no default here: they belong to a scorer and come
    from a calibration file (or the scorer's shipped defaults), never from a paper.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    enabled: Flag = Field(default=True, description="False turns the engine into plain retrieve-then-generate.")
    upper: float = Field(ge=0.0, le=1.0, description="Batch score at or above which retrieval is CORRECT.")
    lower: float = Field(ge=0.0, le=1.0, description="Batch score below which retrieval is INCORRECT.")
    aggregation: Literal["max", "mean", "count"] = Field(
        default="max", description="How node scores become the batch score."
    )
    min_relevant: int = Field(
        default=2, ge=1, description="For aggregation='count': candidates that must clear a band."
    )
    similarity_top_k: int = Field(default=5, ge=1, description="Candidates retrieved (and fallback results kept).")
    max_rewrites: int = Field(default=1, ge=0, description="Query rewrites allowed on the INCORRECT branch.")
    fallback_widen: Literal["chunk", "window"] = Field(
        default="chunk",
        description="What a sentence the fallback's sentence search finds is widened to: the chunk that holds it "
        "(graded with the vector the index stored) or the sentences around it (embedded when graded).",
    )
    strip_threshold: Optional[float] = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Knowledge strips scoring at least this are kept on AMBIGUOUS; None uses lower.",
    )
    strip_min_tokens: int = Field(
        default=8, ge=1, description="Shortest knowledge strip, in words; shorter ones are merged."
    )
    hybrid: Flag = Field(default=False, description="On AMBIGUOUS, add fallback results to the refined strips.")
    on_no_strips: Literal["original", "incorrect"] = Field(
        default="original",
        description="On AMBIGUOUS when no strip clears the strip threshold: generate from the original candidates "
        "(the seed design), or treat retrieval as INCORRECT (rewrite, fall back, or abstain).",
    )
    explain: Flag = Field(
        default=False,
        description="Put each candidate's explanation (features, contributions, missing query words) in the trace.",
    )
    # Capped at a day: a budget is a number of seconds a clock can count to (inf, or 1e10 s, overflows the
    # platform's timer, and every INCORRECT query would end in that error instead of its answer).
    correction_timeout_s: float = Field(
        default=30.0, gt=0, le=MAX_TIMEOUT_S, description="Time budget of the whole correction path (at most a day)."
    )
    rewrite_timeout_s: Optional[float] = Field(
        default=None,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="Time limit of each LLM rewrite; past it the question's keywords are searched in the time the "
        "correction budget has left. None: half of correction_timeout_s.",
    )
    # The one query limit: the server refuses with this value too. 8,000 characters (about 1,500 words) leaves
    # room for a question that quotes a paragraph or an error log; anything longer is a document, not a question,
    # and embedding and grading it would cost every other query on the machine its time.
    max_query_chars: int = Field(default=8000, ge=1, description="Longer queries are refused with a clear error.")
    split_compound: Flag = Field(
        default=True,
        description='A question that asks several things ("When was X founded, and who designed Y?") is answered '
        "part by part, each retrieved, graded and answered or abstained on alone (text/compound.py).",
    )
    max_parts: int = Field(default=4, ge=2, le=10, description="The most parts a compound question is split into.")
    answer_mode: Optional[AnswerMode] = Field(
        default=None,
        description="extract: answer with the best graded strips, quoted with their sources, no generation; "
        "generate: the synthesizer's answer, checked against its sources. None: extract when the generator is "
        "the bundled small model or there is none, else generate.",
    )
    check_answers: Flag = Field(
        default=True, description="Check every generated answer against the passages it was generated from."
    )
    on_ungrounded: OnUngrounded = Field(
        default="extract",
        description="What an answer that fails the check becomes: kept and flagged, replaced by the quoted "
        "evidence, or an abstention.",
    )
    check_with_grader: Flag = Field(
        default=False,
        description="The check also scores each answer sentence against the passages with the grader's scorer.",
    )
    max_quotes: int = Field(default=2, ge=1, description="Strips quoted by an extractive answer.")
    quote_threshold: Optional[float] = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="The probability the answer model must give a strip for it to be quoted, else the engine "
        "abstains; None: the model's own threshold, 0: the best strip is always quoted.",
    )
    answer_model: Optional[str] = Field(
        default=None,
        description="The answer step's network: a folder written by llama-crag train-answers. None: the packaged one.",
    )
    quote_preset: Optional[QuotePreset] = Field(
        default=None,
        description="Quote rules a corpus opts into: structured_abstracts withholds what a biomedical abstract "
        "says of its aims, methods, background and open questions. None: the answer model alone.",
    )
    abstain_text: str = Field(
        default="I don't know. The documents I can search do not answer this question.",
        min_length=1,
        pattern=r"\S",
        description="The answer given when the engine abstains.",
    )
    abstain_context: str = Field(
        default="The documents available do not answer this question: {reason}. Say that you do not know.",
        min_length=1,
        pattern=r"\S",
        description="What CorrectiveRetriever returns, as the one node's text, when the loop abstains ({reason}: why); "
        "an LLM downstream reads it in place of the rejected passages.",
    )

    @model_validator(mode="after")
    def _ordered_thresholds(self) -> CragSettings:
        if self.lower > self.upper:
            raise ValueError(f"CRAG thresholds need lower <= upper, got lower={self.lower}, upper={self.upper}")
        return self

    def check_parts(self, grader: RelevanceGrader, refiner: StripRefiner) -> None:
        """Refuse a grader or refiner that holds another value than these settings for one of their fields.

        An engine built by hand is given its thresholds twice, in its parts and in its
        settings; the parts grade and the settings are what a reader of the engine sees,
        so they must be one set of values.

        Raises:
            ConfigError: naming each field whose values differ.
        """
        pairs = {
            "upper": (self.upper, grader.upper),
            "lower": (self.lower, grader.lower),
            "aggregation": (self.aggregation, grader.aggregation),
            "min_relevant": (self.min_relevant, grader.min_relevant),
            "explain": (self.explain, grader.explain),
            "strip_threshold": (
                self.lower if self.strip_threshold is None else self.strip_threshold,
                refiner.threshold,
            ),
            "strip_min_tokens": (self.strip_min_tokens, refiner.strip_min_tokens),
        }
        differ = [f"{name}={mine!r} but {theirs!r}" for name, (mine, theirs) in pairs.items() if mine != theirs]
        if differ:
            raise ConfigError(
                f"the engine's settings and its grader or refiner disagree ({'; '.join(differ)} in the part): build "
                "the parts from the same values, or let CorrectiveQueryEngine.from_defaults build them"
            )

    @classmethod
    def own_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource
    ) -> Tuple[PydanticBaseSettingsSource, ...]:
        """Constructor, environment, calibration file, scorer defaults."""
        sources = current_sources()
        path = sources.calibration_path or sources.env.get(CALIBRATION_ENV)
        return (
            init_settings,
            Environment(settings_cls, sources.env, {}),
            Values(settings_cls, load_calibration(path, sources.scorer_name) if path else {}),
            Values(settings_cls, sources.scorer_defaults or {}),
        )

    @classmethod
    def resolve(
        cls,
        overrides: Optional[Mapping[str, Any]] = None,
        calibration_path: Optional[str | Path] = None,
        scorer_name: Optional[str] = None,
        scorer_defaults: Optional[Mapping[str, Any]] = None,
        environ: Optional[Mapping[str, str]] = None,
    ) -> CragSettings:
        """Merge the sources, highest first: ``overrides`` (constructor arguments that
        are not None), ``CRAG_*`` variables, the calibration file (``calibration_path``
        or ``CRAG_CALIBRATION``, refused when fitted for another scorer than
        ``scorer_name``), then ``scorer_defaults`` and the field defaults.

        Raises:
            ConfigError: a value that cannot be used, naming the variable or keyword it came from.
        """
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        with reading(Sources(environ, calibration_path, scorer_name, scorer_defaults)) as env:
            try:
                return cls(**given)
            except ValidationError as exc:
                if {e["loc"] for e in exc.errors() if e["type"] == "missing"} & {("upper",), ("lower",)}:
                    raise ConfigError(
                        f"no thresholds for scorer {scorer_name!r} (the shipped ones were fitted for the bundled "
                        "all-MiniLM-L6-v2 embedding; another embedding model, passed or set as Settings.embed_model, "
                        f"needs its own): calibrate for it with {calibrate_command(scorer_name)}; or pass upper= and "
                        "lower= (CRAG_UPPER, CRAG_LOWER)"
                    ) from exc
                raise ConfigError(f"invalid CRAG settings: {described(cls, exc, env)}") from exc
