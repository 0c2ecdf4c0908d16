"""A persisted index folder: what ``llama-crag ingest`` writes and ``llama-crag serve`` loads.

The folder holds everything the engine needs, so that serving starts without reading
the documents again or embedding anything but queries:

- ``storage/``: LlamaIndex's own persisted vector index and docstore (the chunks, their
  embeddings, and each document's hash for incremental updates);
- ``embeddings.npz``: the passage vectors of the fallback's sentence windows and of
  strips and candidates graded so far (``DiskCachedEmbedding``), keyed by text;
- ``corpus_stats.json``: the evidence scorer's IDF table over the chunks;
- ``calibration.json``: the calibration the index was built with, if one was given;
- ``manifest.json``: the format version, the source folder, each document's hash,
  the embedding model, the grader directory (a trained reader, if one was given) and
  the counts of the last ingest.

Each document carries its own metadata besides ``doc_id`` and ``file_name`` (front matter, a sidecar
``NAME.meta.json``, ``--metadata``: ``stores/metadata.py``) on every chunk, for ``MetadataFilters``; it is kept
out of the text that is embedded and shown to the LLM, all but ``title``.

Ingesting the same folder again updates only what changed: documents whose content
or metadata hash differs are re-chunked and re-embedded, new ones inserted, vanished ones deleted.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from llama_index.core import Document, StorageContext, VectorStoreIndex, load_index_from_storage
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import BaseNode, MetadataMode

from llama_index_crag.datasets import load_documents
from llama_index_crag.errors import IndexFolderError
from llama_index_crag.stores.chunking import splitter
from llama_index_crag.stores.metadata import (
    MARKDOWN_SUFFIXES,
    checked_metadata,
    described,
    document_of,
    document_with,
    is_sidecar,
    read_front_matter,
    read_sidecar,
    sidecar_of,
)
from llama_index_crag.text.cleaning import clean_text

FORMAT = 1
MANIFEST = "manifest.json"
STORAGE = "storage"
EMBEDDINGS = "embeddings.npz"
CORPUS_STATS = "corpus_stats.json"
CALIBRATION = "calibration.json"
#: Files a folder of documents may hold; others are skipped and counted.
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".html", ".htm", ".csv", ".json")

logger = logging.getLogger(__name__)


@dataclass
class IngestReport:
    """What one ``ingest`` did."""

    index_dir: str
    documents: int
    nodes: int
    added: List[str] = field(default_factory=list)
    updated: List[str] = field(default_factory=list)
    removed: List[str] = field(default_factory=list)
    unchanged: int = 0
    skipped: List[str] = field(default_factory=list)
    seconds: float = 0.0
    #: What was not taken from the documents' metadata, and why (bad front matter or sidecar, a refused key).
    notes: List[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.index_dir}: {self.documents} documents, {self.nodes} chunks; "
            f"{len(self.added)} added, {len(self.updated)} updated, {len(self.removed)} removed, "
            f"{self.unchanged} unchanged"
            + (f", {len(self.skipped)} files skipped" if self.skipped else "")
            + (f", {len(self.notes)} notes on metadata" if self.notes else "")
        )


def read_documents(
    source: Path,
    exclude: Optional[Path] = None,
    metadata: Optional[Mapping[str, Any]] = None,
    notes: Optional[List[str]] = None,
) -> tuple[List[Document], List[str]]:
    """The documents of ``source``: a ``corpus.jsonl`` in the shared dataset format, or a folder of text files.

    Each document's id is its ``doc_id`` or its path relative to ``source``, so that the
    same file keeps its id wherever the folder lives. Returns the documents and the files skipped
    (empty, binary or of a kind this reader does not take). Hidden files and folders are not read, nor
    anything inside ``exclude`` (the index folder, when it lives among the documents) or inside another
    index folder: an index read as documents would grow with every ingest.

    A document's metadata comes from its front matter (Markdown) and its sidecar ``NAME.meta.json``, and
    ``metadata`` is given to every document (it wins over both; a ``corpus.jsonl`` has only ``metadata``).
    What is refused there is appended to ``notes`` (logged as warnings when ``notes`` is None); sidecars are
    never documents.
    """
    source = Path(source)
    if not source.is_dir():
        raise IndexFolderError(f"{source} is not a folder of documents")
    given = checked_metadata(metadata)
    said: List[str] = [] if notes is None else notes
    try:
        return _read_documents(source, exclude, given, said)
    finally:
        if notes is None:
            for note in said:
                logger.warning(note)


def _read_documents(
    source: Path, exclude: Optional[Path], given: Dict[str, Any], notes: List[str]
) -> tuple[List[Document], List[str]]:
    if (source / "corpus.jsonl").exists():
        rows = [({k: v for k, v in d.metadata.items() if k != "doc_id"}, d) for d in load_documents(source)]
        documents = [
            document_with(d.text, d.id_, {"doc_id": d.id_}, o, given, notes) for o, d in rows if d.text.strip()
        ]
        return documents, []
    documents, skipped, ids = [], [], set()
    indexes = {p.parent for p in source.rglob(MANIFEST)} | ({exclude.resolve()} if exclude else set())
    files = sorted(p for p in source.rglob("*") if p.is_file() and _readable(p, source, indexes))
    listed = set(files)
    for path in files:
        relative = _relative(path, source)
        if is_sidecar(path):
            if document_of(path) not in listed:
                notes.append(f"{relative}: no file {document_of(path).name} beside this sidecar: ignored")
            continue
        if path.suffix.lower() not in TEXT_SUFFIXES:
            skipped.append(f"{relative} (not a text format: {', '.join(TEXT_SUFFIXES)})")
            continue
        raw = path.read_bytes()
        if b"\x00" in raw[:4096]:
            skipped.append(f"{relative} (binary content)")
            continue
        text = raw.decode("utf-8", errors="replace")
        own: Dict[str, Any] = {}
        if path.suffix.lower() in MARKDOWN_SUFFIXES:
            text, own = read_front_matter(text, relative, notes)
        if path.suffix.lower() in (".html", ".htm"):
            try:
                text = _html_text(text)
            except Exception as exc:  # bs4's ParserRejectedMarkup ("<![foo[ x ]]>"): this file, not the ingest
                skipped.append(f"{relative} (HTML the parser rejects: {type(exc).__name__})")
                continue
        text = clean_text(text)
        if not text.strip():
            skipped.append(f"{relative} (empty)")
            continue
        if relative in ids:
            raise IndexFolderError(  # a name that is not UTF-8 is written with escapes a real name may hold too
                f"two files of {source} read as the document id {relative!r}: rename one of them"
            )
        ids.add(relative)
        sidecar = sidecar_of(path)
        if sidecar in listed:  # the sidecar's keys win over the front matter's
            own = {**own, **read_sidecar(sidecar, _relative(sidecar, source), notes)}
        base = {"doc_id": relative, "file_name": relative.rsplit("/", 1)[-1]}
        documents.append(document_with(text, relative, base, own, given, notes))
    return documents, skipped


def _relative(path: Path, source: Path) -> str:
    """``path``'s id under ``source``: a name that is not UTF-8 keeps its bytes visible as backslash escapes."""
    return path.relative_to(source).as_posix().encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _readable(path: Path, source: Path, indexes: set[Path]) -> bool:
    """Whether ``path`` (under ``source``) is a document: not hidden, not inside an index folder."""
    if any(part.startswith(".") for part in path.relative_to(source).parts):
        return False
    return not any(folder == path.parent or folder in path.parents for folder in indexes)


def _html_text(html: str) -> str:
    """An HTML file's readable text (scripts, styles and markup dropped)."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html, "html.parser")
    for tag in soup(["script", "style", "noscript", "template"]):
        tag.decompose()
    return soup.get_text("\n", strip=True)


def _embedder(index_dir: Path, embed_model: Optional[BaseEmbedding], read_only: bool = False) -> BaseEmbedding:
    """The embedding model with the folder's passage vectors; serving reads them and never writes the file."""
    from llama_index_crag.local.embedding_cache import DiskCachedEmbedding
    from llama_index_crag.local.models import default_embed_model

    return DiskCachedEmbedding(embed_model or default_embed_model(), index_dir / EMBEDDINGS, read_only=read_only)


def _manifest(index_dir: Path) -> Dict[str, Any]:
    path = index_dir / MANIFEST
    if not path.exists():
        raise IndexFolderError(f"{index_dir} is not an index folder (no {MANIFEST}): make one with llama-crag ingest")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise IndexFolderError(f"{path} is not valid JSON: {exc}") from exc
    if manifest.get("format") != FORMAT:
        raise IndexFolderError(
            f"{index_dir} is an index of format {manifest.get('format')}; this version reads format {FORMAT}: "
            "ingest the documents again"
        )
    return manifest


def ingest(
    source: Path | str,
    index_dir: Path | str,
    embed_model: Optional[BaseEmbedding] = None,
    calibration: Optional[Path | str] = None,
    grader: Optional[Path | str] = None,
    warm_fallback: bool = True,
    progress: bool = False,
    metadata: Optional[Mapping[str, Any]] = None,
) -> IngestReport:
    """Build or update the index folder ``index_dir`` from the documents in ``source``.

    A second run over the same folder embeds only documents added or changed since
    the first and deletes those that are gone. ``calibration`` (a calibration file) and
    ``grader`` (a ``train-grader`` directory) are recorded and used by ``load_engine``.
    With ``warm_fallback`` the fallback's sentence windows are embedded now, so that
    the first INCORRECT query of a server does not pay for it. ``metadata`` is given to every document
    (``--metadata``); it wins over a document's front matter and sidecar, and a change of any of them
    updates the document. What the documents' metadata could not give is in the report's ``notes``.
    """
    import time

    started = time.monotonic()
    source, index_dir = Path(source).resolve(), Path(index_dir)
    if index_dir.resolve() == source:
        raise IndexFolderError(f"the index folder cannot be the folder of documents ({source}): name another --out")
    if index_dir.exists() and not index_dir.is_dir():
        raise IndexFolderError(f"{index_dir} is a file, not an index folder: name a folder")
    # What the index will be served with is checked before any embedding is paid for.
    if grader:
        from llama_index_crag.scorers.reader import load_reader

        load_reader(grader)
    if calibration:
        from llama_index_crag.settings_sources import read_calibration

        read_calibration(calibration, None)
    given = checked_metadata(metadata)
    notes: List[str] = []
    documents, skipped = read_documents(source, exclude=index_dir, metadata=given, notes=notes)
    if not documents:
        held = len(_manifest(index_dir).get("documents", {})) if (index_dir / MANIFEST).exists() else 0
        raise IndexFolderError(
            f"{source} holds no document with text to index"
            + (f" (skipped: {skipped})" if skipped else "")
            + (
                f"; the index {index_dir} keeps the {held} documents of its last ingest: to empty it, delete it"
                if held
                else ""
            )
        )
    index_dir.mkdir(parents=True, exist_ok=True)
    embedder = _embedder(index_dir, embed_model)
    report = IngestReport(index_dir=str(index_dir), documents=len(documents), nodes=0, skipped=skipped, notes=notes)
    old: Dict[str, Any] = {}
    if (index_dir / MANIFEST).exists():
        old = _manifest(index_dir)
        if old.get("documents") and old.get("metadata", {}) != given:
            notes.append(
                f"the last ingest gave every document {described(old.get('metadata', {}))}, this one gives "
                f"{described(given)}: documents that change with it are updated"
            )
        index = load_index_from_storage(
            StorageContext.from_defaults(persist_dir=str(index_dir / STORAGE)),
            embed_model=embedder,
            transformations=[splitter()],
        )
        current = {d.id_ for d in documents}
        for doc_id in sorted(set(old.get("documents", {})) - current):
            index.delete_ref_doc(doc_id, delete_from_docstore=True)
            report.removed.append(doc_id)
        known = old.get("documents", {})
        changed = index.refresh_ref_docs(documents)
        for document, refreshed in zip(documents, changed):
            if not refreshed:
                report.unchanged += 1
            elif document.id_ in known:
                report.updated.append(document.id_)
            else:
                report.added.append(document.id_)
    else:
        index = VectorStoreIndex.from_documents(
            documents, embed_model=embedder, transformations=[splitter()], show_progress=progress
        )
        report.added = [d.id_ for d in documents]
    index.storage_context.persist(persist_dir=str(index_dir / STORAGE))
    nodes = list(index.docstore.docs.values())
    report.nodes = len(nodes)

    from llama_index_crag.scorers.evidence import EvidenceScorer

    stats = EvidenceScorer(embedder).fit_corpus(n.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes)
    _write_json(index_dir / CORPUS_STATS, stats.corpus_stats())
    if calibration:
        shutil.copyfile(calibration, index_dir / CALIBRATION)
    if warm_fallback:
        from llama_index_crag.stores.memory import SentenceWindowRetriever

        SentenceWindowRetriever(nodes, embedder).retrieve("warm the sentence windows")
    report.seconds = round(time.monotonic() - started, 2)
    manifest: Dict[str, Any] = {
        "format": FORMAT,
        "created": old.get("created") or _now(),
        "updated": _now(),
        "source": str(source),
        "embed_model": embedder.model_name,
        "documents": {d.id_: d.hash for d in documents},
        "metadata": given,
        "nodes": len(nodes),
        "calibration": CALIBRATION if (index_dir / CALIBRATION).exists() else None,
        "grader": str(Path(grader).resolve()) if grader else old.get("grader"),
        "last_ingest": {k: v for k, v in asdict(report).items() if k != "index_dir"},
    }
    _write_json(index_dir / MANIFEST, manifest)
    return report


@dataclass
class LoadedIndex:
    """A persisted index folder, loaded."""

    index_dir: Path
    index: VectorStoreIndex
    nodes: List[BaseNode]
    embed_model: BaseEmbedding
    manifest: Dict[str, Any]

    @property
    def calibration_path(self) -> Optional[str]:
        name = self.manifest.get("calibration")
        return str(self.index_dir / name) if name else None

    def describe(self) -> Dict[str, Any]:
        return {
            "path": str(self.index_dir),
            "documents": len(self.manifest.get("documents", {})),
            "chunks": len(self.nodes),
            "updated": self.manifest.get("updated"),
            "grader": self.manifest.get("grader"),
            "calibration": self.calibration_path,
        }


def load_index(index_dir: Path | str, embed_model: Optional[BaseEmbedding] = None) -> LoadedIndex:
    """Load an index folder written by ``ingest``."""
    index_dir = Path(index_dir)
    manifest = _manifest(index_dir)
    embedder = _embedder(index_dir, embed_model, read_only=True)
    if Path(manifest["embed_model"]).name != Path(embedder.model_name).name:
        raise IndexFolderError(
            f"{index_dir} was embedded with {manifest['embed_model']}, not {embedder.model_name}: ingest it again"
        )
    index = load_index_from_storage(
        StorageContext.from_defaults(persist_dir=str(index_dir / STORAGE)), embed_model=embedder
    )
    if not isinstance(index, VectorStoreIndex):
        raise IndexFolderError(f"{index_dir} holds a {type(index).__name__}, not a vector index: ingest it again")
    return LoadedIndex(index_dir, index, list(index.docstore.docs.values()), embedder, manifest)


def _write_json(path: Path, data: Any) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    partial.replace(path)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
