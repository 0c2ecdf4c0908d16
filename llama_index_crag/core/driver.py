"""The drivers of the corrective loop: it yields each piece of I/O, and a driver runs it sync or async.

The loop (``core/loop.py``) is one generator for both the sync and the async call (``Loop.correct``
for ``retrieve``/``aretrieve``, ``Loop.run``, which runs those steps and then the answer's, for
``query``/``aquery``): it yields an ``Io`` (how to do the step sync and async, and its time limit)
and gets the result, or the error, sent back. ``drive`` runs the steps in the calling
thread (a step with a limit in a daemon thread that is abandoned when the limit passes);
``adrive`` awaits them with ``asyncio.wait_for``. Both turn a step past its limit into
``CorrectiveTimeout``, and set the step's deadline (``llama_index_crag.deadline``) for the parts
that can stop at it. ``text_response`` and ``check_when_streamed`` shape what the loop returns.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, Generator, Generic, List, Optional, Sequence, Tuple, TypeVar, Union

from llama_index.core.base.response.schema import RESPONSE_TYPE, AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.schema import NodeWithScore

from llama_index_crag.deadline import running_until
from llama_index_crag.errors import CorrectiveTimeout


@dataclass
class Io:
    """One piece of I/O the loop hands to a driver: how to do it sync and async, and its time limit."""

    run: Callable[[], Any]
    arun: Callable[[], Awaitable[Any]]
    timeout_s: Optional[float] = None


T = TypeVar("T")
#: Steps of the loop (or of a part of it) that end with a ``T``: the retriever's end with its ``Correction``, the
#: engine's with its response.
Steps = Generator[Io, Any, T]
Outcome = Tuple[Any, Optional[BaseException]]


@dataclass
class Done(Generic[T]):
    """The steps have finished with this value."""

    value: T


def advance(loop: Steps[T], outcome: Outcome) -> Union[Io, Done[T]]:
    """Hand the last step's result (or its error) back to the loop and get its next step."""
    value, error = outcome
    try:
        return loop.throw(error) if error is not None else loop.send(value)
    except StopIteration as done:
        return Done(done.value)


def drive(loop: Steps[T]) -> T:
    """Run the steps in this thread, each under its time limit; what they end with."""
    outcome: Outcome = (None, None)
    while not isinstance(step := advance(loop, outcome), Done):
        try:
            outcome = (run_with_timeout(step.run, step.timeout_s), None)
        except Exception as exc:
            outcome = (None, exc)
    return step.value


async def adrive(loop: Steps[T]) -> T:
    """Await the steps, each under its time limit; what they end with."""
    outcome: Outcome = (None, None)
    while not isinstance(step := advance(loop, outcome), Done):
        try:
            limit = None if step.timeout_s is None else max(step.timeout_s, 0.0)
            with running_until(None if limit is None else time.monotonic() + limit):
                # The task wait_for starts, and any thread it hands work to, inherit the deadline.
                outcome = (await asyncio.wait_for(_own_errors(step.arun()), limit), None)
        except _StepError as failed:  # the step's own TimeoutError (a client's), not the limit running out
            outcome = (None, failed.error)
        except asyncio.TimeoutError:  # wait_for's: the step ran past its limit
            outcome = (None, CorrectiveTimeout())
        except Exception as exc:
            outcome = (None, exc)
    return step.value


class _StepError(Exception):
    """A ``TimeoutError`` the step raised itself, carried past ``wait_for``'s own (since 3.11, the same class)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


async def _own_errors(step: Awaitable[Any]) -> Any:
    try:
        return await step
    except asyncio.TimeoutError as exc:
        raise _StepError(exc) from exc


def bind(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)


def left(deadline: float) -> float:
    return deadline - time.monotonic()


def text_response(text: str, sources: Sequence[NodeWithScore], streaming: bool, is_async: bool) -> RESPONSE_TYPE:
    """A response that is a fixed text (an abstention or a quoted answer), streamed in one piece when asked."""
    if not streaming:
        return Response(response=text, source_nodes=list(sources))
    if is_async:

        async def once() -> Any:
            yield text

        return AsyncStreamingResponse(response_gen=once(), source_nodes=list(sources))

    def single() -> Generator[str, None, None]:
        yield text

    return StreamingResponse(response_gen=single(), source_nodes=list(sources))


def check_when_streamed(response: RESPONSE_TYPE, finish: Callable[[str, Optional[str]], None]) -> None:
    """Wrap a streamed answer's tokens so that ``finish(text, cut)`` runs when the stream ends.

    ``cut`` is None when the generator ran to its end, else why it did not (the reader
    stopped reading, or the generator raised): the trace then says the answer is unchecked.
    """
    crag = response.metadata["crag"]  # type: ignore[index]
    crag["answer_check"] = {"status": "pending", "grounded": None, "reason": "checked when the stream ends"}
    tokens = response.response_gen  # type: ignore[union-attr]
    if hasattr(tokens, "__aiter__"):

        async def checked_async() -> Any:
            parts: List[str] = []
            cut: Optional[str] = "the reader stopped reading"
            try:
                async for token in tokens:
                    parts.append(token)
                    yield token
                cut = None
            except Exception as exc:
                cut = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                if cut is None:
                    await asyncio.to_thread(finish, "".join(parts), None)
                else:
                    finish("".join(parts), cut)

        response.response_gen = checked_async()  # type: ignore[union-attr]
        return

    def checked() -> Generator[str, None, None]:
        parts: List[str] = []
        cut: Optional[str] = "the reader stopped reading"
        try:
            for token in tokens:
                parts.append(token)
                yield token
            cut = None
        except Exception as exc:
            cut = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            finish("".join(parts), cut)

    response.response_gen = checked()  # type: ignore[union-attr]


def run_with_timeout(fn: Callable[[], Any], timeout_s: Optional[float]) -> Any:
    """Run ``fn``; with a limit, in a daemon thread that is abandoned when the limit passes (``fn`` sees the
    deadline as ``deadline.step_deadline()``)."""
    if timeout_s is None:
        return fn()
    if timeout_s <= 0:
        raise CorrectiveTimeout()
    outcome: Dict[str, Any] = {}
    finished = threading.Event()
    context = contextvars.copy_context()
    deadline = time.monotonic() + timeout_s

    def until_deadline() -> Any:
        with running_until(deadline):  # so that a part that can stop early stops when the step is abandoned
            return fn()

    def target() -> None:
        try:
            outcome["value"] = context.run(until_deadline)
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc
        finally:
            finished.set()

    threading.Thread(target=target, daemon=True, name="crag-correction").start()
    if not finished.wait(timeout_s):
        raise CorrectiveTimeout()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
