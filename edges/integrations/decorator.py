"""``@governed``: check before an async tool function, meter after it.

With a :class:`~mcp_budget_governor.Governor`, each call is checked first: a
refusal raises :class:`~mcp_budget_governor.LimitExceeded` and the function
never runs (a refused call is charged nothing). An admitted call runs, then
``cost`` is metered on ``limit``, even past the cap (the call that crosses the
line completes; a breaker sheds the next one).

With a :class:`~mcp_budget_governor.producers.emit.Recorder` there is no
check: the call always runs and its cost is appended to the ledger (emit only).

When the function raises (the rules of
:func:`~mcp_budget_governor.integrations.flow.governed_call`, shared by every
integration):

- the check's admission stands (a failed call still used its call quota,
  so a client retrying a failing tool cannot do it for free);
- an ``int`` cost is metered anyway: it is a price per call, known without a
  result, and work that started may have spent it (the safe direction: an
  unknown outcome is not assumed free);
- a callable cost is not metered: there is no result to price. A tool whose
  failures can still cost money should meter what it spent itself, or hold a
  reservation (``Governor.reserved``), whose estimate stands if not settled;
- a cancelled call (``asyncio.CancelledError``: a timeout, a client that gave
  up) is charged the same way as one that raised; the charge completes even
  though the task is being cancelled, then the cancellation propagates.

The exception then propagates unchanged. A callable cost that raises, or
returns something other than a non-negative ``int``, is logged as an error
naming the tool and the caller still gets the result: the call is charged
its admission, never a silent zero for a bug in the callable.

Async functions only: a sync function raises :class:`TypeError` when it is
decorated (budget checks await the counters; run blocking work inside an
``async def`` tool with ``await asyncio.to_thread(...)``).

>>> import asyncio
>>> from mcp_budget_governor import (
...     LimitExceeded, Governor, Limit, MemoryBackend, Policy, Unit, Window, usd)
>>> gov = Governor(Policy.of(
...     Limit("calls", cap=2, window=Window.MINUTE),
...     Limit("spend", cap=usd(10), window=Window.DAY, unit=Unit.USD_MICROS, gated=False),
... ), MemoryBackend())
>>> @governed(gov, limit="spend", cost=usd("0.25"))
... async def search(query: str) -> str:
...     return f"results for {query}"
>>> async def three_searches():
...     out = [await search("a"), await search("b")]
...     try:
...         await search("c")
...     except LimitExceeded as exc:
...         out.append(exc.decision.status)
...     return out, await gov.usage("spend")
>>> asyncio.run(three_searches())
(['results for a', 'results for b', 429], 500000)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeAlias, TypeVar

from mcp_budget_governor.context import EMPTY, Context
from mcp_budget_governor.governor import Governor
from mcp_budget_governor.integrations.flow import governed_call
from mcp_budget_governor.money import check_amount
from mcp_budget_governor.producers.emit import Recorder

__all__ = ["ContextFactory", "governed"]

P = ParamSpec("P")
R = TypeVar("R")

ContextFactory: TypeAlias = Callable[[tuple[Any, ...], dict[str, Any]], Context]
"""Builds the caller's context from a call's ``(args, kwargs)``."""


def governed(
    governor: Governor | Recorder,
    *,
    limit: str | None = None,
    cost: int | Callable[[Any], int] | None = None,
    tool: str | None = None,
    context: Context | ContextFactory | None = None,
    identify: Callable[..., Context] | None = None,
    cost_of: Callable[[Any], int | None] | None = None,
    meter_limit: str | None = None,
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Coroutine[Any, Any, R]]]:
    """Govern an async function: check before it (Governor only), meter ``cost`` after it.

    - ``limit`` and ``cost`` go together: ``cost`` is an ``int`` or a
      callable receiving the function's result and returning an ``int``.
      Without them a Governor only checks; a Recorder needs them.
    - ``tool`` names the tool in ``Context.tool``; by default the context's
      own tool, else the function's ``__name__``.
    - ``context``: a :class:`Context`, or a callable ``(args, kwargs) ->
      Context`` evaluated per call; None is the empty context.

    Misuse (unknown limit, a cost without a limit, a sync function) fails when
    decorating, not on the first call. See the module docstring for what a
    failing call is charged.

    mcp-budget-governor 0.1.0's spellings work too: ``identify`` (called with
    the function's own arguments, returns the :class:`Context`), and
    ``cost_of`` (of the result; None charges nothing) with ``meter_limit``.

    >>> import asyncio
    >>> from mcp_budget_governor import Context, Limit, Policy, Scope, Window
    >>> from mcp_budget_governor.producers.emit import Recorder
    >>> from mcp_budget_governor.producers.memory_ledger import MemoryLedger
    >>> ledger = MemoryLedger()
    >>> rec = Recorder(Policy.of(Limit("rows", cap=10**6, window=Window.DAY, scope=Scope.USER,
    ...                                gated=False)), ledger)
    >>> @governed(rec, limit="rows", cost=len, context=lambda args, kwargs: Context(user=args[0]))
    ... async def export(user: str) -> list[int]:
    ...     return [1, 2, 3]
    >>> asyncio.run(export("u_42"))
    [1, 2, 3]
    >>> [(e.type.value, e.context.tool, e.charges[0].amount) for e in ledger.entries]
    [('metered', 'export', 3)]
    """
    if not isinstance(governor, Governor | Recorder):
        raise TypeError(f"governed() needs a Governor or a Recorder, not {type(governor).__name__}")
    if cost_of is not None or meter_limit is not None:
        if cost_of is None or meter_limit is None:
            raise ValueError("governed(): give meter_limit= and cost_of= together")
        if limit is not None or cost is not None:
            raise TypeError("governed(): give limit= and cost=, or meter_limit= and cost_of=")
        limit, cost = meter_limit, _or_nothing(cost_of)
    if identify is not None:
        if context is not None:
            raise TypeError("governed(): give context= or identify=, not both")
        who = identify
        context = lambda args, kwargs: who(*args, **kwargs)  # noqa: E731
    if (limit is None) != (cost is None):
        raise TypeError("governed(): give limit= and cost= together (what to charge, and where)")
    if limit is None and isinstance(governor, Recorder):
        raise TypeError("governed(): a Recorder only meters: give limit= and cost=")
    if limit is not None:
        governor.policy[limit]  # an unknown limit raises PolicyError now
    if cost is not None and not callable(cost):
        check_amount(cost, "cost")
    if tool is not None:
        Context(tool=tool)  # not a string: InvalidInputError now
    if context is not None and not isinstance(context, Context) and not callable(context):
        raise TypeError(
            "governed(): context= must be a Context or a callable (args, kwargs) -> Context"
        )
    # The shared flow's terms: an int is a price known without a result
    # (charged even when the call fails), a callable prices the result.
    fixed = {limit: cost} if limit is not None and isinstance(cost, int) else None
    priced = None
    if limit is not None and cost is not None and not isinstance(cost, int):
        price_of = cost

        def priced(result: Any) -> dict[str, int]:
            amount = price_of(result)
            return {} if amount is _NOTHING else {limit: amount}

    def decorate(fn: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
        if not _is_async(fn):
            raise TypeError(
                f"governed() wraps async functions only, and {_name(fn)} is not one: "
                "make it `async def` (run blocking work with `await asyncio.to_thread(...)`)"
            )
        default_tool = _name(fn)

        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if context is None:
                ctx = EMPTY
            elif isinstance(context, Context):
                ctx = context
            else:
                ctx = context(args, kwargs)
                if not isinstance(ctx, Context):
                    raise TypeError(
                        f"governed(): the context callable returned {type(ctx).__name__}, "
                        "not a Context"
                    )
            ctx = ctx.with_tool(tool if tool is not None else ctx.tool or default_tool)
            return await governed_call(
                governor,
                ctx,
                lambda: fn(*args, **kwargs),
                fixed=fixed,
                priced=priced,
            )

        return wrapper

    return decorate


_NOTHING: Any = object()


def _or_nothing(cost_of: Callable[[Any], int | None]) -> Callable[[Any], int]:
    """``cost_of`` with None (the reference's "charge nothing") as :data:`_NOTHING`."""

    def cost(result: Any) -> int:
        amount = cost_of(result)
        return _NOTHING if amount is None else amount

    return cost


def _is_async(fn: Callable[..., Any]) -> bool:
    """A coroutine function, a partial of one, or an object with an ``async __call__``."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - the method itself, not callable()
    )


def _name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", None)
    if isinstance(name, str):
        return name
    return type(fn).__name__
