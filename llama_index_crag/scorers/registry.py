"""The one place a scorer is chosen: ``from_spec`` for a name, ``default_scorer`` for the engine's default.

Every caller goes through here: ``CorrectiveQueryEngine.from_defaults``, the index folder and
PostgreSQL stores, ``llama-crag calibrate`` and ``grade-report``, and ``llama-crag eval``.

Specs:

- ``default``: what ``from_defaults()`` grades with (``default_scorer``);
- ``evidence``: the ``EvidenceScorer`` (bundled MiniLM plus lexical and answer-type evidence);
- ``packaged``: the reader shipped in the package, as a cascade behind the evidence features;
- ``reader``: the reader in ``CRAG_GRADER`` when that names a grader directory, else the packaged one;
- ``reader:DIR``: the reader in the grader directory ``DIR`` (``llama-crag train-grader``);
- ``bi-encoder``, ``llm-judge``, ``cross-encoder:MODEL``, ``flag:MODEL``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

from llama_index.core.base.embeddings.base import BaseEmbedding

from llama_index_crag.errors import ConfigError, GraderLoadError
from llama_index_crag.scorers.base import RelevanceScorer
from llama_index_crag.scorers.evidence import EvidenceScorer

logger = logging.getLogger(__name__)

#: Whether ``from_defaults()`` grades with the reader shipped in the package (behind the evidence
#: features, as a cascade) rather than with the evidence features alone. Set by measurement: the
#: reader becomes the default only where its 5-fold cross-validated figures beat the evidence
#: scorer's on SQuAD 2.0, SciFact and the held-out human pairs (docs/grading.md, "The packaged reader").
PACKAGED_READER_IS_DEFAULT = False

#: The spec names (``reader:DIR``, ``cross-encoder:MODEL`` and ``flag:MODEL`` take a value after the colon).
SPECS = ("default", "evidence", "packaged", "reader", "reader:DIR", "bi-encoder", "llm-judge",
         "cross-encoder:MODEL", "flag:MODEL")  # fmt: skip


def check_spec(spec: str) -> str:
    """``spec`` if it names a scorer (nothing is loaded); a ``ConfigError`` listing the names otherwise."""
    head, _, value = spec.partition(":")
    if spec in SPECS or (head in ("reader", "cross-encoder", "flag") and value):
        return spec
    raise ConfigError(f"unknown scorer {spec!r}: use one of {', '.join(SPECS)}")


def from_spec(
    spec: str,
    embed_model: Optional[BaseEmbedding] = None,
    corpus: Optional[Sequence[str]] = None,
    llm: Any = None,
) -> RelevanceScorer:
    """The scorer ``spec`` names (see the module's docstring), IDF from ``corpus`` where it uses one."""
    check_spec(spec)
    head, _, value = spec.partition(":")
    if spec == "default":
        return default_scorer(embed_model, corpus)
    if spec == "evidence":
        return EvidenceScorer(embed_model, corpus=corpus)
    if head in ("packaged", "reader"):
        from llama_index_crag.scorers.reader import ReaderScorer, packaged_grader_path

        return ReaderScorer(value or _reader_dir() or packaged_grader_path(), embed_model, corpus=corpus)
    if spec == "bi-encoder":
        from llama_index_crag.scorers.bi_encoder import BiEncoderScorer

        return BiEncoderScorer(embed_model)
    if spec == "llm-judge":
        from llama_index_crag.scorers.llm_judge import LLMJudgeScorer

        if llm is None:
            from llama_index_crag.local.models import default_llm

            llm = default_llm()[0]
        return LLMJudgeScorer(llm)
    from llama_index_crag.scorers.cross_encoder import CrossEncoderScorer

    return CrossEncoderScorer(value, backend="flagembedding" if head == "flag" else "sentence-transformers")


def default_scorer(
    embed_model: Optional[BaseEmbedding] = None,
    corpus: Optional[Sequence[str]] = None,
    grader: Optional[str] = None,
) -> RelevanceScorer:
    """The offline default scorer, IDF from ``corpus`` when given.

    ``grader`` (or ``CRAG_GRADER``) chooses: a grader directory gives a ``ReaderScorer`` over
    it (a directory that cannot be loaded is an error: it was asked for by name);
    ``"evidence"`` gives the ``EvidenceScorer``; ``"packaged"`` the reader shipped in the
    package. Unset, the packaged reader is used when ``PACKAGED_READER_IS_DEFAULT`` (its
    cross-validated figures beat the evidence scorer's, see docs/grading.md), else the
    evidence scorer. A packaged reader that cannot be loaded (a damaged install) never
    stops the engine: the evidence scorer grades instead and says so in ``warnings``,
    which every trace of the engine carries.
    """
    grader = grader or os.environ.get("CRAG_GRADER") or ("packaged" if PACKAGED_READER_IS_DEFAULT else "evidence")
    if grader == "evidence":
        return EvidenceScorer(embed_model, corpus=corpus)
    if grader != "packaged":
        return from_spec(f"reader:{grader}", embed_model, corpus)
    try:
        return from_spec("packaged", embed_model, corpus)
    except (GraderLoadError, ImportError, OSError) as exc:
        warning = f"the packaged reader could not be loaded, grading with the evidence features instead: {exc}"
        logger.warning(warning)
        scorer = EvidenceScorer(embed_model, corpus=corpus)
        scorer.warnings = (warning,)
        return scorer


def spec_defaults(spec: str) -> Dict[str, Any]:
    """The shipped weights and thresholds a spec grades with, without loading a model (a cache key for results)."""
    from llama_index_crag.scorers.bi_encoder import BiEncoderScorer
    from llama_index_crag.scorers.evidence import FEATURES

    if spec == "evidence" or (spec == "default" and not PACKAGED_READER_IS_DEFAULT and not _reader_dir()):
        return {
            "features": list(FEATURES),
            "weights": list(EvidenceScorer.DEFAULT_WEIGHTS),
            "thresholds": dict(EvidenceScorer.DEFAULT_THRESHOLDS),
        }
    return {"spec": spec, "grader": _reader_dir(), "thresholds": dict(BiEncoderScorer.BUNDLED_THRESHOLDS)}


def _reader_dir() -> Optional[str]:
    """``CRAG_GRADER`` when it names a grader directory (not ``evidence`` or ``packaged``)."""
    value = os.environ.get("CRAG_GRADER")
    return value if value and value not in ("evidence", "packaged") and Path(value).name else None


def report_scorers(
    specs: Sequence[str], corpus: Optional[Sequence[str]] = None
) -> Iterator[Tuple[str, RelevanceScorer]]:
    """The scorers a report measures, built one at a time: the engine's default first, whatever ``specs``
    names, and each scorer once (``evidence`` beside a default that is the evidence scorer is measured once)."""
    seen: set = set()
    for spec in ["default", *[s for s in specs if s != "default"]]:
        scorer = from_spec(spec, corpus=corpus)
        if scorer.name not in seen:
            seen.add(scorer.name)
            yield spec, scorer
