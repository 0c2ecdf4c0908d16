"""``llama-crag ingest`` keeps each document's metadata (front matter, sidecar, --metadata) on every chunk, out of
the embedded and generated text, so that ``MetadataFilters`` can bound what a reader sees."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
from llama_index.core.schema import BaseNode, MetadataMode
from llama_index.core.vector_stores.types import FilterOperator, MetadataFilter, MetadataFilters

from llama_index_crag.cli import main
from llama_index_crag.datasets import load_documents
from llama_index_crag.errors import ConfigError
from llama_index_crag.scope import Scope
from llama_index_crag.stores.folder import IngestReport, ingest, load_index, read_documents
from llama_index_crag.stores.metadata import metadata_pair, pairs_metadata, split_front_matter

#: Long enough to be cut into several chunks, so that "every chunk" is more than one.
LONG = " ".join(
    f"Policy {i} of the Ostmoor office says that staff in room {i} may claim {i % 9 + 1} extra days of leave."
    for i in range(160)
)


def _ingest(docs: Path, out: Path, embed_model: Any, **kwargs: Any) -> IngestReport:
    return ingest(docs, out, embed_model=embed_model, warm_fallback=False, **kwargs)


def _by_doc(nodes: List[BaseNode]) -> Dict[str, List[BaseNode]]:
    found: Dict[str, List[BaseNode]] = {}
    for node in nodes:
        found.setdefault(node.ref_doc_id or "", []).append(node)
    return found


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, embed_model: Any) -> Dict[str, Any]:
    root = tmp_path_factory.mktemp("metadata")
    docs = root / "docs"
    docs.mkdir()
    (docs / "acme.md").write_text(
        "---\ntitle: Leave at Ostmoor\ntenant: tnt-acme-7f3a\nyear: 2024\npublished: 2024-05-01\n"
        "tags: [hr, leave]\n---\n# Leave\n\n" + LONG + "\n"
    )
    (docs / "globex.html").write_text("<html><body><p>Globex pays its staff on the last Friday.</p></body></html>")
    (docs / "globex.html.meta.json").write_text(json.dumps({"tenant": "globex", "year": 2023, "tags": ["pay"]}))
    (docs / "shared.txt").write_text("The canteen opens at noon for every company in the building.")
    report = _ingest(docs, root / "index", embed_model, metadata={"region": "eu"})
    return {"docs": docs, "report": report, "nodes": load_index(root / "index", embed_model).nodes}


def test_front_matter_sidecar_and_command_line_metadata_reach_every_chunk(folder: Dict[str, Any]) -> None:
    report, chunks = folder["report"], _by_doc(folder["nodes"])
    assert sorted(chunks) == ["acme.md", "globex.html", "shared.txt"]  # the sidecar is no document
    assert not report.skipped and not report.notes
    assert len(chunks["acme.md"]) >= 2
    for node in chunks["acme.md"]:
        meta = node.metadata
        assert (meta["tenant"], meta["year"], meta["published"], meta["tags"]) == (
            "tnt-acme-7f3a",
            2024,
            "2024-05-01",  # a YAML date is stored as its ISO text
            ["hr", "leave"],
        )
        assert (meta["title"], meta["region"], meta["doc_id"], meta["file_name"]) == (
            "Leave at Ostmoor",
            "eu",
            "acme.md",
            "acme.md",
        )
        assert "tenant:" not in node.get_content() and not node.get_content().startswith("---")
    assert chunks["acme.md"][0].get_content().startswith("# Leave")  # the front matter is out of the text
    (globex,) = chunks["globex.html"]
    assert (globex.metadata["tenant"], globex.metadata["year"], globex.metadata["region"]) == ("globex", 2023, "eu")
    (shared,) = chunks["shared.txt"]
    assert "tenant" not in shared.metadata and shared.metadata["region"] == "eu"


def test_user_metadata_stays_out_of_the_embedded_and_generated_text_but_the_title(folder: Dict[str, Any]) -> None:
    for node in _by_doc(folder["nodes"])["acme.md"]:
        for mode in (MetadataMode.EMBED, MetadataMode.LLM):
            text = node.get_content(metadata_mode=mode)
            assert "Leave at Ostmoor" in text
            assert "tnt-acme-7f3a" not in text and "2024-05-01" not in text and "region" not in text


def test_filters_on_the_ingested_metadata_select_exactly_a_tenants_chunks(folder: Dict[str, Any]) -> None:
    nodes = folder["nodes"]
    acme = Scope.of({"tenant": "tnt-acme-7f3a"}).keep(nodes)
    assert acme and {n.ref_doc_id for n in acme} == {"acme.md"}
    assert len(acme) == len([n for n in nodes if n.ref_doc_id == "acme.md"])
    assert {n.ref_doc_id for n in Scope.of({"tenant": ["globex", "tnt-acme-7f3a"]}).keep(nodes)} == {
        "acme.md",
        "globex.html",
    }
    recent = MetadataFilters(filters=[MetadataFilter(key="year", value=2024, operator=FilterOperator.GTE)])
    assert {n.ref_doc_id for n in Scope.of(recent).keep(nodes)} == {"acme.md"}
    since_may = MetadataFilters(
        filters=[MetadataFilter(key="published", value="2024-04-30", operator=FilterOperator.GT)]
    )
    assert {n.ref_doc_id for n in Scope.of(since_may).keep(nodes)} == {"acme.md"}
    pay = MetadataFilters(filters=[MetadataFilter(key="tags", value="pay", operator=FilterOperator.CONTAINS)])
    assert {n.ref_doc_id for n in Scope.of(pay).keep(nodes)} == {"globex.html"}
    assert len(Scope.of({"region": "eu"}).keep(nodes)) == len(nodes)


def test_the_command_line_wins_over_the_sidecar_which_wins_over_the_front_matter(
    tmp_path: Path, embed_model: Any
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("---\ntenant: front\nteam: blue\nyear: 2020\n---\nThe vault closes at dusk.\n")
    (docs / "a.md.meta.json").write_text(json.dumps({"tenant": "sidecar", "year": 2021}))
    report = _ingest(docs, tmp_path / "one", embed_model)
    (node,) = load_index(tmp_path / "one", embed_model).nodes
    assert (node.metadata["tenant"], node.metadata["team"], node.metadata["year"]) == ("sidecar", "blue", 2021)
    assert not report.notes

    report = _ingest(docs, tmp_path / "two", embed_model, metadata={"tenant": "cli"})
    (node,) = load_index(tmp_path / "two", embed_model).nodes
    assert (node.metadata["tenant"], node.metadata["team"], node.metadata["year"]) == ("cli", "blue", 2021)
    assert report.notes == ["a.md: its tenant='sidecar' is replaced by the ingest's --metadata tenant='cli'"]


def test_bad_front_matter_and_sidecars_are_noted_and_their_documents_ingested_without_them(
    tmp_path: Path, embed_model: Any
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "bad-yaml.md").write_text("---\ntitle: [never closed\ntenant: x\n---\nThe ferry leaves at seven.\n")
    (docs / "list-yaml.md").write_text("---\n- a\n- b\n---\nThe bridge opens at eight.\n")
    (docs / "bad-json.txt").write_text("The bakery sells rye on Tuesdays.")
    (docs / "bad-json.txt.meta.json").write_text("{tenant: acme")
    (docs / "array.txt").write_text("The library lends maps for a week.")
    (docs / "array.txt.meta.json").write_text('["tenant", "acme"]')
    (docs / "mixed.txt").write_text("The market is held on the square.")
    (docs / "mixed.txt.meta.json").write_text(
        json.dumps(
            {
                "tenant": "acme",
                "team": {"name": "blue"},
                "grid": [[1, 2]],
                "owner": None,
                "doc_id": "stolen",
                "crag_source": "web",
                "score": 0.5,
                "draft": False,
            }
        )
    )
    (docs / "orphan.txt.meta.json").write_text('{"tenant": "acme"}')

    report = _ingest(docs, tmp_path / "index", embed_model)
    chunks = _by_doc(load_index(tmp_path / "index", embed_model).nodes)
    assert sorted(chunks) == ["array.txt", "bad-json.txt", "bad-yaml.md", "list-yaml.md", "mixed.txt"]
    assert chunks["bad-yaml.md"][0].get_content().strip() == "The ferry leaves at seven."
    assert chunks["list-yaml.md"][0].get_content().strip() == "The bridge opens at eight."
    for doc_id in ("bad-yaml.md", "list-yaml.md", "bad-json.txt", "array.txt"):
        assert set(chunks[doc_id][0].metadata) == {"doc_id", "file_name"}, doc_id
    mixed = chunks["mixed.txt"][0].metadata
    assert mixed == {
        "doc_id": "mixed.txt",
        "file_name": "mixed.txt",
        "draft": False,
        "score": 0.5,
        "tenant": "acme",
    }
    said = "\n".join(report.notes)
    for expected in (
        "bad-yaml.md: its front matter is not valid YAML",
        "list-yaml.md: its front matter is a YAML list, not a mapping",
        "bad-json.txt.meta.json: not valid JSON",
        "array.txt.meta.json: a JSON list, not an object",
        "mixed.txt.meta.json: team is a nested object",
        "mixed.txt.meta.json: grid is a list holding lists",
        "mixed.txt.meta.json: owner has no value",
        "mixed.txt.meta.json: doc_id is reserved",
        "mixed.txt.meta.json: crag_source is reserved",
        "orphan.txt.meta.json: no file orphan.txt beside this sidecar",
    ):
        assert expected in said, expected
    assert len(report.notes) == 10


def test_reingest_updates_a_document_whose_sidecar_or_front_matter_changed(tmp_path: Path, embed_model: Any) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The Ostmoor creamery ages Vell Blue for nine weeks.")
    (docs / "a.txt.meta.json").write_text(json.dumps({"tenant": "acme", "year": 2024}))
    (docs / "b.md").write_text("---\ntenant: globex\n---\nThe shop opens at eight.\n")
    (docs / "c.txt").write_text("Membership costs one share.")
    out = tmp_path / "index"
    _ingest(docs, out, embed_model)

    (docs / "a.txt.meta.json").write_text(json.dumps({"year": 2024, "tenant": "acme"}))  # same keys, other order
    same = _ingest(docs, out, embed_model)
    assert (same.added, same.updated, same.removed, same.unchanged) == ([], [], [], 3)

    (docs / "a.txt.meta.json").write_text(json.dumps({"tenant": "initech", "year": 2024}))
    (docs / "b.md").write_text("---\ntenant: umbrella\n---\nThe shop opens at eight.\n")
    changed = _ingest(docs, out, embed_model)
    assert (changed.updated, changed.unchanged) == (["a.txt", "b.md"], 1)
    nodes = load_index(out, embed_model).nodes
    assert {n.ref_doc_id for n in Scope.of({"tenant": "initech"}).keep(nodes)} == {"a.txt"}
    assert {n.ref_doc_id for n in Scope.of({"tenant": "umbrella"}).keep(nodes)} == {"b.md"}
    assert not Scope.of({"tenant": ["acme", "globex"]}).keep(nodes)

    (docs / "a.txt.meta.json").unlink()
    gone = _ingest(docs, out, embed_model)
    assert gone.updated == ["a.txt"]
    assert "tenant" not in _by_doc(load_index(out, embed_model).nodes)["a.txt"][0].metadata

    with_cli = _ingest(docs, out, embed_model, metadata={"region": "eu"})
    assert sorted(with_cli.updated) == ["a.txt", "b.md", "c.txt"]
    assert any("this one gives region='eu'" in note for note in with_cli.notes)


def test_a_corpus_jsonl_takes_the_ingests_metadata_and_keeps_its_titles(tmp_path: Path, embed_model: Any) -> None:
    rows = [
        {"doc_id": "d1", "title": "Vell Blue", "text": "The Ostmoor creamery ages Vell Blue for nine weeks."},
        {"doc_id": "d2", "text": "The shop opens at eight."},
    ]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Without metadata a document hashes as before, so that an index built earlier is not embedded again.
    plain, _ = read_documents(tmp_path)
    assert [d.hash for d in plain] == [d.hash for d in load_documents(tmp_path)]
    _ingest(tmp_path, tmp_path / "index", embed_model, metadata={"tenant": "acme"})
    nodes = {n.ref_doc_id: n for n in load_index(tmp_path / "index", embed_model).nodes}
    assert nodes["d1"].metadata == {"doc_id": "d1", "title": "Vell Blue", "tenant": "acme"}
    assert nodes["d2"].metadata == {"doc_id": "d2", "tenant": "acme"}
    assert "Vell Blue" in nodes["d1"].get_content(MetadataMode.LLM)
    assert "acme" not in nodes["d1"].get_content(MetadataMode.LLM)


def test_the_ingest_refuses_metadata_it_cannot_keep_before_reading_anything(tmp_path: Path) -> None:
    for bad, said in (
        ({"doc_id": "x"}, "doc_id is reserved"),
        ({"cragScore": 1}, "cragScore is reserved"),
        ({"team": {"name": "blue"}}, "team is a nested object"),
    ):
        with pytest.raises(ConfigError, match=said):
            ingest(tmp_path, tmp_path / "index", warm_fallback=False, metadata=bad)
    assert not (tmp_path / "index").exists()


def test_command_line_values_are_typed_simply_and_a_repeated_key_is_a_list() -> None:
    pairs = [
        metadata_pair(text)
        for text in ("year=2024", "ratio=0.5", "draft=TRUE", "zip=007", "big=1e3", "note=a=b", "tag=x", "tag=y")
    ]
    assert pairs_metadata(pairs) == {
        "year": 2024,
        "ratio": 0.5,
        "draft": True,
        "zip": "007",
        "big": "1e3",
        "note": "a=b",
        "tag": ["x", "y"],
    }


def test_front_matter_is_only_a_closed_block_at_the_very_top() -> None:
    assert split_front_matter("---\na: 1\n---\nbody") == ("body", "a: 1")
    assert split_front_matter("\ufeff---\r\na: 1\r\n---\r\nbody") == ("body", "a: 1\r")
    assert split_front_matter("---\n---\nbody") == ("body", "")
    assert split_front_matter("---\nno closing line\n") == ("---\nno closing line\n", None)
    assert split_front_matter("text\n---\na: 1\n---\n") == ("text\n---\na: 1\n---\n", None)


def test_the_cli_takes_metadata_and_prints_what_it_refused(
    tmp_path: Path, embed_model: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("llama_index_crag.local.models.default_embed_model", lambda: embed_model)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("---\ntenant: [a\n---\nThe vault closes at dusk.\n")
    out = tmp_path / "index"
    argv = ["ingest", str(docs), "--out", str(out), "--no-warm", "--metadata", "tenant=acme"]
    assert main([*argv, "--metadata", "year=2024"]) == 0
    printed = capsys.readouterr().out
    assert "1 notes on metadata" in printed
    assert "  metadata: a.md: its front matter is not valid YAML" in printed
    (node,) = load_index(out, embed_model).nodes
    assert (node.metadata["tenant"], node.metadata["year"]) == ("acme", 2024)

    for bad, said in (("tenant", "argument --metadata: 'tenant' is not KEY=VALUE"), ("doc_id=x", "doc_id is reserved")):
        with pytest.raises(SystemExit) as exited:
            main([*argv, "--metadata", bad])
        assert exited.value.code == 2
        assert said in capsys.readouterr().err
    assert main(["ingest", str(docs), "--store", "postgresql://nobody@127.0.0.1:1/x", "--metadata", "a=b"]) == 2
    assert "--metadata is for an index folder" in capsys.readouterr().err
