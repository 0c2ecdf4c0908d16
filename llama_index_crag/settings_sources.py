"""Where settings come from besides the constructor: the environment, the calibration file, a scorer's defaults.

The pydantic-settings sources that ``core/settings.py`` and ``web/settings.py`` stack in the documented order, the
parsing of what the environment spells as text (booleans, comma lists), and errors that
name the variable a bad value came from.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

from pydantic import AfterValidator, BeforeValidator, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, PydanticBaseSettingsSource

from llama_index_crag.errors import ConfigError

CALIBRATION_VERSION = 1


def as_bool(value: Any) -> Any:
    """The documented spellings of a boolean, and no others (pydantic alone would also take t, f, y, n)."""
    if not isinstance(value, str):
        return value
    word = value.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError("is not a boolean: use true or false, 1 or 0, yes or no, on or off")


def _comma_list(value: Any) -> Any:
    return [item.strip() for item in value.split(",") if item.strip()] if isinstance(value, str) else value


def _line_list(value: Any) -> Any:
    return [line for line in value.splitlines() if line.strip()] if isinstance(value, str) else value


def _compiled(patterns: List[str]) -> List[str]:
    """Refuse a pattern that is not a regular expression now, not on the first query that would need it."""
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"holds {pattern!r}, which is not a regular expression: {exc}") from exc
    return patterns


Flag = Annotated[bool, BeforeValidator(as_bool)]
#: A list that the environment gives comma-separated (``a.org,*.b.org``), not as JSON.
CommaList = Annotated[List[str], NoDecode, BeforeValidator(_comma_list)]
#: Regular expressions, which the environment gives one a line (they may hold commas).
PatternList = Annotated[List[str], NoDecode, BeforeValidator(_line_list), AfterValidator(_compiled)]


@dataclass(frozen=True)
class Sources:
    """What one ``resolve`` call reads besides the constructor values."""

    environ: Optional[Mapping[str, str]] = None  # None: os.environ
    calibration_path: Union[None, str, Path] = None  # None: CRAG_CALIBRATION
    scorer_name: Optional[str] = None
    scorer_defaults: Optional[Mapping[str, Any]] = None

    @property
    def env(self) -> Mapping[str, str]:
        """The environment to read."""
        return os.environ if self.environ is None else self.environ


#: The sources of the settings being built now; ``reading`` sets them for the duration of one construction.
_CURRENT: ContextVar[Optional[Sources]] = ContextVar("crag_settings_sources", default=None)


def current_sources() -> Sources:
    """The sources of the settings being built now: what ``reading`` set, else the process environment alone."""
    return _CURRENT.get() or Sources()


@contextmanager
def reading(sources: Sources) -> Iterator[Mapping[str, str]]:
    """Build settings from ``sources`` inside this block (pydantic-settings asks the class, not the call)."""
    token = _CURRENT.set(sources)
    try:
        yield sources.env
    finally:
        _CURRENT.reset(token)


class Environment(EnvSettingsSource):
    """The prefixed variables of the environment being read, documented aliases included."""

    def __init__(
        self, settings_cls: type[BaseSettings], environ: Mapping[str, str], aliases: Mapping[str, str]
    ) -> None:
        self._environ, self._aliases = environ, aliases
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, Optional[str]]:
        found: Dict[str, Optional[str]] = {name.lower(): value for name, value in self._environ.items()}
        for alias, name in self._aliases.items():
            if alias.lower() in found and name.lower() not in found:
                found[name.lower()] = found[alias.lower()]
        return found


class Values(PydanticBaseSettingsSource):
    """Fixed values as one layer of the order: a calibration file's thresholds, a scorer's defaults."""

    def __init__(self, settings_cls: type[BaseSettings], values: Mapping[str, Any]) -> None:
        super().__init__(settings_cls)
        self.values = dict(values)

    def get_field_value(self, field: FieldInfo, field_name: str) -> Tuple[Any, str, bool]:
        return self.values.get(field_name), field_name, False

    def __call__(self) -> Dict[str, Any]:
        return dict(self.values)


class KillSwitch(PydanticBaseSettingsSource):
    """The environment's ``forbidden`` above the constructor: code can forbid the web, never allow it back."""

    def __init__(self, settings_cls: type[BaseSettings], environment: Environment) -> None:
        super().__init__(settings_cls)
        self.environment = environment

    def get_field_value(self, field: FieldInfo, field_name: str) -> Tuple[Any, str, bool]:
        return self().get(field_name), field_name, False

    def __call__(self) -> Dict[str, Any]:
        raw = self.environment().get("forbidden")
        if raw is None:
            return {}
        try:
            return {"forbidden": True} if as_bool(raw) else {}
        except ValueError:
            return {"forbidden": raw}  # refused by validation, naming the variable: a typo never allows the web


def described(cls: type[BaseSettings], exc: ValidationError, environ: Mapping[str, str]) -> str:
    """Each problem of ``exc``, named by the variable its value came from (else by the keyword)."""
    prefix = str(cls.model_config.get("env_prefix", ""))
    aliases: Mapping[str, str] = getattr(cls, "env_aliases", {})
    upper = {name.upper(): value for name, value in environ.items()}
    problems = []
    for error in exc.errors():
        reason = error.get("ctx", {}).get("error", error["msg"])
        if not error["loc"]:
            problems.append(str(reason))
            continue
        field, value = str(error["loc"][0]), error.get("input")
        variable = f"{prefix}{field}".upper()
        names = [variable, *(alias for alias, name in aliases.items() if name == variable)]
        source = next((name for name in names if name in upper and upper[name] == value), field)
        if error["type"] == "value_error":
            problems.append(f"{source}={value!r} {reason}")
        else:
            problems.append(f"{source}={value!r} is invalid: {error['msg'][:1].lower()}{error['msg'][1:]}")
    return "; ".join(problems)


def read_calibration(path: str | Path, scorer_name: Optional[str]) -> Dict[str, Any]:
    """Read a calibration file whole, refusing one of another version or fitted for another scorer.

    Raises:
        ConfigError: the file is missing, not JSON, of another version or scorer, or lacks a threshold.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"calibration file {path} does not exist") from exc
    except IsADirectoryError as exc:
        raise ConfigError(
            f"calibration file {path} is a folder: name the JSON file `llama-crag calibrate` wrote"
        ) from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"calibration file {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("thresholds", {}), dict):
        raise ConfigError(f"calibration file {path} is not a calibration (a JSON object with a 'thresholds' object)")
    version = data.get("version")
    if version != CALIBRATION_VERSION:
        raise ConfigError(
            f"calibration file {path} has version {version!r}; this release reads version {CALIBRATION_VERSION}"
        )
    fitted = str(data.get("scorer"))
    if scorer_name is not None and not same_scorer(fitted, scorer_name):
        mine, theirs = embed_model_of(scorer_name), embed_model_of(fitted)
        model = (
            f" (it was fitted with the embedding model {theirs}, the engine embeds with {mine})"
            if mine and theirs and mine != theirs
            else ""
        )
        raise ConfigError(
            f"calibration file {path} was fitted for scorer {fitted!r}, not {scorer_name!r}{model}: "
            f"calibrate again for this scorer: {calibrate_command(scorer_name)}"
        )
    missing = [k for k in ("upper", "lower") if k not in data.get("thresholds", {})]
    if missing:
        raise ConfigError(f"calibration file {path} lacks thresholds {missing}")
    return dict(data)


#: Where a scorer's name records the embedding model it grades with (a reader's evidence features come last).
_EMBEDDING_PARTS = ("+evidence:", "evidence:", "bi-encoder:")


def embed_model_of(scorer_name: str) -> Optional[str]:
    """The embedding model a scorer's name records (``evidence:MODEL``, ``bi-encoder:MODEL``, a reader's
    ``...+evidence:MODEL``); None for a scorer that embeds nothing (an LLM judge, a cross-encoder)."""
    for part in _EMBEDDING_PARTS:
        head, found, model = scorer_name.rpartition(part)
        if found and (part.startswith("+") or not head):
            return model
    return None


def same_embed_model(first: str, second: str) -> bool:
    """Whether two recorded embedding models are one: the same name, or two spellings of one model folder."""
    if first == second:
        return True
    a, b = Path(first).expanduser(), Path(second).expanduser()
    try:
        return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()
    except (OSError, ValueError):
        return False


def same_scorer(fitted: str, scorer_name: str) -> bool:
    """Whether a calibration fitted for ``fitted`` serves ``scorer_name``: the same name, or the same scorer
    over the same model folder named another way (relative here, absolute where it was calibrated)."""
    if fitted == scorer_name:
        return True
    theirs, mine = embed_model_of(fitted), embed_model_of(scorer_name)
    if theirs is None or mine is None:
        return False
    return fitted[: -len(theirs) or None] == scorer_name[: -len(mine) or None] and same_embed_model(theirs, mine)


def calibrate_command(scorer_name: Optional[str]) -> str:
    """The ``llama-crag calibrate`` command lines that fit a calibration for ``scorer_name``'s embedding model."""
    model = embed_model_of(scorer_name or "")
    named = f" --embed-model {model}" if model else ""
    return (
        f"`llama-crag calibrate --index INDEX_DIR{named} --synthetic 300` over an index folder of your documents "
        f"(stored with the index), or `llama-crag calibrate --dataset DIR{named} --out crag-calibration.json` on "
        "labelled questions (add --synthetic 300 for none), then give the file (calibration_path= or CRAG_CALIBRATION)"
    )


def load_calibration(path: str | Path, scorer_name: Optional[str]) -> Dict[str, Any]:
    """The thresholds of a calibration file (see ``read_calibration``)."""
    thresholds = read_calibration(path, scorer_name)["thresholds"]
    return {k: thresholds[k] for k in ("upper", "lower", "aggregation", "strip_threshold") if k in thresholds}


#: The prefix of every environment variable the settings read.
ENV_PREFIX = "CRAG_"


class OwnSources(BaseSettings):
    """Settings read from this package's own sources only (see ``own_sources``): never a ``.env`` or secrets
    file, and the environment through ``current_sources()`` so that a caller can pass its own."""

    @classmethod
    def own_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource
    ) -> Tuple[PydanticBaseSettingsSource, ...]:
        """The sources, highest first."""
        raise NotImplementedError

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> Tuple[PydanticBaseSettingsSource, ...]:
        return cls.own_sources(settings_cls, init_settings)
