"""Steps that run to their end whatever instant a cancellation arrives.

Once a request has reached the counters, its outcome must be settled (an
admission recorded in the ledger, a lease given back, a charge made) even when
the caller's task is cancelled meanwhile: an MCP client's
``notifications/cancelled``, a read timeout, a closed session. A step awaited
through :func:`finished` runs as its own task that the cancellation does not
reach; the caller gets the step's value *and* the cancellation that arrived,
settles what the value holds, then raises it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["finished", "not_cancelled", "to_the_end"]

T = TypeVar("T")


async def finished(
    step: Awaitable[T], on_cancel: Callable[[], None] | None = None
) -> tuple[T, asyncio.CancelledError | None]:
    """Await ``step`` to its end even if the calling task is cancelled meanwhile:
    its value, and the cancellation that arrived (None: none did), for the caller
    to raise once it has settled what the value holds.

    ``on_cancel()`` is called when the first cancellation arrives, for a step
    that can end early on its own terms (a waiter giving up its place). The step
    runs as its own task (``asyncio.shield``); under anyio (the MCP SDK cancels a
    request's cancel scope and redelivers the cancellation at every await) a
    shielded cancel scope keeps this task from being woken again and again.
    A step that raises raises here (a cancellation that arrived meanwhile is
    then redelivered by anyio's scope, or lost to the step's own error).
    """
    task = asyncio.ensure_future(step)
    cancelled: asyncio.CancelledError | None = None
    with _anyio_shield():
        while True:
            try:
                value = await asyncio.shield(task)
                break
            except asyncio.CancelledError as exc:
                if task.done():
                    if task.cancelled():
                        raise  # the step itself was cancelled (the loop is closing)
                    value = task.result()  # it ended as the cancellation arrived
                    cancelled = exc
                    break
                if cancelled is None and on_cancel is not None:
                    on_cancel()
                cancelled = exc
    return value, cancelled


async def to_the_end(step: Awaitable[None]) -> None:
    """Await ``step`` to its end even if the calling task is cancelled meanwhile, then
    raise the cancellation: a charge under way is never abandoned half-made."""
    _, cancelled = await finished(step)
    if cancelled is not None:
        raise cancelled


async def not_cancelled() -> None:
    """Raise the cancellation of a caller whose cancel scope was cancelled already
    (anyio redelivers it at every await), before a step starts: a request that
    never reached the counters is not made, and costs nothing."""
    if "anyio" in sys.modules:
        import anyio.lowlevel

        await anyio.lowlevel.checkpoint_if_cancelled()


def _anyio_shield() -> contextlib.AbstractContextManager[Any]:
    # Only a caller already running under anyio can be in one of its cancel scopes.
    anyio = sys.modules.get("anyio")
    if anyio is None:
        return contextlib.nullcontext()
    return anyio.CancelScope(shield=True)  # type: ignore[no-any-return]
