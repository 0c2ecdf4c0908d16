"""The privacy guard: what of a query may leave the machine."""

from __future__ import annotations

import re
from typing import Sequence

# The local part as RFC 5322 allows it unquoted ("john&jane@", "o'neil.j@"), not only letters, dots, + and -.
_EMAIL = re.compile(r"[\w.!#$%&'*+/=?^`{|}~-]+@[\w-]+(?:\.[\w-]+)+")
# A run of digits, spaces and phone punctuation (dashes of every kind: "555–123–4567"), optionally after +;
# removed only if it has 7 digits or more, so years, amounts and version numbers stay in the query. It may
# touch letters ("DE89370400440532013000", an IBAN; "5551234ext"), not other digits or a decimal point.
_PHONE_LIKE = re.compile(r"(?<![\d.])\+?\(?\d[\d\s().\-/\u2010-\u2015\u2212]{5,}\d(?!\d)")


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
