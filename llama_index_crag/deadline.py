"""The time limit of the loop's step that is running now, for a blocking call that can stop at it.

A driver abandons a step past its limit (``core/loop.py``'s drivers), but a thread cannot be killed: a
llama.cpp generation would go on to its token cap and keep the model's lock, so that the
next query's rewrite waited behind it and ran out of time too. The drivers set the step's
deadline here; a part that can stop early (``local.llamacpp.BundledLlamaCPP``) reads it,
waits for the model no longer than the step may run, and stops generating at it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

_DEADLINE: contextvars.ContextVar[Optional[float]] = contextvars.ContextVar("crag_step_deadline", default=None)


def step_deadline() -> Optional[float]:
    """The running step's deadline (``time.monotonic()`` seconds), or None outside a step with a limit."""
    return _DEADLINE.get()


@contextlib.contextmanager
def running_until(deadline: Optional[float]) -> Iterator[None]:
    """Within the block, ``step_deadline()`` is ``deadline`` (threads and tasks started in it inherit it)."""
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)
