"""Steps that run to their end whatever instant a cancellation arrives.

Once a request has reached the counters, its outcome must be settled (an
admission recorded in the ledger, a lease given back, a charge made) even when
the caller's task is cancelled meanwhile: an MCP client's
``notifications/cancelled``, a read timeout, a closed session. A step awaited
through :func:`finished` runs as its own task that the cancellation does not
reach; the caller gets the step's value *and* the cancellation that arrived,
settles what the value holds, then raises it. A step whose only wait is one
reply to a request already written needs no task: its caller awaits the reply
as a :class:`Held` future through :func:`reply_of` (a plain check without a
ledger on Redis, ``admission._inline``).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["Held", "finished", "not_cancelled", "reply_of", "to_the_end"]

T = TypeVar("T")


async def finished(
    step: Awaitable[T], on_cancel: Callable[[], None] | None = None
) -> tuple[T, asyncio.CancelledError | None]:
    """Await ``step`` to its end even if the calling task is cancelled meanwhile:
    its value, and the cancellation that arrived (None: none did), for the caller
    to raise once it has settled what the value holds.

    ``on_cancel()`` is called when the first cancellation arrives, for a step
    that can end early on its own terms (a waiter giving up its place). The step
    runs as its own task, so the timeouts inside it cancel the step, not its
    caller; under anyio (the MCP SDK cancels a request's cancel scope and
    redelivers the cancellation at every await) a shielded cancel scope keeps
    this task from being woken again and again. A step that raises raises here
    (a cancellation that arrived meanwhile is then redelivered by anyio's scope,
    or lost to the step's own error).
    """
    outcome = _Outcome()
    if on_cancel is not None:
        outcome.on_cancel = on_cancel
    outcome.step = asyncio.ensure_future(_into(step, outcome))
    with _anyio_shield():
        try:
            value = await outcome
        except asyncio.CancelledError as exc:
            if not outcome.done() or outcome.cancelled():
                raise  # the step itself was cancelled (the loop is closing)
            # The cancellation, deferred by _Outcome.cancel, arrived as the step ended.
            return outcome.result(), exc
    return value, None


class Held(asyncio.Future[T]):
    """A reply its awaiter's cancellation does not drop: ``cancel()`` declines, so
    asyncio keeps the cancellation and raises it in the awaiting task once the
    reply is here, and the reply can still be read (:func:`reply_of`). The task
    per step that :func:`finished` runs is then not needed: a charge written at
    once awaits its reply in its caller's own task."""

    __slots__ = ()

    def cancel(self, msg: Any = None) -> bool:
        return False


async def reply_of(reply: asyncio.Future[Any]) -> asyncio.CancelledError | None:
    """Wait until ``reply`` (a :class:`Held` future) is done, whatever instant a
    cancellation arrives: the cancellation that arrived meanwhile (None: none
    did), for the caller to raise once it has settled what the reply holds. The
    reply's value or error stays in ``reply``."""
    with _anyio_shield():
        try:
            await reply
        except asyncio.CancelledError as exc:
            if not reply.done() or reply.cancelled():
                raise  # the loop is closing: nothing will answer
            return exc
        except Exception:  # the reply's own error: the caller reads it from ``reply``
            pass
    return None


class _Outcome(asyncio.Future[Any]):
    """The step's value, set by the step's own task as its last act, so its caller
    wakes one loop turn after the step ends (``asyncio.shield`` takes two: a
    check's Python time, measured in benchmarks/bench_check.py). Cancelling the
    caller does not cancel this future: ``cancel()`` declines, so asyncio keeps
    the cancellation and raises it in the caller once the value is here."""

    step: asyncio.Future[None]  # held here: the loop keeps only weak references
    on_cancel: Callable[[], None] | None = None

    def cancel(self, msg: Any = None) -> bool:
        if self.on_cancel is not None:
            on_cancel, self.on_cancel = self.on_cancel, None
            on_cancel()
        return False


async def _into(step: Awaitable[Any], outcome: _Outcome) -> None:
    try:
        value = await step
    except asyncio.CancelledError:
        asyncio.Future.cancel(outcome)  # the step itself was cancelled: so is its caller
        raise
    except Exception as exc:  # the caller raises it
        outcome.set_exception(exc)
        return
    except BaseException as exc:  # KeyboardInterrupt, SystemExit: the loop's too
        outcome.set_exception(exc)
        raise
    outcome.set_result(value)


async def to_the_end(step: Awaitable[T]) -> T:
    """Await ``step`` to its end even if the calling task is cancelled meanwhile, then
    raise the cancellation, else return its value: a charge under way is never
    abandoned half-made."""
    value, cancelled = await finished(step)
    if cancelled is not None:
        raise cancelled
    return value


async def not_cancelled() -> None:
    """Raise the cancellation of a caller whose cancel scope was cancelled already
    (anyio redelivers it at every await), before a step starts: a request that
    never reached the counters is not made, and costs nothing."""
    if "anyio" in sys.modules:
        import anyio.lowlevel

        await anyio.lowlevel.checkpoint_if_cancelled()


_NO_SCOPE = contextlib.nullcontext()  # reusable: it holds nothing


def _anyio_shield() -> contextlib.AbstractContextManager[Any]:
    # Only a caller already running under anyio can be in one of its cancel scopes.
    anyio = sys.modules.get("anyio")
    if anyio is None:
        return _NO_SCOPE
    return anyio.CancelScope(shield=True)  # type: ignore[no-any-return]
