"""Where a text's headings are: one rule, which the chunker cuts sections by and the answer step reads a
reference page's entries by (``stores/chunking.py``, ``answers/extract.entry_above``)."""

from __future__ import annotations

import re
from typing import Optional, Tuple

#: The longest line read as a heading.
MAX_HEADING_CHARS = 200

#: A Markdown heading line: its marks, then its title (closing marks left out).
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$")


def heading(line: str, before: Optional[str], after: Optional[str]) -> Optional[Tuple[int, str]]:
    """``line`` read as a heading: its level and its title (white space joined), or None.

    ``before`` and ``after`` are the lines around it (None at the text's edge). A heading is a Markdown heading
    line that is a block of its own, a blank line (or the edge) before and after it, as every reader writes
    headings and definition-list terms and as Markdown's style asks; and no longer than a heading is. A comment
    line of a configuration file or a script laid out as written (``# TYPE  DATABASE ...``, a ``# raise work_mem
    here`` above a command) is not one."""
    line = line.rstrip("\r")
    if len(line) > MAX_HEADING_CHARS or any(near is not None and near.strip() for near in (before, after)):
        return None
    found = _HEADING.match(line)
    return (len(found.group(1)), " ".join(found.group(2).split())) if found else None
