"""The privacy guard: what of a query may leave the machine."""

from __future__ import annotations

import re
from typing import Sequence

_EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
# A run of digits, spaces and phone punctuation, optionally after +; kept only if it has 7 digits or more,
# so years, amounts and version numbers stay in the query.
_PHONE_LIKE = re.compile(r"(?<![\w.])\+?\(?\d[\d\s().\-/]{5,}\d(?![\w])")


def scrub_query(query: str, patterns: Sequence[str] = ()) -> str:
    """The query with e-mail addresses, phone numbers and ``patterns`` (regular expressions) removed.

    Whitespace is collapsed afterwards; the result is exactly what a search provider receives.
    """
    text = query
    for pattern in patterns:
        try:
            text = re.sub(pattern, " ", text)
        except re.error as exc:
            raise ValueError(f"web redact pattern {pattern!r} is not a valid regular expression: {exc}") from exc
    text = _EMAIL.sub(" ", text)
    text = _PHONE_LIKE.sub(lambda m: " " if sum(c.isdigit() for c in m.group()) >= 7 else m.group(), text)
    return " ".join(text.split())
