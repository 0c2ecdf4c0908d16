"""Engine settings, resolved in one order: constructor, then CRAG_* environment, then calibration file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Literal, Mapping, Optional, Union

from llama_index.core.bridge.pydantic import BaseModel, Field, ValidationError

ENV_PREFIX = "CRAG_"
CALIBRATION_VERSION = 1


class CragSettings(BaseModel):
    """Every knob of the corrective loop, with its default.

    ``upper`` and ``lower`` have no default here: they belong to a scorer and come
    from a calibration file (or the scorer's shipped defaults), never from a paper.
    """

    enabled: bool = Field(default=True, description="False turns the engine into plain retrieve-then-generate.")
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
    strip_threshold: Optional[float] = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Knowledge strips scoring at least this are kept on AMBIGUOUS; None uses lower.",
    )
    strip_min_tokens: int = Field(
        default=8, ge=1, description="Shortest knowledge strip, in words; shorter ones are merged."
    )
    hybrid: bool = Field(default=False, description="On AMBIGUOUS, add fallback results to the refined strips.")
    on_no_strips: Literal["original", "incorrect"] = Field(
        default="original",
        description="On AMBIGUOUS when no strip clears the strip threshold: generate from the original candidates "
        "(the seed design), or treat retrieval as INCORRECT (rewrite, fall back, or abstain).",
    )
    explain: bool = Field(
        default=False,
        description="Put each candidate's explanation (features, contributions, missing query words) in the trace.",
    )
    correction_timeout_s: float = Field(default=30.0, gt=0, description="Time budget of the whole correction path.")
    max_query_chars: int = Field(default=8000, ge=1, description="Longer queries are refused with a clear error.")
    answer_mode: Optional[Literal["extract", "generate"]] = Field(
        default=None,
        description="extract: answer with the best graded strips, quoted with their sources, no generation; "
        "generate: the synthesizer's answer, checked against its sources. None: extract when the generator is "
        "the bundled small model or there is none, else generate.",
    )
    check_answers: bool = Field(
        default=True, description="Check every generated answer against the passages it was generated from."
    )
    on_ungrounded: Literal["flag", "extract", "abstain"] = Field(
        default="extract",
        description="What an answer that fails the check becomes: kept and flagged, replaced by the quoted "
        "evidence, or an abstention.",
    )
    check_with_grader: bool = Field(
        default=False,
        description="The check also scores each answer sentence against the passages with the grader's scorer.",
    )
    max_quotes: int = Field(default=2, ge=1, description="Strips quoted by an extractive answer.")
    abstain_text: str = Field(
        default="I don't know. The documents I can search do not answer this question.",
        description="The answer given when the engine abstains.",
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
        or ``CRAG_CALIBRATION``), then ``scorer_defaults`` and the field defaults."""
        environ = os.environ if environ is None else environ
        merged: Dict[str, Any] = dict(scorer_defaults or {})
        path = calibration_path or environ.get(f"{ENV_PREFIX}CALIBRATION")
        if path:
            merged.update(load_calibration(path, scorer_name))
        merged.update(_from_env(environ))
        merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
        if "upper" not in merged or "lower" not in merged:
            raise ValueError(
                f"no thresholds for scorer {scorer_name!r}: pass upper= and lower=, set CRAG_UPPER and "
                "CRAG_LOWER, or give a calibration file (calibration_path= or CRAG_CALIBRATION)"
            )
        try:
            settings = cls(**merged)
        except ValidationError as exc:
            raise ValueError(f"invalid CRAG settings: {exc}") from exc
        if settings.lower > settings.upper:
            raise ValueError(f"CRAG thresholds need lower <= upper, got lower={settings.lower}, upper={settings.upper}")
        return settings


WEB_ENV = f"{ENV_PREFIX}WEB"
WebProvider = Literal["searxng", "tavily", "duckduckgo"]


class WebSearchSettings(BaseModel):
    """The opt-in web-search fallback: provider, allow and deny lists, budgets, privacy.

    Resolved in the same order as ``CragSettings``: constructor, then ``CRAG_WEB``
    (on/off) and ``CRAG_WEB_<FIELD>`` variables (lists comma-separated), then these
    defaults. ``forbidden`` is the exception: it is on when any source sets it, so an
    administrator's ``CRAG_WEB_FORBIDDEN=true`` cannot be overridden by code.
    """

    enabled: bool = Field(default=False, description="Search the web on the fallback path (CRAG_WEB=on).")
    forbidden: bool = Field(
        default=False, description="Send nothing off the machine, whatever else says so (CRAG_WEB_FORBIDDEN=true)."
    )
    provider: WebProvider = Field(default="searxng", description="Search provider: searxng, tavily or duckduckgo.")
    searxng_url: Optional[str] = Field(default=None, description="Base URL of a SearxNG instance with JSON enabled.")
    tavily_api_key: Optional[str] = Field(default=None, description="Tavily API key (else TAVILY_API_KEY).", repr=False)
    tavily_url: Optional[str] = Field(default=None, description="Tavily API base URL (default: Tavily's own).")
    duckduckgo_region: str = Field(default="wt-wt", description="DuckDuckGo region, e.g. us-en, de-de, wt-wt.")
    allow_domains: List[str] = Field(
        default_factory=list,
        description="Only these domains (and their subdomains) are fetched; empty allows any domain not denied.",
    )
    deny_domains: List[str] = Field(
        default_factory=list, description="These domains (and their subdomains) are never fetched; wins over allow."
    )
    max_results: int = Field(default=5, ge=1, le=50, description="Search results considered (pages fetched) a query.")
    max_strips: int = Field(default=8, ge=1, description="Web strips handed to grading a query.")
    max_page_bytes: int = Field(default=1_000_000, ge=1, description="A page larger than this is refused.")
    max_total_bytes: int = Field(default=3_000_000, ge=1, description="Bytes read from all pages of one query.")
    timeout_s: float = Field(default=5.0, gt=0, description="Timeout of every single HTTP call.")
    deadline_s: float = Field(default=15.0, gt=0, description="Time budget of one web search, pages included.")
    concurrency: int = Field(default=4, ge=1, le=32, description="Pages fetched at once.")
    redact_patterns: List[str] = Field(
        default_factory=list,
        description="Regular expressions removed from the query before it is sent (in the environment, one a line).",
    )
    allow_private_addresses: bool = Field(
        default=False, description="Fetch loopback and private addresses (tests and intranet search only)."
    )
    user_agent: str = Field(default="llama-index-crag web fallback", description="User-Agent of page fetches.")

    @classmethod
    def resolve(
        cls,
        overrides: Union[None, bool, Mapping[str, Any], WebSearchSettings] = None,
        environ: Optional[Mapping[str, str]] = None,
    ) -> WebSearchSettings:
        """Merge constructor values, ``CRAG_WEB*`` variables and defaults.

        A bool is ``enabled``; a dict or a ``WebSearchSettings`` turns the web on unless it
        says ``enabled: False`` (configuring a provider and then getting no search, silently,
        is what nobody means).
        """
        environ = os.environ if environ is None else environ
        if isinstance(overrides, WebSearchSettings):
            given: Dict[str, Any] = {"enabled": True, **overrides.model_dump(exclude_unset=True)}
        elif isinstance(overrides, bool):
            given = {"enabled": overrides}
        elif overrides is None:
            given = {}
        else:
            given = {"enabled": True, **dict(overrides)}
        unknown = set(given) - set(cls.model_fields)
        if unknown:
            raise ValueError(f"unknown web settings {sorted(unknown)}; see WebSearchSettings for the names")
        merged = _web_from_env(environ)
        merged.update({k: v for k, v in given.items() if v is not None})
        merged["forbidden"] = bool(given.get("forbidden")) or bool(_web_from_env(environ).get("forbidden"))
        try:
            return cls(**merged)
        except ValidationError as exc:
            raise ValueError(f"invalid web settings: {exc}") from exc


def _web_from_env(environ: Mapping[str, str]) -> Dict[str, Any]:
    found: Dict[str, Any] = {}
    if WEB_ENV in environ:
        found["enabled"] = _parse_bool("web", environ[WEB_ENV])
    if environ.get("TAVILY_API_KEY"):
        found["tavily_api_key"] = environ["TAVILY_API_KEY"]
    for name, field in WebSearchSettings.model_fields.items():
        raw = environ.get(f"{WEB_ENV}_{name.upper()}")
        if raw is None or name == "enabled":
            continue
        if field.annotation is bool:
            found[name] = _parse_bool(f"web_{name}", raw)
        elif name.endswith("_domains"):
            found[name] = [item.strip() for item in raw.split(",") if item.strip()]
        elif name == "redact_patterns":
            found[name] = [line for line in raw.splitlines() if line.strip()]
        else:
            found[name] = raw
    return found


_BOOLEANS = ("enabled", "hybrid", "explain", "check_answers", "check_with_grader")


def _from_env(environ: Mapping[str, str]) -> Dict[str, Any]:
    found: Dict[str, Any] = {}
    for name in CragSettings.model_fields:
        raw = environ.get(f"{ENV_PREFIX}{name.upper()}")
        if raw is not None:
            found[name] = _parse_bool(name, raw) if name in _BOOLEANS else raw
    return found


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a boolean: use true or false")


def read_calibration(path: str | Path, scorer_name: Optional[str]) -> Dict[str, Any]:
    """Read a calibration file whole, refusing one of another version or fitted for another scorer."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ValueError(f"calibration file {path} does not exist") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration file {path} is not valid JSON: {exc}") from exc
    version = data.get("version")
    if version != CALIBRATION_VERSION:
        raise ValueError(
            f"calibration file {path} has version {version!r}; this release reads version {CALIBRATION_VERSION}"
        )
    if scorer_name is not None and data.get("scorer") != scorer_name:
        raise ValueError(
            f"calibration file {path} was fitted for scorer {data.get('scorer')!r}, not {scorer_name!r}: "
            "calibrate again for this scorer"
        )
    missing = [k for k in ("upper", "lower") if k not in data.get("thresholds", {})]
    if missing:
        raise ValueError(f"calibration file {path} lacks thresholds {missing}")
    return dict(data)


def load_calibration(path: str | Path, scorer_name: Optional[str]) -> Dict[str, Any]:
    """The thresholds of a calibration file (see ``read_calibration``)."""
    thresholds = read_calibration(path, scorer_name)["thresholds"]
    return {k: thresholds[k] for k in ("upper", "lower", "aggregation", "strip_threshold") if k in thresholds}
