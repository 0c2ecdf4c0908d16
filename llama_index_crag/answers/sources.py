"""Where a quoted passage comes from, named as a reader would want it: file name or title, URL and document id."""

from __future__ import annotations

from typing import Any

from llama_index.core.schema import NodeWithScore


def source_name(node: NodeWithScore) -> str:
    """A short name for where a passage comes from: its file name or title, and its document id."""
    meta = node.node.metadata
    name = shown(meta.get("file_name") or meta.get("title"))
    doc_id = shown(meta.get("doc_id") or node.node.ref_doc_id or node.node.node_id.split("#strips")[0])
    if meta.get("url"):
        name = f"{name}, {shown(meta['url'])}" if name else shown(meta["url"])
    return f"{name}, {doc_id}" if name and doc_id and doc_id not in name else str(name or doc_id)


def shown(value: Any) -> str:
    """A metadata value as a reader sees it: a database may give a number, a list of authors or nothing."""
    if isinstance(value, (list, tuple)):
        return ", ".join(part for part in map(shown, value) if part)
    return "" if value is None else str(value)
