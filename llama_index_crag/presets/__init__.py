"""Presets a corpus opts into: rules written while reading one kind of document, off by default.

A preset is not part of the default loop: it was written for one kind of corpus and is
measured on it. ``quote_preset`` (``CRAG_QUOTE_PRESET``) names the quote rules to add to the
answer step; ``structured_abstracts`` (``presets/structured_abstracts.py``) never quotes what a
biomedical abstract says of its aims, methods, background or open questions. A new preset is
a module here with its rules, and a name in ``QUOTE_PRESETS`` and ``QuotePreset``.
"""

from __future__ import annotations

from typing import Callable, Dict, Literal, Tuple

from llama_index_crag.presets.structured_abstracts import (
    describes_methods,
    gives_background,
    states_a_gap,
    states_an_aim,
)

#: A rule: whether a strip must not be quoted for a question (``rule(question, text)``).
QuoteRule = Callable[[str, str], bool]
#: The names ``quote_preset`` takes (``CRAG_QUOTE_PRESET``).
QuotePreset = Literal["structured_abstracts"]
#: The presets of ``quote_preset``, each the rules it adds to the answer step.
QUOTE_PRESETS: Dict[str, Tuple[QuoteRule, ...]] = {
    "structured_abstracts": (states_an_aim, describes_methods, gives_background, states_a_gap),
}
