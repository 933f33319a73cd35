"""The metering API that :class:`Governor` and :class:`Recorder` share.

``meter``, ``meter_charges`` and ``meter_tokens`` validate what a completed
call cost and turn it into ``(limit, amount)`` pairs, the same way for both;
each subclass then records the pairs as one ledger event in its
``_meter``: the :class:`~mcp_budget_governor.Governor` charges the counters
and appends the event, a :class:`~mcp_budget_governor.producers.emit.Recorder`
only appends it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from . import planning
from .context import EMPTY, Context
from .ledger import TokenUsage
from .limits import Limit
from .money import check_amount
from .policy import Policy

if TYPE_CHECKING:
    from .prices import PriceTable

#: What ``meter`` returns: a ``MeterResult`` on a Governor, the amount on a Recorder.
R = TypeVar("R")


class Metering(Generic[R]):
    """``meter``/``meter_charges``/``meter_tokens`` over ``policy`` and ``prices``."""

    policy: Policy
    prices: PriceTable | None
    #: A Governor's ``meter``/``meter_tokens`` raise :class:`MissingScopeError` when the
    #: context keys none of the named limits (a cost counted nowhere); a Recorder emits.
    _keyed_only = False

    async def meter(self, limit: str | Sequence[str], amount: int, ctx: Context | None = None) -> R:
        """Record what a completed call cost on ``limit``; always charged, even past the cap.

        ``limit`` may name several limits (``("user_spend", "global_spend")``):
        one ledger event then charges each of them (one round trip on a Governor), so the
        cost is one cost in every spend query. A Governor returns a
        :class:`MeterResult` for the first named limit that applies, and raises
        :class:`MissingScopeError` (a ``KeyError``) when the context lacks the
        scope of every named limit; a Recorder returns the amount charged.
        """
        limits = planning.named_limits(self.policy, limit)
        amount = check_amount(amount, "amount")
        if self._keyed_only:
            planning.require_keyed(limits, ctx or EMPTY)
        return await self._meter([(lim, amount) for lim in limits], ctx or EMPTY, None)

    async def meter_charges(self, charges: Mapping[str, int], ctx: Context | None = None) -> None:
        """Record one completed call charging each limit its own amount, as one ledger event.

        ``{"calls_spent": 1, "spend": usd("0.02")}``: every amount is checked
        before anything is charged.
        """
        pairs = planning.charge_pairs(self.policy, charges)
        await self._meter(pairs, ctx or EMPTY, None)

    async def meter_tokens(
        self,
        limit: str | Sequence[str],
        model: str,
        *,
        input_tokens: int = 0,
        output_tokens: int = 0,
        cache_read_tokens: int = 0,
        cache_write_tokens: int = 0,
        ctx: Context | None = None,
        context: Context | None = None,
    ) -> R:
        """Meter a model call by its token usage (``context``: ``ctx``, under the name
        mcp-budget-governor 0.1.0 gave it).

        On a USD limit the cost comes from the price table (an unknown model
        raises :class:`UnknownModelError`); on a TOKENS limit the tokens are
        counted (``input_tokens`` already includes the cache tokens). Several
        limits (say a USD budget and a token quota) are charged by one event.
        Returns what :meth:`meter` returns, for the first named limit that applies.
        """
        pairs, usage = planning.token_charges(
            self.policy,
            limit,
            self.prices,
            model,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            cache_read_tokens=cache_read_tokens,
            cache_write_tokens=cache_write_tokens,
        )
        who = ctx or context or EMPTY
        if self._keyed_only:  # after the input is checked: the errors a Recorder raises first
            planning.require_keyed([lim for lim, _ in pairs], who)
        return await self._meter(pairs, who, usage)

    async def _meter(
        self, charges: Sequence[tuple[Limit, int]], ctx: Context, usage: TokenUsage | None
    ) -> R:
        """Record ``charges`` as one ``metered`` event; report on the first that applies."""
        raise NotImplementedError
