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
import os
import shutil
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

from llama_index.core import Document, StorageContext, VectorStoreIndex, load_index_from_storage
from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.indices.utils import embed_nodes
from llama_index.core.ingestion import run_transformations
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent

from llama_index_crag.datasets import load_documents
from llama_index_crag.errors import IndexFolderError
from llama_index_crag.local.embedding_cache import WrappedEmbedding
from llama_index_crag.stores.chunking import fingerprint, splitter
from llama_index_crag.stores.metadata import (
    MARKDOWN_SUFFIXES,
    TITLE,
    checked_metadata,
    described,
    document_of,
    document_with,
    is_sidecar,
    read_front_matter,
    read_sidecar,
    sidecar_of,
)
from llama_index_crag.stores.readers import HTML_SUFFIXES, UnreadableFile, not_read_reason, read_file, supported
from llama_index_crag.text.cleaning import clean_text

FORMAT = 1
MANIFEST = "manifest.json"
STORAGE = "storage"
EMBEDDINGS = "embeddings.npz"
CORPUS_STATS = "corpus_stats.json"
CALIBRATION = "calibration.json"

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
    #: Files read and skipped, by format (``{".pdf": {"read": 3, "skipped": 1}}``).
    formats: Dict[str, Dict[str, int]] = field(default_factory=dict)
    #: Documents of the last ingest whose file could not be read this time: the index keeps their last version.
    kept: List[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.index_dir}: {self.documents} documents, {self.nodes} chunks; "
            f"{len(self.added)} added, {len(self.updated)} updated, {len(self.removed)} removed, "
            f"{self.unchanged} unchanged"
            + (f", {len(self.kept)} kept as last read" if self.kept else "")
            + (f", {len(self.skipped)} files skipped" if self.skipped else "")
            + (f", {len(self.notes)} notes on metadata" if self.notes else "")
        )

    def by_format(self) -> str:
        """The files of each format read and skipped, in one line ("" for a ``corpus.jsonl``)."""
        ordered = sorted(self.formats.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
        return "; ".join(
            f"{suffix} {counts.get('read', 0)} read"
            + (f", {counts['skipped']} skipped" if counts.get("skipped") else "")
            for suffix, counts in ordered
        )


@dataclass
class _Reading:
    """What reading a folder gave: the documents, the files skipped (with why, and by id), the counts by format."""

    documents: List[Document] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)
    skipped_ids: List[str] = field(default_factory=list)
    formats: Dict[str, Dict[str, int]] = field(default_factory=dict)

    def skip(self, relative: str, suffix: Optional[str], reason: str) -> None:
        """``relative`` is skipped for ``reason``; counted under its format ``suffix`` unless None (a folder)."""
        self.skipped.append(f"{relative} ({reason})")
        self.skipped_ids.append(relative)
        if suffix is not None:
            self.count(suffix, "skipped")

    def count(self, suffix: str, outcome: str) -> None:
        counts = self.formats.setdefault(suffix or "(no suffix)", {})
        counts[outcome] = counts.get(outcome, 0) + 1


def read_documents(
    source: Path,
    exclude: Optional[Path] = None,
    metadata: Optional[Mapping[str, Any]] = None,
    notes: Optional[List[str]] = None,
    progress: bool = False,
) -> tuple[List[Document], List[str]]:
    """The documents of ``source``: a ``corpus.jsonl`` in the shared dataset format, or a folder of files.

    Files are read by format (``stores/readers.py``: text, Markdown, HTML, PDF, Word, PowerPoint). Each document's
    id is its ``doc_id`` or its path relative to ``source``, so that the same file keeps its id wherever the
    folder lives. Returns the documents and the files skipped, each with why (empty, binary, encrypted, a scan
    with no text layer, damaged, or of a kind this reader does not take). Hidden files and folders are not read,
    nor anything inside ``exclude`` (the index folder, when it lives among the documents) or inside another
    index folder: an index read as documents would grow with every ingest. Linked folders are followed, each
    real folder once (a link back up the tree is a loop, skipped with a line saying so).

    A document's metadata comes from its front matter (Markdown) and its sidecar ``NAME.meta.json``, and
    ``metadata`` is given to every document (it wins over both; a ``corpus.jsonl`` has only ``metadata``).
    A format's own title (an HTML page's ``<title>``, a PDF's or Office file's properties) is the document's
    ``title`` unless those give one. What is refused there is appended to ``notes`` (logged as warnings when
    ``notes`` is None); sidecars are never documents. ``progress`` shows a bar over the files on stderr.
    """
    source = Path(source)
    if not source.is_dir():
        raise IndexFolderError(f"{source} is not a folder of documents")
    given = checked_metadata(metadata)
    said: List[str] = [] if notes is None else notes
    try:
        reading = _read_documents(source, exclude, given, said, progress)
        return reading.documents, reading.skipped
    finally:
        if notes is None:
            for note in said:
                logger.warning(note)


def load_folder(path: Path | str, metadata: Optional[Mapping[str, Any]] = None) -> List[Document]:
    """A folder's LlamaIndex ``Document`` objects, read as ``llama-crag ingest`` reads them, for your own index.

    Each has its id (the file's path under ``path``), its ``file_name``, its ``title`` and its own metadata
    (front matter, sidecar), with ``metadata`` given to all (``--metadata``); see ``read_documents``. The files
    skipped and the metadata refused are logged as warnings, one each, saying why.
    """
    notes: List[str] = []
    documents, skipped = read_documents(Path(path), metadata=metadata, notes=notes)
    for line in [*(f"skipped {s}" for s in skipped), *notes]:
        logger.warning("%s: %s", path, line)
    return documents


def _read_documents(
    source: Path, exclude: Optional[Path], given: Dict[str, Any], notes: List[str], progress: bool = False
) -> _Reading:
    reading = _Reading()
    if (source / "corpus.jsonl").exists():
        rows = [({k: v for k, v in d.metadata.items() if k != "doc_id"}, d) for d in load_documents(source)]
        reading.documents = [
            document_with(d.text, d.id_, {"doc_id": d.id_}, o, given, notes) for o, d in rows if d.text.strip()
        ]
        return reading
    ids: set[str] = set()
    files = _files(source, exclude, reading)
    listed = set(files)
    from tqdm import tqdm

    bar = tqdm(files, desc="Reading files", unit="file", disable=not progress, dynamic_ncols=True)
    for path in bar:
        relative = _relative(path, source)
        if is_sidecar(path):
            if document_of(path) not in listed:
                notes.append(f"{relative}: no file {document_of(path).name} beside this sidecar: ignored")
            continue
        suffix = path.suffix.lower()
        if not supported(path):
            reading.skip(relative, suffix, not_read_reason(path))
            continue
        if progress:
            bar.set_postfix_str(path.name[-40:], refresh=False)
        try:
            read = read_file(path, pages=_page_bar(path.name) if progress else None)
        except UnreadableFile as exc:
            reading.skip(relative, suffix, str(exc))
            continue
        except OSError as exc:  # gone since it was listed, unreadable for this user, a link to nothing
            reading.skip(relative, suffix, f"cannot be read: {exc.strerror or type(exc).__name__}")
            continue
        except Exception as exc:  # a reader's own failure on a malformed file: this file, not the ingest
            logger.debug("reading %s failed", relative, exc_info=True)
            if suffix in HTML_SUFFIXES:  # bs4's ParserRejectedMarkup ("<![foo[ x ]]>")
                reading.skip(relative, suffix, f"HTML the parser rejects: {type(exc).__name__}")
            else:
                reading.skip(relative, suffix, f"could not be read: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        text = read.text
        own: Dict[str, Any] = {TITLE: clean_text(read.title)} if read.title else {}
        if suffix in MARKDOWN_SUFFIXES:
            text, front = read_front_matter(text, relative, notes)
            own.update(front)
        text = clean_text(text)
        if not text.strip():
            reading.skip(relative, suffix, "empty")
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
        reading.documents.append(document_with(text, relative, base, own, given, notes))
        reading.count(suffix, "read")
    return reading


def _files(source: Path, exclude: Optional[Path], reading: _Reading) -> List[Path]:
    """The files under ``source`` that may be documents, sorted: not hidden, not in an index folder or ``exclude``.

    Linked folders are followed, each real folder once: a link to a folder already walked (a loop back up the
    tree, or a second way into the same folder) is skipped with a line saying so, and so is a link to nothing.
    """
    excluded = {os.path.realpath(exclude)} if exclude else set()
    seen: set[tuple[int, int]] = set()
    found: List[Path] = []

    def walk(folder: Path) -> None:
        try:
            info = folder.stat()
        except OSError:
            return
        if (info.st_dev, info.st_ino) in seen:
            reading.skip(_relative(folder, source) + "/", None, "a link to a folder already read: not followed")
            return
        seen.add((info.st_dev, info.st_ino))
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            reading.skip(_relative(folder, source) + "/", None, f"cannot be listed: {exc.strerror}")
            return
        if any(e.name == MANIFEST for e in entries) or os.path.realpath(folder) in excluded:
            return  # an index folder: its files are not documents
        for entry in entries:
            if entry.name.startswith("."):
                continue
            path = folder / entry.name
            try:
                is_dir = entry.is_dir()  # follows links
                is_file = not is_dir and entry.is_file()
            except OSError:  # a link loop on itself (ELOOP)
                is_dir = is_file = False
            if is_dir:
                walk(path)
            elif is_file:
                found.append(path)
            elif entry.is_symlink():
                reading.skip(_relative(path, source), path.suffix.lower(), "a link to nothing")

    walk(source)
    return sorted(found)


def _page_bar(name: str) -> Callable[[int], Any]:
    """A progress bar over the pages of one long PDF, under the bar over the files."""

    def bar(pages: int) -> Any:
        from tqdm import tqdm

        return tqdm(total=pages, desc=f"  {name[-30:]}", unit="page", leave=False, position=1, dynamic_ncols=True)

    return bar


def _relative(path: Path, source: Path) -> str:
    """``path``'s id under ``source``: a name that is not UTF-8 keeps its bytes visible as backslash escapes."""
    return path.relative_to(source).as_posix().encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _embedder(index_dir: Path, embed_model: Optional[BaseEmbedding], read_only: bool = False) -> BaseEmbedding:
    """The embedding model with the folder's passage vectors; serving reads them and never writes the file."""
    from llama_index_crag.local.embedding_cache import DiskCachedEmbedding

    return DiskCachedEmbedding(embed_model or _default_embed_model(), index_dir / EMBEDDINGS, read_only=read_only)


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
    the first and deletes those that are gone. A file that was ingested before and cannot be read now
    (damaged, encrypted since) keeps its last version in the index (the report's ``kept``). ``calibration``
    (a calibration file) and ``grader`` (a ``train-grader`` directory) are recorded and used by ``load_engine``.
    With ``warm_fallback`` the fallback's sentence windows are embedded now, so that
    the first INCORRECT query of a server does not pay for it. ``metadata`` is given to every document
    (``--metadata``); it wins over a document's front matter and sidecar, and a change of any of them
    updates the document. What the documents' metadata could not give is in the report's ``notes``.
    ``progress`` shows on stderr a bar (count, rate, time left) for each step that can take long: reading
    the files, embedding the chunks, embedding the sentence windows.
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
    if not source.is_dir():
        raise IndexFolderError(f"{source} is not a folder of documents")
    reading = _read_documents(source, index_dir, given, notes, progress)
    documents, skipped = reading.documents, reading.skipped
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
    fresh = not (index_dir / MANIFEST).exists() and not (index_dir / EMBEDDINGS).exists()
    recorded = _manifest(index_dir)["embed_model"] if (index_dir / MANIFEST).exists() else None
    if embed_model is None and recorded and Path(recorded).name != _default_embed_model_name():
        embed_model = _recorded_embed_model(index_dir, recorded)  # an update embeds as the index was embedded
    counted = _Counted(embed_model or _default_embed_model())
    embedder = _embedder(index_dir, counted)
    report = IngestReport(
        index_dir=str(index_dir),
        documents=len(documents),
        nodes=0,
        skipped=skipped,
        notes=notes,
        formats=reading.formats,
    )
    old: Dict[str, Any] = {}
    transformations: List[TransformComponent] = [splitter(embed_model)]
    cut = fingerprint(embed_model)
    if (index_dir / MANIFEST).exists():
        old = _manifest(index_dir)
        if old.get("documents") and old.get("metadata", {}) != given:
            notes.append(
                f"the last ingest gave every document {described(old.get('metadata', {}))}, this one gives "
                f"{described(given)}: documents that change with it are updated"
            )
        index = load_index_from_storage(
            StorageContext.from_defaults(persist_dir=str(_storage(index_dir))),
            embed_model=embedder,
            transformations=transformations,
        )
        if not isinstance(index, VectorStoreIndex):
            raise IndexFolderError(f"{index_dir} holds a {type(index).__name__}, not a vector index: delete it")
        known = old.get("documents", {})
        current = {d.id_ for d in documents}
        # A file still there that cannot be read now keeps what the last ingest read of it.
        report.kept = sorted(i for i in set(reading.skipped_ids) & set(known) if i not in current)
        for doc_id in sorted(set(known) - current - set(report.kept)):
            index.delete_ref_doc(doc_id, delete_from_docstore=True)
            report.removed.append(doc_id)
        changed = [d for d in documents if index.docstore.get_document_hash(d.id_) != d.hash]
        if old.get("documents") and old.get("chunker") != cut:
            # Chunks cut another way (an older version, another model's window) are not mixed with these.
            before = old.get("chunker") or "chunks not cut to the embedding window"
            notes.append(f"the chunker changed since the last ingest ({before} -> {cut}): every document is cut again")
            changed = list(documents)
        if old.get("documents") and Path(old["embed_model"]).name != Path(embedder.model_name).name:
            # Vectors of two models are not comparable: every document is embedded again with the new one.
            notes.append(
                f"the embedding model changed since the last ingest ({old['embed_model']} -> {embedder.model_name}): "
                "every document is embedded again"
            )
            changed = list(documents)
        for document in changed:
            if index.docstore.get_document_hash(document.id_) is not None:
                index.delete_ref_doc(document.id_, delete_from_docstore=True)
        nodes = run_transformations(changed, transformations)
        with counted.counting("Embedding chunks", _distinct(nodes), "chunk", progress, exact=False):
            _add_nodes(index, nodes, embedder)
        for document in changed:
            index.docstore.set_document_hash(document.id_, document.hash)
            (report.updated if document.id_ in known else report.added).append(document.id_)
        report.unchanged = len(documents) - len(changed)
        report.documents += len(report.kept)
    else:
        storage = StorageContext.from_defaults()
        for document in documents:
            storage.docstore.set_document_hash(document.id_, document.hash)
        nodes = run_transformations(documents, transformations)
        index = VectorStoreIndex([], storage_context=storage, embed_model=embedder, transformations=transformations)
        with counted.counting("Embedding chunks", _distinct(nodes), "chunk", progress, exact=fresh):
            _add_nodes(index, nodes, embedder)
        report.added = [d.id_ for d in documents]
    _persist(index, index_dir)
    nodes = list(index.docstore.docs.values())
    report.nodes = len(nodes)

    from llama_index_crag.scorers.evidence import EvidenceScorer

    stats = EvidenceScorer(embedder).fit_corpus(n.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes)
    _write_json(index_dir / CORPUS_STATS, stats.corpus_stats())
    fitted_on = old.get("calibrated_documents")
    if calibration:
        shutil.copyfile(calibration, index_dir / CALIBRATION)
        fitted_on = None  # a file fitted elsewhere, not on this index's documents
    if warm_fallback:
        from llama_index_crag.stores.memory import SentenceWindowRetriever, sentence_windows

        windows = _distinct(sentence_windows(nodes)) if progress else 0
        with counted.counting("Embedding sentence windows", windows, "window", progress, exact=fresh):
            SentenceWindowRetriever(nodes, embedder).retrieve("warm the sentence windows")
    report.seconds = round(time.monotonic() - started, 2)
    hashes = {d.id_: d.hash for d in documents}
    manifest: Dict[str, Any] = {
        "format": FORMAT,
        "created": old.get("created") or _now(),
        "updated": _now(),
        "source": str(source),
        "embed_model": embedder.model_name,
        "chunker": cut,
        "documents": {**{i: old["documents"][i] for i in report.kept}, **hashes},
        "metadata": given,
        "nodes": len(nodes),
        "calibration": CALIBRATION if (index_dir / CALIBRATION).exists() else None,
        "grader": str(Path(grader).resolve()) if grader else old.get("grader"),
        "last_ingest": {k: v for k, v in asdict(report).items() if k != "index_dir"},
    }
    if fitted_on is not None and manifest["calibration"]:
        manifest["calibrated_documents"] = fitted_on
        drift = calibration_drift(manifest)
        if drift:
            report.notes.append(
                f"the index's calibration was fitted before {drift} of its documents were added, changed or "
                f"removed: fit it again (llama-crag calibrate --index {index_dir} --synthetic 300)"
            )
            manifest["last_ingest"]["notes"] = list(report.notes)
    _write_json(index_dir / MANIFEST, manifest)
    return report


def _add_nodes(index: VectorStoreIndex, nodes: Sequence[BaseNode], embedder: BaseEmbedding) -> None:
    """What ``index.insert_nodes(nodes)`` does over the folder's in-memory stores, with the docstore written once.

    LlamaIndex adds the nodes to the docstore one at a time, and each add reads and rewrites its document's
    record of every node id so far: quadratic in a document's chunks (130 s for the 3,000 chunks of a 2 MB
    file, most of an ingest). Here the vectors are computed in one batch and the docstore takes every node in
    one call, which writes each document's record once.
    """
    nodes = [n for n in nodes if n.get_content(metadata_mode=MetadataMode.EMBED) != ""]
    if not nodes:
        return
    vectors = embed_nodes(nodes, embedder)
    embedded = []
    for node in nodes:
        copy = node.model_copy()
        copy.embedding = vectors[node.node_id]
        embedded.append(copy)
    stored = []
    for node, stored_id in zip(embedded, index.vector_store.add(embedded)):
        bare = node.model_copy()
        bare.embedding = None
        index.index_struct.add_node(bare, text_id=stored_id)
        stored.append(bare)
    index.docstore.add_documents(stored, allow_update=True)
    index.storage_context.index_store.add_index_struct(index.index_struct)


def _distinct(nodes: Sequence[BaseNode]) -> int:
    """How many texts embedding ``nodes`` costs: the cache embeds a text that recurs once."""
    return len({n.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes})


def _default_embed_model_name() -> str:
    from llama_index_crag.local.bundled import bundled_embedding_path

    return Path(bundled_embedding_path()).name


def _recorded_embed_model(index_dir: Path, name: str) -> BaseEmbedding:
    """The embedding model an index folder records (``ingest --embed-model``), from this machine's disk."""
    from llama_index_crag.errors import ConfigError
    from llama_index_crag.local.models import load_embed_model

    try:
        return load_embed_model(name)
    except ConfigError as exc:
        raise IndexFolderError(f"{index_dir} was embedded with {name}, which cannot be loaded here: {exc}") from exc


def _default_embed_model() -> BaseEmbedding:
    from llama_index_crag.local.models import default_embed_model

    return default_embed_model()


class _Counted(WrappedEmbedding):
    """An embedding model that advances a progress bar by the passages it embeds, while one is shown.

    It sits under the folder's cache (``DiskCachedEmbedding``), so it counts what is embedded, not what the
    cache already held. The bar's total is the step's count of passages where nothing is cached yet (a new
    index folder); otherwise it is the count of the first batch the cache asks for, and grows by each later one.
    """

    _bar: Any = PrivateAttr(default=None)
    _exact: bool = PrivateAttr(default=True)
    _calls: int = PrivateAttr(default=0)

    def __init__(self, inner: BaseEmbedding) -> None:
        super().__init__(inner)

    @classmethod
    def class_name(cls) -> str:
        return "CountedEmbedding"

    @contextmanager
    def counting(self, step: str, total: int, unit: str, shown: bool, exact: bool) -> Iterator[None]:
        """Within the block, a bar named ``step`` (shown after half a second, so a step the cache settles
        stays quiet) counts the passages embedded out of ``total``."""
        if not shown:
            yield
            return
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=step, unit=unit, delay=0.5, dynamic_ncols=True)
        self._exact, self._calls = exact, 0
        try:
            yield
            self._bar.total = self._bar.n  # what the cache held was not embedded: done is what was
            self._bar.refresh()
        finally:
            self._bar.close()
            self._bar = None

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._inner.get_text_embedding(text)  # one passage: not counted on the bar

    def get_text_embedding_batch(self, texts: List[str], show_progress: bool = False, **kwargs: Any) -> List[Embedding]:
        bar = self._bar
        if bar is None:
            return super().get_text_embedding_batch(texts, show_progress=show_progress, **kwargs)
        if not self._exact:
            bar.total = (bar.total if self._calls else 0) + len(texts)
            bar.refresh()
        self._calls += 1
        vectors: List[Embedding] = []
        step = max(1, self.embed_batch_size) * 4
        for start in range(0, len(texts), step):
            part = texts[start : start + step]
            vectors.extend(self._inner.get_text_embedding_batch(part, **kwargs))
            bar.update(len(part))
        return vectors


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


def index_embed_model(index_dir: Path | str) -> str:
    """The embedding model an index folder was embedded with, as its manifest records it (nothing is loaded)."""
    return str(_manifest(Path(index_dir))["embed_model"])


def record_calibration(index_dir: Path | str) -> None:
    """Name the folder's ``calibration.json`` (written by ``llama-crag calibrate --index``) in its manifest, so
    that ``load_engine`` grades with it."""
    manifest = _manifest(Path(index_dir))
    manifest["calibration"] = CALIBRATION
    manifest["calibrated_documents"] = dict(manifest.get("documents", {}))  # what it was fitted on
    _write_json(Path(index_dir) / MANIFEST, manifest)


def forget_calibration(index_dir: Path | str) -> Optional[str]:
    """Remove the calibration stored in an index folder (``calibrate --index``, or ``ingest --calibration``) and
    unname it in the manifest, so that ``load_engine`` grades with the scorer's shipped thresholds; the file's name,
    or None when the folder held none."""
    folder = Path(index_dir)
    manifest = _manifest(folder)
    name = manifest.get("calibration")
    manifest["calibration"] = None
    manifest.pop("calibrated_documents", None)
    _write_json(folder / MANIFEST, manifest)  # unnamed first: a folder is never left naming a file that is gone
    if name:
        (folder / str(name)).unlink(missing_ok=True)
    return str(name) if name else None


def calibration_drift(manifest: Mapping[str, Any]) -> Optional[int]:
    """How many documents were added, changed or removed since the index's stored calibration was fitted on it
    (``calibrate --index``); None when no calibration was fitted on the index."""
    fitted = manifest.get("calibrated_documents")
    if not manifest.get("calibration") or fitted is None:
        return None
    now = manifest.get("documents", {})
    return sum(1 for key in set(fitted) | set(now) if fitted.get(key) != now.get(key))


def load_index(index_dir: Path | str, embed_model: Optional[BaseEmbedding] = None) -> LoadedIndex:
    """Load an index folder written by ``ingest``, with the embedding model it was embedded with (its manifest
    names it; ``embed_model`` gives it already loaded)."""
    index_dir = Path(index_dir)
    manifest = _manifest(index_dir)
    if embed_model is None and Path(manifest["embed_model"]).name != _default_embed_model_name():
        embed_model = _recorded_embed_model(index_dir, manifest["embed_model"])
    embedder = _embedder(index_dir, embed_model, read_only=True)
    if Path(manifest["embed_model"]).name != Path(embedder.model_name).name:
        raise IndexFolderError(
            f"{index_dir} was embedded with {manifest['embed_model']}, not {embedder.model_name}: ingest it again"
        )
    index = load_index_from_storage(
        StorageContext.from_defaults(persist_dir=str(_storage(index_dir))), embed_model=embedder
    )
    if not isinstance(index, VectorStoreIndex):
        raise IndexFolderError(f"{index_dir} holds a {type(index).__name__}, not a vector index: ingest it again")
    return LoadedIndex(index_dir, index, list(index.docstore.docs.values()), embedder, manifest)


def _persist(index: VectorStoreIndex, index_dir: Path) -> None:
    """Write ``index``'s stores beside the folder's and then put them in its place, so that an ingest that dies
    while writing (killed, a full disk) leaves the last one's index whole, and a reader never opens half-written
    files. LlamaIndex writes each store's JSON in place; the docstore of 74 manual pages is tens of megabytes."""
    target, partial, before = index_dir / STORAGE, index_dir / _PARTIAL, index_dir / _BEFORE
    shutil.rmtree(partial, ignore_errors=True)
    index.storage_context.persist(persist_dir=str(partial))
    shutil.rmtree(before, ignore_errors=True)
    if target.exists():
        target.rename(before)
    partial.rename(target)  # between the two renames a reader finds the last index in ``before`` (``_storage``)
    shutil.rmtree(before, ignore_errors=True)


#: Where ``_persist`` writes the new stores, and where it moves the last ones while it puts the new ones in place.
_PARTIAL, _BEFORE = f"{STORAGE}.partial", f"{STORAGE}.before"


def _storage(index_dir: Path) -> Path:
    """The folder's stores: ``storage/``, or the last ingest's while one moves its own into place (or died
    doing so)."""
    target, before = index_dir / STORAGE, index_dir / _BEFORE
    return before if not target.exists() and before.exists() else target


def _write_json(path: Path, data: Any) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    partial.replace(path)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
