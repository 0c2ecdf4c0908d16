"""Chunks the embedding model reads whole, and a grader that reads all of a passage longer than that.

The bundled MiniLM reads 256 word pieces and drops the rest without a word: a chunk longer than that is searched
and graded by its beginning. These tests count with the model's own tokenizer, not with the chunker's counter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List

import numpy as np
import pytest
from llama_index.core import Document
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import BaseNode, MetadataMode

from llama_index_crag.cli.doctor import check_index
from llama_index_crag.core.persisted import load_engine
from llama_index_crag.evaluation.raw_docs import CountingEmbedding
from llama_index_crag.local.portable import OK, WARN
from llama_index_crag.scorers.bi_encoder import LONG_WARNING_START, BiEncoderScorer, EmbeddingWindow
from llama_index_crag.scorers.evidence import EvidenceScorer
from llama_index_crag.stores.chunking import SECTION, chunk, splitter
from llama_index_crag.stores.folder import ingest, load_index
from llama_index_crag.text.headings import MAX_HEADING_CHARS, heading

FILLER = (
    "The northern archive keeps the staff records of building {i} in grey boxes on the second floor, and the "
    "clerk who opens them signs the ledger by the door before noon. "
)
ANSWER = "The default work_mem is four megabytes."


def _prose(n: int) -> str:
    return "".join(FILLER.format(i=i) for i in range(n))


def _model_pieces(embed_model: Any, text: str) -> int:
    """Word pieces the model reads of ``text``, its own markers included, counted by the model's tokenizer."""
    return len(embed_model._model.tokenizer(text)["input_ids"])


def _embedded(node: BaseNode) -> str:
    return node.get_content(metadata_mode=MetadataMode.EMBED)


def _cosine(a: List[float], b: List[float]) -> float:
    x, y = np.asarray(a), np.asarray(b)
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


TABLE_ROWS = [f"setting_{i} | integer | {i * 7} | Sets how many widgets pool {i} keeps warm." for i in range(70)]
CODE_LINES = [f"    SELECT col_{i}, count(*) FROM table_{i} GROUP BY col_{i};" for i in range(50)]


@pytest.fixture(scope="module")
def documents() -> List[Document]:
    guide = (
        "# Backup\n\nThere are three approaches.\n\n## SQL Dump\n\n"
        + _prose(30)
        + "\n\n## Settings\n\nname | type | default | description\n"
        + "\n".join(TABLE_ROWS)
        + "\n\n## Queries\n\n```sql\n"
        + "\n".join(CODE_LINES)
        + "\n```\n\nAfter the code comes prose again.\n\n## Config\n\n"
        + "# Allow any local user:\nlocal all all trust\n\n# The same over TCP/IP.\n#\nhost all all 127.0.0.1/32 md5\n"
    )
    long_sentence = " ".join(f"word{i}" for i in range(900)) + "."
    return [
        Document(
            text=guide,
            id_="guide.md",
            metadata={"title": "Backup and Restore", "doc_id": "guide.md"},
            excluded_embed_metadata_keys=["doc_id"],
            excluded_llm_metadata_keys=["doc_id"],
        ),
        Document(text=long_sentence, id_="one-sentence.txt", metadata={"title": "T " * 40}),
        Document(text="Short.", id_="short.txt"),
    ]


@pytest.fixture(scope="module")
def nodes(documents: List[Document], embed_model: Any) -> List[BaseNode]:
    return chunk(documents, embed_model)


def test_every_chunk_fits_the_window_counted_with_the_models_tokenizer(nodes: List[BaseNode], embed_model: Any) -> None:
    window = embed_model._model.max_seq_length
    sizes = [_model_pieces(embed_model, _embedded(n)) for n in nodes]
    assert max(sizes) <= window
    assert len(nodes) > 10  # the long documents were cut, not kept whole
    # No text is lost: every word of the 900-word sentence is in some chunk.
    words = " ".join(n.get_content() for n in nodes if n.ref_doc_id == "one-sentence.txt").split()
    assert [w.rstrip(".") for w in words] == [f"word{i}" for i in range(900)]


def test_the_default_chunker_counts_with_the_bundled_models_tokenizer() -> None:
    window = splitter().window
    assert window.exact and window.tokens == 254  # MiniLM's 256 less [CLS] and [SEP]


def test_a_sentence_at_the_end_of_a_long_section_changes_the_embedding_of_its_chunk(embed_model: Any) -> None:
    section = _prose(20)
    assert len(section) > 3000
    with_answer = chunk([Document(text=f"## Memory\n\n{section}{ANSWER}", id_="d")], embed_model)
    without = {n.node_id: n for n in chunk([Document(text=f"## Memory\n\n{section}", id_="d")], embed_model)}
    holder = next(n for n in with_answer if ANSWER in n.get_content())
    assert holder.node_id in without  # the same chunk, with the sentence and without it
    a = embed_model.get_text_embedding(_embedded(holder))
    b = embed_model.get_text_embedding(_embedded(without[holder.node_id]))
    assert _cosine(a, b) < 0.995
    # With LlamaIndex's default 1,024-token chunks the whole section is one chunk, and the model never sees the end.
    old = SentenceSplitter().get_nodes_from_documents([Document(text=f"## Memory\n\n{section}{ANSWER}", id_="d")])
    plain = SentenceSplitter().get_nodes_from_documents([Document(text=f"## Memory\n\n{section}", id_="d")])
    assert len(old) == 1
    old_vectors = [embed_model.get_text_embedding(_embedded(n)) for n in (old[0], plain[0])]
    assert _cosine(*old_vectors) > 0.9999


def test_a_heading_travels_with_every_chunk_of_its_section(nodes: List[BaseNode]) -> None:
    guide = [n for n in nodes if n.ref_doc_id == "guide.md"]
    dump = [n for n in guide if "northern archive" in n.get_content()]
    assert len(dump) >= 3
    for node in dump:
        assert node.metadata[SECTION] == "Backup > SQL Dump"
        assert "section: Backup > SQL Dump" in _embedded(node)
        assert "section: Backup > SQL Dump" in node.get_content(metadata_mode=MetadataMode.LLM)
        assert "title: Backup and Restore" in _embedded(node)
        assert "doc_id" not in _embedded(node)  # what the document hid stays hidden
    assert {n.metadata[SECTION] for n in guide if "SELECT" in n.get_content()} == {"Backup > Queries"}
    assert guide[0].metadata[SECTION] == "Backup" and "There are three approaches." in guide[0].get_content()
    # A comment line of a configuration file is not a heading: it stays in its section.
    config = [n for n in guide if "local all all trust" in n.get_content() or "host all all" in n.get_content()]
    assert {n.metadata[SECTION] for n in config} == {"Backup > Config"}


def test_table_rows_and_code_lines_are_never_cut_and_a_continued_table_repeats_its_header(
    nodes: List[BaseNode],
) -> None:
    guide = [n for n in nodes if n.ref_doc_id == "guide.md"]
    table = [n for n in guide if n.metadata.get(SECTION) == "Backup > Settings"]
    assert len(table) >= 2
    seen: List[str] = []
    for node in table:
        lines = [line for line in node.get_content().splitlines() if line and not line.startswith("#")]
        assert lines[0] == "name | type | default | description"
        assert all(line in TABLE_ROWS for line in lines[1:])
        seen += lines[1:]
    assert seen == TABLE_ROWS  # every row once, in order
    code = [n for n in guide if n.metadata.get(SECTION) == "Backup > Queries"]
    lines = [line for n in code for line in n.get_content().splitlines() if "SELECT" in line]
    assert [line.strip() for line in lines] == [line.strip() for line in CODE_LINES]
    assert len(code) >= 2


def test_ids_are_stable_across_rechunking_and_an_edit_at_the_end_keeps_earlier_chunks(
    documents: List[Document], nodes: List[BaseNode], embed_model: Any
) -> None:
    again = chunk(documents, embed_model)
    assert [(n.node_id, n.get_content()) for n in again] == [(n.node_id, n.get_content()) for n in nodes]
    guide = [n.node_id for n in nodes if n.ref_doc_id == "guide.md"]
    assert guide == [f"guide.md#{i}" for i in range(len(guide))]
    edited = documents[0].model_copy()
    edited.set_content(documents[0].text + "\nOne more closing line.")
    after = chunk([edited], embed_model)
    before = [n for n in nodes if n.ref_doc_id == "guide.md"]
    assert [(n.node_id, n.get_content()) for n in after[:-1]] == [(n.node_id, n.get_content()) for n in before[:-1]]


def test_a_model_without_a_tokenizer_is_chunked_by_an_estimate() -> None:
    from llama_index.core.embeddings import MockEmbedding

    window = splitter(MockEmbedding(embed_dim=8)).window
    assert not window.exact and window.tokens == 256
    found = chunk([Document(text=_prose(40), id_="d")], MockEmbedding(embed_dim=8))
    assert len(found) > 3 and all(window.count(_embedded(n)) <= 256 for n in found)


def test_the_grader_reads_all_of_a_long_passage_and_only_a_long_one_in_windows(embed_model: Any) -> None:
    counter = CountingEmbedding(embed_model)
    scorer = BiEncoderScorer(counter, cache_size=1000)
    filler = _prose(12)
    assert scorer.window.count(filler) > scorer.window.tokens
    short = ["The archive opens at nine.", ANSWER]
    scorer.score_texts("what is the default work_mem", short)
    assert counter.embedded == 2 and scorer.warnings == ()  # passages that fit: one embedding each, no warning
    low, high = scorer.score_texts("what is the default work_mem", [filler, filler + ANSWER])
    assert high > low + 0.1  # the answer at the end of a long passage counts
    windows = [w for ws in scorer.windows_of([filler, filler + ANSWER]) for w in ws or ()]
    assert counter.embedded == 2 + len(set(windows)) and len(windows) >= 4
    assert all(scorer.window.count(w) <= scorer.window.tokens for w in windows)
    assert scorer.warnings and scorer.warnings[0].startswith(LONG_WARNING_START)


def test_the_evidence_scorer_counts_long_passages_in_its_corpus_and_warns(embed_model: Any) -> None:
    scorer = EvidenceScorer(embed_model, corpus=["A short passage.", _prose(12)])
    assert scorer.over_window == 1 and any(w.startswith(LONG_WARNING_START) for w in scorer.warnings)
    stats = json.loads(json.dumps(scorer.corpus_stats()))
    assert stats["over_window"] == 1 and stats["window"] == 254
    loaded = EvidenceScorer(embed_model).load_corpus_stats(stats)
    assert any(w.startswith(LONG_WARNING_START) for w in loaded.warnings)
    fitting = EvidenceScorer(embed_model, corpus=["A short passage.", "Another one."])
    assert fitting.over_window == 0 and fitting.warnings == ()
    assert fitting.score_texts("a passage", ["A short passage."]) == EvidenceScorer(
        embed_model, corpus=["A short passage.", "Another one."]
    ).score_texts("a passage", ["A short passage."])


def test_doctor_says_when_an_index_holds_passages_longer_than_the_window(
    tmp_path: Path, embed_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# Archive\n\n" + _prose(12) + ANSWER)
    ingest(docs, tmp_path / "new", embed_model=embed_model, warm_fallback=False)
    fine = check_index(str(tmp_path / "new"))
    assert fine.status == OK and "all within" in fine.detail
    # An index cut by LlamaIndex's default splitter (as ingest cut before): its passage is too long.
    monkeypatch.setattr("llama_index_crag.stores.folder.splitter", lambda *a, **k: SentenceSplitter())
    ingest(docs, tmp_path / "old", embed_model=embed_model, warm_fallback=False)
    long = check_index(str(tmp_path / "old"))
    assert long.status == WARN and "1 exceed" in long.detail and "ingest the documents again" in long.fix
    # The engine over that folder says so in every trace, from the first query on.
    for folder, warned in (("old", True), ("new", False)):
        engine = load_engine(load_index(tmp_path / folder, embed_model), None)
        warnings = (engine.query("what is the default work_mem").metadata or {})["crag"]["warnings"]
        assert any(w.startswith(LONG_WARNING_START) for w in warnings) is warned


def test_windows_cover_the_whole_text_in_whole_sentences() -> None:
    window = EmbeddingWindow(80, None)
    text = _prose(6)
    parts = window.windows(text)
    assert len(parts) > 2
    assert all(window.count(p) <= 80 for p in parts)
    joined = " ".join(parts)
    assert all(FILLER.format(i=i).strip() in joined for i in range(6))
    cut = window.hard_cut(text, 25)
    assert "".join(cut) == text and all(window.count(c) <= 25 for c in cut)


def test_a_reingest_under_another_chunker_cuts_every_unchanged_document_again(
    tmp_path: Path, embed_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# Archive\n\n" + _prose(12) + ANSWER)
    (docs / "b.md").write_text("# Ledger\n\n" + _prose(3))
    index = tmp_path / "index"
    with monkeypatch.context() as patched:  # the index as ingest cut it before: LlamaIndex's 1,024-token chunks
        patched.setattr("llama_index_crag.stores.folder.splitter", lambda *a, **k: SentenceSplitter())
        patched.setattr("llama_index_crag.stores.folder.fingerprint", lambda *a, **k: "old-cut")
        ingest(docs, index, embed_model=embed_model, warm_fallback=False)
    assert json.loads((index / "manifest.json").read_text())["chunker"] == "old-cut"
    report = ingest(docs, index, embed_model=embed_model, warm_fallback=False)
    assert sorted(report.updated) == ["a.md", "b.md"] and report.unchanged == 0
    assert any("chunker changed" in note and "old-cut" in note for note in report.notes)
    nodes = load_index(index, embed_model).nodes
    assert all(_model_pieces(embed_model, _embedded(n)) <= 256 for n in nodes)
    # Asked again with the same chunker, nothing is cut again.
    again = ingest(docs, index, embed_model=embed_model, warm_fallback=False)
    assert again.unchanged == 2 and not again.updated and not any("chunker" in n for n in again.notes)


@pytest.mark.parametrize(
    ("line", "before", "after", "read"),
    [
        ("## 19.4. Resource Consumption", None, "", (2, "19.4. Resource Consumption")),
        ("#### work_mem (integer) ####", "", None, (4, "work_mem (integer)")),  # closing marks are no title
        ("### -m mode   --mode=mode\r", "", "", (3, "-m mode --mode=mode")),  # a CRLF file's line
        ("# raise work_mem for reports", "", "SET work_mem = '64MB';", None),  # a script's comment above a command
        ("# TYPE  DATABASE  USER  ADDRESS  METHOD", "local all all trust", "", None),
        ("#hashtag", None, None, None),  # no space after the marks
        ("####### seven marks", None, None, None),
        ("# " + "a" * MAX_HEADING_CHARS, None, None, None),  # a paragraph, not a title
    ],
)
def test_a_heading_is_a_markdown_heading_line_alone_between_blank_lines(
    line: str, before: Any, after: Any, read: Any
) -> None:
    # One rule for the chunker's sections and the answer step's entries (answers.extract.entry_above).
    assert heading(line, before, after) == read
