"""Users' own files, made here with the libraries that write them for real (fpdf2, pypdf, python-docx,
python-pptx), read by ``llama-crag ingest`` and ``load_folder``: the text and title of each format, and a defined
outcome with a line in ingest's output for each kind of bad input."""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import pytest
from llama_index.core import StorageContext

from llama_index_crag import load_folder
from llama_index_crag.cli import main
from llama_index_crag.stores.folder import ingest, load_index, read_documents
from llama_index_crag.stores.readers import PAGES_SHOWN, UnreadableFile, html_text, read_file

#: The sentence a question needs, at the end of a section more than 2,500 characters long.
ANSWER = "The spare key to the ripening cellar is kept in a blue lockbox behind the reception desk."
QUESTION = "Where is the spare key to the ripening cellar kept?"
#: The section's other sentences: about the cellar, none about a key.
FILLER = [
    f"In week {week} of ripening, the cellar team turns every wheel of Vell Blue by hand and notes its weight, "
    f"the colour of its rind and the humidity of rack {week % 7 + 1}."
    for week in range(1, 19)
]
#: A page of a documentation set, as DocBook and many generators write them: navigation tables, no <main>.
MANUAL_PAGE = """<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE html><html><head><title>3.2. Brining the Wheels</title><style>p { color: red }</style></head>
<body><div class="navheader"><table summary="Navigation header"><tr><th colspan="3">3.2. Brining the Wheels</th></tr>
<tr><td><a accesskey="p" href="3-1.html">Prev</a></td><td><a accesskey="u" href="3.html">Up</a></td>
<th>Chapter 3. Making Vell Blue</th><td><a accesskey="h" href="index.html">Home</a></td>
<td><a accesskey="n" href="3-3.html">Next</a></td></tr></table><hr/></div>
<div class="sect1"><div class="titlepage"><h2 class="title">3.2. Brining the Wheels</h2></div>
<div class="toc"><dl><dt><a href="#a">3.2.1. Salt</a></dt><dt><a href="#b">3.2.2. Time</a></dt></dl></div>
<p>Each wheel is floated in
   brine for <code class="literal">two
   days</code>, and the
   <span class="command"><strong>turn</strong></span> command
   records it.</p>
<h3 class="title">3.2.1. Salt</h3>
<pre class="programlisting">turn --wheel 12 \\
     --brine 18%</pre>
<table><caption>Brine strength</caption><tr><th>Cheese</th><th>Salt</th></tr>
<tr><td>Vell Blue</td><td>18%</td></tr><tr><td>Ostmoor Gold</td><td>21%</td></tr></table>
<ul><li>Drain the wheel.</li><li>Dry it for <em>one</em> day.</li></ul>
</div><div class="navfooter"><hr/><table><tr><td><a href="3-1.html">Prev</a></td><td><a href="3.html">Up</a></td>
<td><a href="3-3.html">Next</a></td></tr><tr><td>3.1. Milk</td><td><a href="index.html">Home</a></td>
<td>3.3. Ripening</td></tr></table></div></body></html>
"""
#: A site's page: header, menus, breadcrumbs, a sidebar and a footer around <main>.
SITE_PAGE = """<!DOCTYPE html><html lang="en"><head><title>Opening hours | Ostmoor Creamery</title>
<script>var tracking = "Home";</script></head><body>
<header><a href="/">Ostmoor Creamery</a><nav><a href="/">Home</a> <a href="/keys">Keys and lockers</a>
<a href="/shop">Shop</a></nav></header>
<div role="navigation" class="breadcrumb"><a href="/">Home</a> &gt; <a href="/visit">Visit</a></div>
<main><h1>Opening hours</h1><p>The shop opens at <b>eight</b> and closes at
<a href="/six">six</a>, Monday to Saturday.</p>
<div hidden>Secret staff note that nobody should read.</div></main>
<aside><h2>Related</h2><ul><li><a href="/a">Cave tours</a></li><li><a href="/b">Gift cards</a></li></ul></aside>
<footer><p>© 2024 Ostmoor</p><a href="/privacy">Privacy</a> <a href="/contact">Contact</a></footer></body></html>
"""
NAVIGATION_ONLY = """<html><head><title>Site map</title></head><body><nav><ul><li><a href="/">Home</a></li>
<li><a href="/shop">Shop</a></li><li><a href="/keys">Keys</a></li></ul></nav></body></html>"""


# --- Real files, written with the libraries that make them ------------------------------------------------------


def write_pdf(path: Path, pages: Sequence[str], title: Optional[str] = None) -> Path:
    """A PDF with a text layer: each of ``pages`` on a page of its own (fpdf2)."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("helvetica", size=11)
    if title:
        pdf.set_title(title)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 6, text)
    pdf.output(str(path))
    return path


def write_scanned_pdf(path: Path) -> Path:
    """A PDF whose page is a picture of text only, as a scanner makes it: no text layer."""
    from fpdf import FPDF
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (600, 200), "white")
    ImageDraw.Draw(image).text((20, 80), "The cave was dug in 1871.", fill="black")
    pdf = FPDF()
    pdf.add_page()
    pdf.image(image, x=10, y=10, w=180)
    pdf.output(str(path))
    return path


def write_encrypted_pdf(source: Path, path: Path, password: str) -> Path:
    """``source`` encrypted (pypdf): with a user password it cannot be opened without it; with "" it can."""
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(str(source)))
    writer.encrypt(user_password=password, owner_password="owner-secret", algorithm="RC4-128")
    with path.open("wb") as f:
        writer.write(f)
    return path


def write_docx(path: Path, title: str = "Cellar Handbook", answer: str = ANSWER) -> Path:
    """A Word document: a title, a long section that ends with ``answer``, a list and a table (python-docx)."""
    import docx

    document = docx.Document()
    document.core_properties.title = title
    document.add_heading("Cellar procedures", level=1)
    for sentence in FILLER:
        document.add_paragraph(sentence)
    document.add_paragraph(answer)
    document.add_heading("Deliveries", level=2)
    document.add_paragraph("Milk arrives from the Brill farm before seven.", style="List Bullet")
    document.add_paragraph("Salt arrives on the first Monday of each month.", style="List Bullet")
    table = document.add_table(rows=2, cols=2)
    for row, cells in zip(table.rows, (("Supplier", "Day"), ("Brill farm", "Daily"))):
        for cell, text in zip(row.cells, cells):
            cell.text = text
    document.save(str(path))
    return path


def write_pptx(path: Path) -> Path:
    """A presentation: a titled slide with bullets and speaker notes, a slide with a table (python-pptx)."""
    from pptx import Presentation
    from pptx.util import Inches

    presentation = Presentation()
    presentation.core_properties.title = "Quarterly review"
    slide = presentation.slides.add_slide(presentation.slide_layouts[1])
    slide.shapes.title.text = "Sales in the north"
    slide.placeholders[1].text_frame.text = "Vell Blue sales grew by 12% in the north."
    slide.notes_slide.notes_text_frame.text = "Mention the new warehouse in Brill."
    table_slide = presentation.slides.add_slide(presentation.slide_layouts[5])
    table_slide.shapes.title.text = "Prices"
    table = table_slide.shapes.add_table(2, 2, Inches(1), Inches(2), Inches(6), Inches(1)).table
    for r, cells in enumerate((("Cheese", "Price"), ("Vell Blue", "14 crowns"))):
        for c, text in enumerate(cells):
            table.cell(r, c).text = text
    presentation.save(str(path))
    return path


def write_markdown(path: Path) -> Path:
    path.write_text(
        "---\ntitle: Tasting notes\ntenant: acme\n---\n# Tasting notes\n\n"
        "Ostmoor Gold tastes of hazelnut after eight months.\n"
    )
    return path


def text_of(documents: Sequence[Any], doc_id: str) -> str:
    return next(d.text for d in documents if d.id_ == doc_id)


# --- Each format -------------------------------------------------------------------------------------------------


def test_pdf_docx_pptx_html_and_markdown_give_their_text_and_title(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    write_pdf(
        docs / "guide.pdf",
        ["Chapter one. The creamery was founded in 1871 by the Ostmoor cooperative.", "The cave holds 900 wheels."],
        title="Creamery Guide",
    )
    write_docx(docs / "handbook.docx")
    write_pptx(docs / "review.pptx")
    (docs / "brining.html").write_text(MANUAL_PAGE)
    write_markdown(docs / "notes.md")
    documents, skipped = read_documents(docs)
    assert skipped == []
    by_id = {d.id_: d for d in documents}
    assert {i: d.metadata.get("title") for i, d in by_id.items()} == {
        "guide.pdf": "Creamery Guide",
        "handbook.docx": "Cellar Handbook",
        "review.pptx": "Quarterly review",
        "brining.html": "3.2. Brining the Wheels",
        "notes.md": "Tasting notes",  # the front matter's
    }
    pdf = by_id["guide.pdf"].text
    assert "founded in 1871 by the Ostmoor cooperative." in pdf and "The cave holds 900 wheels." in pdf
    docx_text = by_id["handbook.docx"].text
    assert docx_text.startswith("# Cellar procedures\n\n" + FILLER[0])
    assert ANSWER in docx_text and "## Deliveries" in docx_text
    assert "- Milk arrives from the Brill farm before seven.\n- Salt arrives" in docx_text
    assert "Supplier | Day\nBrill farm | Daily" in docx_text
    pptx_text = by_id["review.pptx"].text
    assert pptx_text.splitlines()[0] == "## Sales in the north"
    assert "- Vell Blue sales grew by 12% in the north." in pptx_text
    assert "Notes: Mention the new warehouse in Brill." in pptx_text
    assert "## Prices" in pptx_text and "Cheese | Price\nVell Blue | 14 crowns" in pptx_text
    assert by_id["notes.md"].text.startswith("# Tasting notes") and by_id["notes.md"].metadata["tenant"] == "acme"


def test_a_manual_page_loses_its_navigation_and_keeps_its_structure() -> None:
    page = html_text(MANUAL_PAGE.encode())
    assert page.title == "3.2. Brining the Wheels"
    lines = page.text.splitlines()
    for furniture in ("Prev", "Up", "Next", "Home", "Chapter 3. Making Vell Blue", "3.1. Milk", "3.3. Ripening"):
        assert not any(furniture in line for line in lines), furniture
    assert "3.2.2. Time" not in page.text  # the table of contents: links only
    assert "color" not in page.text
    # Inline elements (code, a command name in <strong>) stay in their sentence, on one line.
    assert "Each wheel is floated in brine for two days, and the turn command records it." in lines
    assert lines[0] == "## 3.2. Brining the Wheels" and "### 3.2.1. Salt" in lines
    assert "turn --wheel 12 \\\n     --brine 18%" in page.text  # <pre> as laid out
    assert "Brine strength\n\nCheese | Salt\nVell Blue | 18%\nOstmoor Gold | 21%" in page.text
    assert "- Drain the wheel.\n- Dry it for one day." in page.text


def test_a_site_page_keeps_its_main_content_only() -> None:
    page = html_text(SITE_PAGE)
    assert page.title == "Opening hours | Ostmoor Creamery"
    assert page.text == "# Opening hours\n\nThe shop opens at eight and closes at six, Monday to Saturday."


def test_a_page_without_main_drops_its_header_nav_aside_and_footer() -> None:
    page = html_text(SITE_PAGE.replace("<main>", "<div>").replace("</main>", "</div>"))
    assert page.text == "# Opening hours\n\nThe shop opens at eight and closes at six, Monday to Saturday."


def test_a_long_pdf_is_read_with_a_bar_over_its_pages(tmp_path: Path) -> None:
    pdf = write_pdf(tmp_path / "long.pdf", [f"Page {n} says that rack {n} holds {n * 3} wheels." for n in range(300)])
    updates: List[int] = []

    class Bar:
        def update(self, n: int) -> None:
            updates.append(n)

        def close(self) -> None:
            updates.append(0)

    totals: List[int] = []

    def bar(pages: int) -> Bar:
        totals.append(pages)
        return Bar()

    read = read_file(pdf, pages=bar)
    assert totals == [300] and sum(updates) == 300 and updates[-1] == 0  # closed at the end
    assert "Page 299 says that rack 299 holds 897 wheels." in read.text
    assert 300 >= PAGES_SHOWN
    short = write_pdf(tmp_path / "short.pdf", ["One page."])
    read_file(short, pages=bar)
    assert totals == [300]  # a short one is read without a bar of its own


# --- Bad input: each a defined outcome and a line ---------------------------------------------------------------


def write_bad_inputs(docs: Path) -> Dict[str, str]:
    """Every kind of bad input beside good files; returns each skipped file and the reason ingest must give."""
    docs.mkdir()
    text_pdf = write_pdf(docs / "ok.pdf", ["The cave was dug in 1871 by the cooperative."], title="Cave")
    write_encrypted_pdf(text_pdf, docs / "locked.pdf", "s3cret")
    write_encrypted_pdf(text_pdf, docs / "owner-only.pdf", "")  # permissions only: opens without a password
    write_scanned_pdf(docs / "scan.pdf")
    good_docx = write_docx(docs / "handbook.docx")
    (docs / "truncated.docx").write_bytes(good_docx.read_bytes()[:700])
    (docs / "not-word.docx").write_bytes(b"Just some text saved under the wrong name.\n")
    (docs / "protected.docx").write_bytes(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + b"\x00" * 600)
    (docs / "empty.txt").write_bytes(b"")
    (docs / "blank.md").write_text("---\ntitle: Nothing here\n---\n\n   \n")
    (docs / "sitemap.html").write_text(NAVIGATION_ONLY)
    (docs / "legacy.doc").write_bytes(b"\xd0\xcf\x11\xe0" + b"\x00" * 100)
    (docs / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (docs / "français.txt").write_text("La cave a été creusée en 1871. Les meules y mûrissent neuf semaines.\n")
    (docs / "日本語 メモ.md").write_text("# 熟成\n\nチーズは洞窟で九週間熟成されます。\n")
    (docs / "notes with spaces.txt").write_text("The shop opens at eight, Monday to Saturday.\n")
    (docs / "sub").mkdir()
    (docs / "sub" / "deep.txt").write_text("Ostmoor Gold ripens for eight months.\n")
    os.symlink("..", docs / "sub" / "loop")  # back up the tree: followed forever by a naive walk
    os.symlink("missing.txt", docs / "dangling.txt")
    return {
        "locked.pdf": "encrypted: it needs a password to open",
        "scan.pdf": "no text layer in its 1 page (a scan or images only): run OCR on it first",
        "truncated.docx": "not a Word file (damaged, or another format named .docx)",
        "not-word.docx": "not a Word file (damaged, or another format named .docx)",
        "protected.docx": "protected by a password, or an old binary Word file renamed .docx",
        "empty.txt": "empty",
        "blank.md": "empty",
        "sitemap.html": "no text but navigation and page furniture",
        "legacy.doc": "an old binary Word file: save it as .docx",
        "photo.png": "not a format ingest reads",
        "sub/loop/": "a link to a folder already read: not followed",
        "dangling.txt": "a link to nothing",
    }


def test_bad_input_each_has_an_outcome_and_a_line_and_nothing_crashes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], embed_model: Any
) -> None:
    docs = tmp_path / "docs"
    reasons = write_bad_inputs(docs)
    assert main(["ingest", str(docs), "--out", str(tmp_path / "index"), "--no-warm", "--no-progress"]) == 0
    out = capsys.readouterr().out
    for name, reason in reasons.items():
        assert any(line.startswith(f"  skipped {name} (") and reason in line for line in out.splitlines()), name
    assert f"{len(reasons)} files skipped" in out
    by_format = next(line for line in out.splitlines() if line.startswith("  files by format: "))
    for counts in (
        ".pdf 2 read, 2 skipped",
        ".docx 1 read, 3 skipped",
        ".txt 3 read, 2 skipped",
        ".md 1 read, 1 skipped",
    ):
        assert counts in by_format, by_format
    assert ".html 0 read, 1 skipped" in by_format and ".png 0 read, 1 skipped" in by_format
    loaded = load_index(tmp_path / "index", embed_model)
    texts: Dict[str, str] = {}
    for node in loaded.nodes:
        texts[node.ref_doc_id or ""] = texts.get(node.ref_doc_id or "", "") + node.get_content()
    assert set(texts) == {
        "ok.pdf",
        "owner-only.pdf",
        "handbook.docx",
        "français.txt",
        "日本語 メモ.md",
        "notes with spaces.txt",
        "sub/deep.txt",
    }
    assert texts["français.txt"] == "La cave a été creusée en 1871. Les meules y mûrissent neuf semaines."  # as is
    assert "チーズは洞窟で九週間熟成されます。" in texts["日本語 メモ.md"]
    assert "dug in 1871" in texts["owner-only.pdf"]


def write_one_line(path: Path) -> str:
    """A 2 MB text file of one line, as an export or a minified dump makes them."""
    words = ("cheese", "cave", "brine", "wheel", "salt", "rind", "curd", "whey", "cellar", "press", "vat", "mould")
    text = " ".join(words[i % 12] + str(i % 97) for i in range(270_000))
    path.write_text(text)
    assert len(text) > 2_000_000 and "\n" not in text
    return text


def test_a_2_mb_single_line_file_is_read_whole_and_chunked(tmp_path: Path) -> None:
    from llama_index_crag.stores.chunking import chunk

    docs = tmp_path / "docs"
    docs.mkdir()
    text = write_one_line(docs / "one-line.txt")
    (document,), skipped = read_documents(docs)
    assert skipped == [] and document.text == text
    chunks = chunk([document])
    assert len(chunks) > 100 and chunks[-1].get_content().endswith(text[-200:])


@pytest.mark.slow
def test_a_2_mb_single_line_file_is_ingested_with_progress(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], embed_model: Any
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    write_one_line(docs / "one-line.txt")
    report = ingest(docs, tmp_path / "index", embed_model=embed_model, warm_fallback=False, progress=True)
    assert report.added == ["one-line.txt"] and report.nodes > 100
    err = capsys.readouterr().err
    assert "Reading files: 100%" in err and "Embedding chunks: 100%" in err and "chunk/s]" in err


def test_a_folder_of_nothing_readable_is_refused_saying_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "empty.txt").write_bytes(b"")
    write_scanned_pdf(docs / "scan.pdf")
    assert main(["ingest", str(docs), "--out", str(tmp_path / "index")]) == 2
    err = capsys.readouterr().err
    assert "holds no document with text to index" in err and "scan.pdf (no text layer" in err
    assert not (tmp_path / "index").exists()


def test_reingest_updates_the_changed_file_and_keeps_one_that_turned_unreadable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], embed_model: Any
) -> None:
    docs, out = tmp_path / "docs", tmp_path / "index"
    docs.mkdir()
    write_pdf(docs / "guide.pdf", ["The creamery was founded in 1871."], title="Guide")
    docx = write_docx(docs / "handbook.docx")
    notes = write_markdown(docs / "notes.md")
    first = ingest(docs, out, embed_model=embed_model, warm_fallback=False)
    assert sorted(first.added) == ["guide.pdf", "handbook.docx", "notes.md"]
    assert first.formats == {".pdf": {"read": 1}, ".docx": {"read": 1}, ".md": {"read": 1}}

    notes.write_text(notes.read_text().replace("eight months", "nine months"))
    good = docx.read_bytes()
    docx.write_bytes(good[:700])  # damaged while the ingest was away
    assert main(["ingest", str(docs), "--out", str(out), "--no-warm"]) == 0
    said = capsys.readouterr().out
    assert "3 documents" in said and "1 updated, 0 removed, 1 unchanged, 1 kept as last read" in said
    assert (
        "  skipped handbook.docx (not a Word file" in said and "  kept handbook.docx as the last ingest read it" in said
    )
    loaded = load_index(out, embed_model)
    assert any(ANSWER in n.get_content() for n in loaded.nodes if n.ref_doc_id == "handbook.docx")
    assert any("nine months" in n.get_content() for n in loaded.nodes if n.ref_doc_id == "notes.md")
    assert sorted(json.loads((out / "manifest.json").read_text())["documents"]) == [
        "guide.pdf",
        "handbook.docx",
        "notes.md",
    ]

    docx.write_bytes(good)  # repaired: the same text, nothing to embed again
    again = ingest(docs, out, embed_model=embed_model, warm_fallback=False)
    assert (again.added, again.updated, again.removed, again.kept, again.unchanged) == ([], [], [], [], 3)
    docx.unlink()  # gone for good: removed
    assert ingest(docs, out, embed_model=embed_model, warm_fallback=False).removed == ["handbook.docx"]


def test_an_ingest_that_dies_while_writing_leaves_the_last_index_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], embed_model: Any
) -> None:
    docs, out = tmp_path / "docs", tmp_path / "index"
    docs.mkdir()
    notes = write_markdown(docs / "notes.md")
    ingest(docs, out, embed_model=embed_model, warm_fallback=False)
    notes.write_text(notes.read_text().replace("eight months", "nine months"))
    persist = StorageContext.persist

    def disk_fills(self: StorageContext, persist_dir: str, *args: Any, **kwargs: Any) -> None:
        persist(self, persist_dir, *args, **kwargs)
        docstore = Path(persist_dir) / "docstore.json"
        docstore.write_text(docstore.read_text()[:100])  # the disk filled while the docstore was written
        raise OSError(28, "No space left on device", str(docstore))

    monkeypatch.setattr(StorageContext, "persist", disk_fills)
    assert main(["ingest", str(docs), "--out", str(out), "--no-warm"]) == 2
    assert "No space left on device" in capsys.readouterr().err
    monkeypatch.undo()
    # The last ingest's index loads whole, and the next ingest makes the update the failed one could not.
    assert any("eight months" in n.get_content() for n in load_index(out, embed_model).nodes)
    assert ingest(docs, out, embed_model=embed_model, warm_fallback=False).updated == ["notes.md"]
    assert any("nine months" in n.get_content() for n in load_index(out, embed_model).nodes)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("storage")) == ["storage"]


def test_a_reader_finds_the_last_index_while_an_ingest_puts_its_own_in_place(tmp_path: Path, embed_model: Any) -> None:
    docs, out = tmp_path / "docs", tmp_path / "index"
    docs.mkdir()
    write_markdown(docs / "notes.md")
    ingest(docs, out, embed_model=embed_model, warm_fallback=False)
    (out / "storage").rename(out / "storage.before")  # the moment between moving the last stores and the new
    assert any("eight months" in n.get_content() for n in load_index(out, embed_model).nodes)
    assert ingest(docs, out, embed_model=embed_model, warm_fallback=False).unchanged == 1
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("storage")) == ["storage"]


def test_a_linked_folder_is_read_once_and_its_loop_is_not_followed(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "policy.txt").write_text("Visitors wear a hair net in the cave.\n")
    os.symlink(shared, shared / "again")  # a loop inside the linked folder
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The shop opens at eight.\n")
    os.symlink(shared, docs / "shared")
    documents, skipped = read_documents(docs)
    assert [d.id_ for d in documents] == ["a.txt", "shared/policy.txt"]
    assert skipped == ["shared/again/ (a link to a folder already read: not followed)"]


def test_load_folder_gives_the_documents_ingest_reads_and_says_what_it_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "page.html").write_text(SITE_PAGE)
    write_markdown(docs / "notes.md")
    write_scanned_pdf(docs / "scan.pdf")
    with caplog.at_level("WARNING"):
        documents = load_folder(docs, metadata={"team": "cellar"})
    assert [(d.id_, d.metadata["title"], d.metadata["team"]) for d in documents] == [
        ("notes.md", "Tasting notes", "cellar"),
        ("page.html", "Opening hours | Ostmoor Creamery", "cellar"),
    ]
    assert [d.text for d in documents] == [d.text for d in read_documents(docs, metadata={"team": "cellar"})[0]]
    assert any("skipped scan.pdf (no text layer" in r.getMessage() for r in caplog.records)


def test_read_file_says_why_in_words_a_user_can_act_on(tmp_path: Path) -> None:
    with pytest.raises(UnreadableFile, match="needs a password"):
        read_file(write_encrypted_pdf(write_pdf(tmp_path / "a.pdf", ["x"]), tmp_path / "b.pdf", "pw"))
    (tmp_path / "c.pdf").write_bytes(b"%PDF-1.4\n garbage that is no PDF at all")
    with pytest.raises(UnreadableFile, match="not a readable PDF"):
        read_file(tmp_path / "c.pdf")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("hello.txt", "a zip, but not a presentation")
    (tmp_path / "d.pptx").write_bytes(buffer.getvalue())
    with pytest.raises(UnreadableFile, match="a damaged PowerPoint file"):
        read_file(tmp_path / "d.pptx")


# --- From a folder to a quoted answer ----------------------------------------------------------------------------


def write_mixed_folder(docs: Path) -> Path:
    """A PDF, a Word document whose long section ends with ``ANSWER``, a site's page with navigation and a
    Markdown file with front matter."""
    docs.mkdir(parents=True)
    write_pdf(
        docs / "history.pdf",
        [
            "The Ostmoor creamery was founded in 1871 by eleven dairy farmers from the villages around Brill. "
            "They dug the ripening cave into the sandstone hill behind the old mill.",
            "In 1952 the cooperative bought its first steel vats and stopped using the copper ones.",
        ],
        title="A Short History of the Creamery",
    )
    write_docx(docs / "handbook.docx")
    (docs / "opening-hours.html").write_text(SITE_PAGE)
    write_markdown(docs / "tasting-notes.md")
    return docs


def test_the_answer_at_the_end_of_a_long_section_is_quoted(tmp_path: Path, embed_model: Any) -> None:
    from llama_index_crag.cli.ask import answer
    from llama_index_crag.core.persisted import load_engine

    docs = write_mixed_folder(tmp_path / "docs")
    section = read_documents(docs)[0]
    handbook = text_of(section, "handbook.docx")
    assert handbook.index(ANSWER) - handbook.index("# Cellar procedures") > 2500
    ingest(docs, tmp_path / "index", embed_model=embed_model)
    chunks = load_index(tmp_path / "index", embed_model).nodes
    assert not any("Keys and lockers" in n.get_content() or "Privacy" in n.get_content() for n in chunks)
    row = answer(load_engine(load_index(tmp_path / "index", embed_model), None), QUESTION)
    assert not row["abstained"], row
    assert ANSWER in " ".join(row["answer"].split()), row
    assert row["sources"][0]["doc_id"] == "handbook.docx"


#: A reference page as DocBook writes one: each setting or option an entry of a definition list.
REFERENCE_PAGE = """<!DOCTYPE html><html><head><title>19.4. Resource Consumption</title></head><body>
<h2 class="title">19.4. Resource Consumption</h2><h3 class="title">19.4.1. Memory</h3>
<div class="variablelist"><dl class="variablelist">
<dt id="guc-brine-buffers"><span class="term"><code class="varname">brine_buffers</code>
(<code class="type">integer</code>)</span></dt>
<dd><p>Sets the memory the brine tank uses. The default is 128 megabytes.</p>
<div class="note"><h3 class="title">Note</h3><p>On small cellars, useful values are smaller.</p></div></dd>
<dt><span class="term"><code class="option">-w</code><br/></span>
<span class="term"><code class="option">--wait</code></span></dt>
<dd><p>Wait for the turn to complete. The mode can be one of the following:</p>
<div class="variablelist"><dl class="variablelist">
<dt><span class="term">g<br/></span><span class="term">gentle</span></dt>
<dd><p>Turn slowly (the default).</p></dd></dl></div></dd>
<dt><span class="term"><code class="varname">rind_work_mem</code> (<code class="type">integer</code>)</span></dt>
<dd><p>Sets the base memory for turning wheels. The default is four megabytes.</p></dd>
</dl></div>
<p>Raising these values needs a restart of the cellar daemon.</p>
<h3 class="title">19.4.2. Disk</h3><p>Disk settings follow.</p></body></html>
"""


def test_each_entry_of_a_definition_list_is_a_heading_its_definition_is_chunked_under() -> None:
    from llama_index.core import Document

    from llama_index_crag.stores.chunking import chunk

    page = html_text(REFERENCE_PAGE)
    lines = page.text.splitlines()
    entries = [line for line in lines if line.startswith("#")]
    assert entries == [
        "## 19.4. Resource Consumption",
        "### 19.4.1. Memory",
        "#### brine_buffers (integer)",  # inline elements joined as the sentence joins them
        "##### Note",  # a heading inside a definition sits under its term
        "#### -w --wait",  # the terms of one entry, one heading
        "#### rind_work_mem (integer)",
        "### 19.4.1. Memory",  # the text after the list goes back under the heading above it
        "### 19.4.2. Disk",
    ]
    chunks = chunk([Document(text=page.text, id_="settings.html", metadata={"title": page.title})])
    section = {c.get_content().splitlines()[-1]: c.metadata["section"] for c in chunks}
    memory = "19.4. Resource Consumption > 19.4.1. Memory"
    assert section["Sets the base memory for turning wheels. The default is four megabytes."] == (
        f"{memory} > rind_work_mem (integer)"
    )
    # A definition list inside a definition (an option's values) stays in its entry, not an entry of its own.
    assert section["Turn slowly (the default)."] == f"{memory} > -w --wait"
    assert "gentle" in page.text and "# g" not in page.text
    assert section["Raising these values needs a restart of the cellar daemon."] == memory
    assert not any("four megabytes" in c.get_content() and "128 megabytes" in c.get_content() for c in chunks)
