"""The opt-in web source's settings: provider, allow and deny lists, budgets, privacy (``CRAG_WEB*``)."""

from __future__ import annotations

from typing import Any, ClassVar, Dict, Literal, Mapping, Optional, Tuple, Union

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from llama_index_crag.errors import ConfigError
from llama_index_crag.settings_sources import (
    ENV_PREFIX,
    CommaList,
    Environment,
    Flag,
    KillSwitch,
    OwnSources,
    PatternList,
    Sources,
    current_sources,
    described,
    reading,
)

WEB_ENV = f"{ENV_PREFIX}WEB"


WebProvider = Literal["searxng", "tavily", "duckduckgo"]


class WebSearchSettings(OwnSources):
    """The opt-in web-search fallback: provider, allow and deny lists, budgets, privacy.

    Resolved in the same order as ``CragSettings``: constructor, then ``CRAG_WEB``
    (on/off) and ``CRAG_WEB_<FIELD>`` variables (lists comma-separated), then these
    defaults. ``forbidden`` is the exception: it is on when any source sets it, so an
    administrator's ``CRAG_WEB_FORBIDDEN=true`` cannot be overridden by code.
    """

    model_config = SettingsConfigDict(env_prefix=f"{WEB_ENV}_", extra="forbid")
    #: Documented variables that are not ``CRAG_WEB_<FIELD>``, and the one each stands for when that is unset.
    env_aliases: ClassVar[Dict[str, str]] = {
        WEB_ENV: f"{WEB_ENV}_ENABLED",
        "TAVILY_API_KEY": f"{WEB_ENV}_TAVILY_API_KEY",
    }

    enabled: Flag = Field(default=False, description="Search the web on the fallback path (CRAG_WEB=on).")
    forbidden: Flag = Field(
        default=False, description="Send nothing off the machine, whatever else says so (CRAG_WEB_FORBIDDEN=true)."
    )
    provider: WebProvider = Field(default="searxng", description="Search provider: searxng, tavily or duckduckgo.")
    searxng_url: Optional[str] = Field(default=None, description="Base URL of a SearxNG instance with JSON enabled.")
    tavily_api_key: Optional[str] = Field(default=None, description="Tavily API key (else TAVILY_API_KEY).", repr=False)
    tavily_url: Optional[str] = Field(default=None, description="Tavily API base URL (default: Tavily's own).")
    duckduckgo_region: str = Field(default="wt-wt", description="DuckDuckGo region, e.g. us-en, de-de, wt-wt.")
    allow_domains: CommaList = Field(
        default_factory=list,
        description="Only these domains (and their subdomains) are fetched; empty allows any domain not denied.",
    )
    deny_domains: CommaList = Field(
        default_factory=list, description="These domains (and their subdomains) are never fetched; wins over allow."
    )
    max_results: int = Field(default=5, ge=1, le=50, description="Search results considered (pages fetched) a query.")
    max_strips: int = Field(default=8, ge=1, description="Web strips handed to grading a query.")
    max_page_bytes: int = Field(default=1_000_000, ge=1, description="A page larger than this is refused.")
    max_total_bytes: int = Field(default=3_000_000, ge=1, description="Bytes read from all pages of one query.")
    timeout_s: float = Field(default=5.0, gt=0, description="Timeout of every single HTTP call.")
    deadline_s: float = Field(default=15.0, gt=0, description="Time budget of one web search, pages included.")
    concurrency: int = Field(default=4, ge=1, le=32, description="Pages fetched at once.")
    redact_patterns: PatternList = Field(
        default_factory=list,
        description="Regular expressions removed from the query before it is sent (in the environment, one a line).",
    )
    allow_private_addresses: Flag = Field(
        default=False, description="Fetch loopback and private addresses (tests and intranet search only)."
    )
    user_agent: str = Field(default="llama-index-crag web fallback", description="User-Agent of page fetches.")

    @classmethod
    def own_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource
    ) -> Tuple[PydanticBaseSettingsSource, ...]:
        """The kill switch, then constructor, then environment."""
        environment = Environment(settings_cls, current_sources().env, cls.env_aliases)
        return KillSwitch(settings_cls, environment), init_settings, environment

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

        Raises:
            ConfigError: an unknown field, or a value that cannot be used, naming the variable it came from.
        """
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
            raise ConfigError(f"unknown web settings {sorted(unknown)}; see WebSearchSettings for the names")
        with reading(Sources(environ)) as env:
            try:
                return cls(**{k: v for k, v in given.items() if v is not None})
            except ValidationError as exc:
                raise ConfigError(f"invalid web settings: {described(cls, exc, env)}") from exc
