"""Every error this package raises on purpose, in one family: catch ``CragError`` to catch them all.

Each also derives from the built-in error it stood for before (``ValueError`` for bad
input or configuration, ``RuntimeError`` for a part that failed, ``TimeoutError``), so
code that caught those still does. Messages name the cause and the fix.
"""

from __future__ import annotations


class CragError(Exception):
    """The base of every error raised on purpose by llama-index-crag."""


# --- configuration and input --------------------------------------------------------------------------------------


class ConfigError(CragError, ValueError):
    """A setting, environment variable or calibration file that cannot be used; the message names it."""


class ScopeError(ConfigError):
    """A scope (metadata filters) that is malformed, or that a retriever or store cannot apply; never ignored."""


class DatasetError(CragError, ValueError):
    """A dataset, corpus or labelled-pairs file that cannot be used: malformed, or lacking what the job needs
    (answerable and unanswerable questions, positive and negative pairs); the message names the file."""


class InvalidQueryError(CragError, ValueError):
    """The query cannot be answered as given (empty, or longer than ``max_query_chars``)."""


class MissingDependency(CragError, ImportError):
    """An optional package a feature needs is not installed; the message names the install command."""


# --- the loop's parts ---------------------------------------------------------------------------------------------


class GenerationError(CragError, RuntimeError):
    """The generator LLM failed; the message names the model and, where it has one, its server."""


class GeneratorUnavailable(CragError, RuntimeError):
    """The bundled llama.cpp generator cannot run on this machine; the message names the cause and the fix."""


class RewriteError(CragError, RuntimeError):
    """The rewrite failed; the engine records ``str(error)`` and searches with the question's keywords instead."""


class CorrectiveTimeout(CragError, TimeoutError):
    """A step of the correction path ran past what was left of its time budget."""


class GraderLoadError(CragError, ValueError):
    """A grader directory that cannot be used: missing, of another version or base model, or damaged."""


# --- stores and the web -------------------------------------------------------------------------------------------


class RetrievalUnavailableError(CragError, RuntimeError):
    """The retriever's backing store cannot be reached (a server answers 503); the message names the store."""


class IndexFolderError(CragError, ValueError):
    """The folder is not a persisted index this version can load, or the documents cannot be read."""


class StoreError(CragError, ValueError):
    """The store is missing, of another format, or was embedded with another model; the message names the fix."""


class StoreUnavailableError(StoreError, RetrievalUnavailableError):
    """The store's PostgreSQL cannot be reached now (down, restarting, or every connection busy past the timeout)."""


class WebSearchError(CragError, RuntimeError):
    """The search provider could not be asked, or did not answer in time; the web branch abstains."""


__all__ = [
    "ConfigError",
    "CorrectiveTimeout",
    "CragError",
    "DatasetError",
    "GenerationError",
    "GeneratorUnavailable",
    "GraderLoadError",
    "IndexFolderError",
    "InvalidQueryError",
    "MissingDependency",
    "RetrievalUnavailableError",
    "RewriteError",
    "StoreError",
    "StoreUnavailableError",
    "WebSearchError",
]
