"""FastMCP 4 middleware: check before a tool runs, meter after it.

>>> from fastmcp import FastMCP
>>> from mcp_budget_governor import Context, Governor, Limit, MemoryBackend, Policy, Scope, Window
>>> governor = Governor(Policy.of(
...     Limit("burst", cap=30, window=Window.MINUTE, scope=Scope.USER)), MemoryBackend())
>>> mcp = FastMCP("my-server")
>>> mcp.add_middleware(BudgetMiddleware(governor, identify=lambda c: Context(user="u_42")))

Per ``tools/call``:

1. ``identify(context)`` (sync or async; ``context`` is FastMCP's
   ``MiddlewareContext``) returns a :class:`~mcp_budget_governor.Context`
   naming the user, tenant, session, agent, or None when it cannot tell. The
   tool's name always becomes ``Context.tool`` (``Scope.TOOL``). Without
   ``identify``, the user is the authenticated access token's subject (else
   its client id) when the server has auth, and nobody otherwise.
2. A caller without a user id meets the policy's ``anonymous`` rule
   (:class:`~mcp_budget_governor.Anonymous`): refused by default when a limit
   counts per user, or counted in one anonymous bucket. Never unlimited.
3. The governor checks; a refusal is the tool's error result (``isError``),
   whose text the agent reads: the reason ``budget_exceeded:<scope>/<window>``,
   the limit, the status and when to retry (``retry_after`` seconds /
   ``resets_at``), or that retrying is futile. A program reads the same as data
   in the result's ``_meta`` under ``"dev.mcpbg/refusal"``
   (:func:`~mcp_budget_governor.integrations.flow.refusal_meta`). With
   ``rate_limit_error=True``, a refusal that waiting fixes (429) is instead
   the JSON-RPC error of MCP's rate-limit proposal (code -32023, SEP-3304).
4. The tool runs; then its cost is metered (see
   :func:`~mcp_budget_governor.integrations.flow.governed_call` for what a
   failing call is charged, the same rules as ``@governed``).

A tool's cost comes from two places:

- its own ``meta``, a fixed price per call, charged also when the tool raises
  or the client cancels the call (``notifications/cancelled``)::

      @mcp.tool(meta={"mcpbg": {"cost_usd": "0.01", "limit": ["user_spend", "spend"]}})

  ``limit`` is a limit name or a list of them; ``cost_usd`` is dollars (a
  string keeps it exact) for USD limits, or ``cost`` an integer in the limits'
  unit (calls, tokens, USD micros). The price travels with the tool's listing,
  so an agent can see it before calling.
- an estimate, for a hard cap: ``estimate_usd`` (dollars, a string: a float
  is refused) or ``estimate`` in ``meta``, or the middleware's ``estimate=``
  for tools that declare no cost at all, is reserved before the tool runs
  (refused when it does not fit the room left, so concurrent calls cannot
  all pass a check on the same last dollar) and settled after it to the
  ``cost`` callback's charges, else the fixed price, else the estimate; a
  failed or cancelled call settles to its fixed price, else its estimate::

      @mcp.tool(meta={"mcpbg": {"estimate_usd": "0.05", "limit": "spend"}})
- the ``cost`` callback, ``cost(context, result) -> {limit: amount} | None``
  (sync or async), called after a tool completes with its ``ToolResult``; its
  charges replace the ``meta`` price for that call, and None keeps it. A
  callback that raises or returns invalid charges is logged with the tool's
  name and the ``meta`` price is charged; the agent still gets the result.

A limit with ``on_exceed=OnExceed.ASK`` that refuses a call makes the
middleware ask the client's user, through MCP elicitation, whether this one
call may go over it (``approval_timeout`` seconds to answer). Approved, the
call is admitted and its ``admitted`` event names the limit in ``over`` and in
``approved``; declined, unanswered, or a client that cannot elicit: the usual
refusal. A breaker never asks. A client on the handshake-era protocol
(``mode="legacy"``, or any pre-2026-07-28 client) is asked over its
back-channel while the call waits; one on the 2026-07-28 protocol, which has
no back-channel, gets the question as the call's ``input_required`` result
(SEP-2322: an elicitation under the key ``mcpbg_approval``, the refusing
limit in the framework-sealed ``request_state``) and is admitted over that
limit when it retries the call with the answer accepted. FastMCP seals that
state under a key of its own process: replicas behind one address share one
through their Redis with :func:`shared_request_state`
(``FastMCP("tools", request_state_security=shared_request_state(url))``, one
name for all), so a retry reaching another replica is admitted there too.

Inside the tool and the callback,
:func:`~mcp_budget_governor.integrations.flow.governed_context` is the
caller's context as it was checked (identified, with the tool), for a tool
that meters more itself (``governor.meter_tokens(..., ctx=governed_context())``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeAlias

from mcp_budget_governor.integrations import extra_missing

try:
    import anyio
    import mcp_types as mt
    from fastmcp.exceptions import ToolError
    from fastmcp.server.dependencies import get_access_token
    from fastmcp.server.elicitation import AcceptedElicitation
    from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
    from fastmcp.tools.base import InputRequiredToolResult, ToolResult
    from mcp.server.request_state import RequestStateSecurity
    from mcp.shared.exceptions import MCPError
except ModuleNotFoundError as exc:  # installed without the [fastmcp] extra
    raise extra_missing("fastmcp", exc) from exc

from mcp_budget_governor.approval import approval_state, open_approval
from mcp_budget_governor.context import EMPTY, Context
from mcp_budget_governor.decision import Decision
from mcp_budget_governor.errors import (
    BackendUnavailableError,
    GovernorError,
    InvalidInputError,
    LimitExceeded,
)
from mcp_budget_governor.governor import Governor
from mcp_budget_governor.integrations.flow import (
    REFUSAL_META_KEY,
    Charges,
    fixed_charges,
    governed_call,
    identify_with,
    rate_limited_error,
    refusal_meta,
    refusal_text,
    user_of_token,
)
from mcp_budget_governor.keys import APPROVAL_KEY
from mcp_budget_governor.limits import OnExceed
from mcp_budget_governor.money import Unit, check_amount, usd
from mcp_budget_governor.policy import Policy
from mcp_budget_governor.repeats import with_call
from mcp_budget_governor.urls import CLUSTER_SCHEME, check_redis_url, redact

__all__ = [
    "META_KEY",
    "PRICE_TTL",
    "BudgetMiddleware",
    "BudgetToolError",
    "shared_request_state",
    "tool_estimate",
    "tool_price",
]

log = logging.getLogger("mcp_budget_governor")

META_KEY = "mcpbg"
"""The key of a tool's ``meta`` that holds its price."""

PRICE_TTL = 1.0
"""Seconds a tool's ``meta`` price is remembered between lookups."""

Identify: TypeAlias = Callable[[MiddlewareContext[Any]], Context | Awaitable[Context | None] | None]
SessionRoot: TypeAlias = Callable[[str], str | Awaitable[str | None] | None]
Cost: TypeAlias = Callable[
    [MiddlewareContext[Any], ToolResult], Charges | Awaitable[Charges | None] | None
]


def _cost_of(cost_of: Callable[[ToolResult], int | None], limit: str) -> Cost:
    """mcp-budget-governor 0.1.0's ``cost_of`` + ``meter_limit`` as a ``cost=``."""

    def cost(context: MiddlewareContext[Any], result: ToolResult) -> Charges | None:
        amount = cost_of(result)
        return None if amount is None else {limit: amount}

    return cost


class BudgetToolError(ToolError):
    """A tool call the budget refused; the message is :func:`refusal_text`.

    ``decision`` holds the refusal (status, limit, retry_after, resets_at). The
    middleware returns a refusal as an error result with its ``_meta`` instead;
    this error is kept for tools that raise a refusal themselves.
    """

    def __init__(self, decision: Decision) -> None:
        self.decision = decision
        super().__init__(refusal_text(decision))


class BudgetMiddleware(Middleware):
    """Governs every ``tools/call`` of a FastMCP server; see the module docstring.

    - ``governor``: the :class:`~mcp_budget_governor.Governor` to enforce.
    - ``identify``: who is calling (``context -> Context | None``, sync or async).
    - ``cost``: what a completed call cost (``(context, result) -> {limit: amount}``).
    - ``estimate``: ``{limit: amount}`` reserved before every tool that declares
      neither a price nor an estimate in its ``meta`` (a hard cap for tools of
      unknown cost); None leaves them on the soft cap.
    - ``session_root``: ``session -> root session | None`` (sync or async), for
      callers whose ``identify`` names a session but not its root: a fork then
      spends its root's session budget (a context naming its root keeps it).
    - ``approval_timeout``: seconds the user has to answer an ``OnExceed.ASK``
      approval (MCP elicitation); unanswered, the call is refused as usual.
    - ``wait``: seconds a call refused by a full concurrency cap waits for a slot
      (first come, first served across replicas); past it, the refusal.
    - mcp-budget-governor 0.1.0's spellings: ``cost_of`` (of the result; None
      charges nothing) with ``meter_limit``; ``raise_tool_error=False`` raises the
      refusal itself (a :class:`LimitExceeded`) instead of a ``ToolError``.
    - ``rate_limit_error``: answer a 429 refusal with the JSON-RPC error of MCP's
      rate-limit proposal (-32023, SEP-3304, a draft) instead of an error result,
      for clients that follow it. Off by default.
    """

    def __init__(
        self,
        governor: Governor,
        identify: Identify | None = None,
        cost: Cost | None = None,
        estimate: Charges | None = None,
        approval_timeout: float = 120.0,
        session_root: SessionRoot | None = None,
        wait: float = 0,
        rate_limit_error: bool = False,
        *,
        cost_of: Callable[[ToolResult], int | None] | None = None,
        meter_limit: str | None = None,
        raise_tool_error: bool = True,
    ) -> None:
        if not isinstance(governor, Governor):
            raise TypeError(f"BudgetMiddleware needs a Governor, not {type(governor).__name__}")
        self.rate_limit_error = bool(rate_limit_error)
        if cost_of is not None or meter_limit is not None:
            if cost_of is None or meter_limit is None:
                raise ValueError("BudgetMiddleware: give meter_limit= and cost_of= together")
            if cost is not None:
                raise TypeError("BudgetMiddleware: give cost=, or meter_limit= and cost_of=")
            governor.policy[meter_limit]  # an unknown limit raises PolicyError now
            cost = _cost_of(cost_of, meter_limit)
        self.raise_tool_error = raise_tool_error
        if identify is not None and not callable(identify):
            raise TypeError("BudgetMiddleware: identify= must be callable (context -> Context)")
        if cost is not None and not callable(cost):
            raise TypeError("BudgetMiddleware: cost= must be callable ((context, result) -> dict)")
        self.governor = governor
        self.identify = identify
        self.cost = cost
        self.estimate = fixed_charges(governor, estimate, "estimate")
        self.approval_timeout = approval_timeout
        if session_root is not None and not callable(session_root):
            raise TypeError("BudgetMiddleware: session_root= must be callable (session -> root)")
        self.session_root = session_root
        governor.admitted(wait=wait)  # InvalidInputError naming a bad wait, now
        self.wait = wait
        self._prices: dict[str, tuple[float, Charges | None, Charges | None]] = {}

    async def on_call_tool(
        self,
        context: MiddlewareContext[mt.CallToolRequestParams],
        call_next: CallNext[mt.CallToolRequestParams, ToolResult],
    ) -> ToolResult:
        """Check, run the tool, meter; a refusal is an error result (module docstring)."""
        name = context.message.name
        ctx = with_call(
            self.governor.policy,
            (await self._caller(context)).with_tool(name),
            name,
            context.message.arguments,
        )
        try:
            fixed, estimate = await self._meta_price(context, name)
        except InvalidInputError as exc:
            # A server bug, not the caller's: the tool does not run unpriced,
            # and the agent gets a tool error rather than a protocol failure.
            log.error("%s", exc)
            raise ToolError(f"budget configuration error: {exc}") from exc
        priced = None
        if self.cost is not None:
            cost = self.cost

            def priced(result: ToolResult) -> Any:
                return cost(context, result)

        try:
            return await governed_call(
                self.governor,
                await self.governor.identified(ctx),
                lambda: call_next(context),
                fixed=fixed,
                priced=priced,
                estimate=estimate,
                ask=lambda decision: self._ask(context, decision, ctx),
                wait=self.wait,
                approved=self._approved_in_round(context, ctx),
            )
        except LimitExceeded as exc:
            if not self.raise_tool_error:
                raise
            return self._refused(exc.decision)
        except _AskInRound as ask:  # a 2026-07-28 client: the question is the result
            return InputRequiredToolResult(ask.result)

    def _refused(self, decision: Decision) -> ToolResult:
        """A refusal's error result: its text, and its data in ``_meta``; or, opted in,
        the JSON-RPC error of MCP's rate-limit proposal."""
        error = rate_limited_error(decision) if self.rate_limit_error else None
        if error is not None:
            raise MCPError(error["code"], error["message"], error["data"])
        return ToolResult(
            content=[mt.TextContent(type="text", text=refusal_text(decision))],
            meta={REFUSAL_META_KEY: refusal_meta(decision)},
            is_error=True,
        )

    def _as_client_error(self, exc: LimitExceeded) -> Exception:
        """A refusal as an exception: a :class:`BudgetToolError` (the agent reads its
        text), or the refusal itself with ``raise_tool_error=False``."""
        return BudgetToolError(exc.decision) if self.raise_tool_error else exc

    async def _ask(
        self, context: MiddlewareContext[Any], decision: Decision, caller: Context
    ) -> bool:
        """Ask the client's user (MCP elicitation) whether this call may go over the
        ``OnExceed.ASK`` limit that refused it; False for no, no answer in time, or a
        client that cannot be asked."""
        fc = context.fastmcp_context
        if fc is None:
            return False
        tool = context.message.name
        message = (
            f"Budget {decision.limit!r} is spent ({decision.reason}). "
            f"Allow this one call to {tool!r} to go over it?"
        )
        if fc._is_modern_protocol():
            now = time.time()
            state = approval_state(decision.limit or "", caller, now=now, ttl=self.approval_timeout)
            previous = open_approval(fc.request_state, caller, now=now)
            # An answer about another limit (approved over one, refused by the next)
            # is a new question; any other answered retry was checked with its approval.
            answered = fc.input_responses is not None and fc.request_state is not None
            answered = answered and (previous is None or previous == decision.limit)
            return _answered_in_round(fc, decision, message, tool, state, answered)
        answer: Any = None
        try:
            with anyio.move_on_after(self.approval_timeout):
                answer = await fc.elicit(message, bool, response_title="Go over budget")
        except Exception as exc:  # the client cannot elicit: the normal refusal
            log.info("tool %r: could not ask for approval over %r: %s", tool, decision.limit, exc)
            return False
        approved = isinstance(answer, AcceptedElicitation) and answer.data is True
        log.info(
            "tool %r: the user %s going over %r",
            tool, "approved" if approved else "did not approve", decision.limit,
        )  # fmt: skip
        return approved

    def _approved_in_round(
        self, context: MiddlewareContext[Any], caller: Context
    ) -> tuple[str, ...]:
        """The limit a 2026-07-28 client's retry answers yes for (SEP-2322), so the
        retry is admitted over it at once (one refusal in the ledger, not two): an
        :class:`~mcp_budget_governor.approval.Approval` the governor spends with the
        admission, so the same state admits once, and only the caller it was given to."""
        fc = context.fastmcp_context
        if fc is None or not fc._is_modern_protocol():
            return ()
        approval = open_approval(fc.request_state, caller, now=time.time())
        if approval is None:
            return ()  # another caller's, lapsed, or not ours: the usual check
        asking = {lim.name for lim in self.governor.policy.limits if lim.on_exceed is OnExceed.ASK}
        if approval not in asking:
            return ()  # a policy reloaded since the question: ask again, or refuse
        return (approval,) if _yes(fc.input_responses) else ()

    async def _caller(self, context: MiddlewareContext[Any]) -> Context:
        if self.identify is not None:
            ctx = await identify_with(self.identify, context)
            resolve = self.session_root
            if resolve is not None and ctx.session is not None and ctx.session_root is None:
                root = resolve(ctx.session)
                if inspect.isawaitable(root):
                    root = await root
                if root is not None and root != ctx.session:
                    ctx = dataclasses.replace(ctx, session_root=root)
            return ctx
        user = user_of_token(get_access_token())
        return EMPTY if user is None else Context(user=user)

    async def _meta_price(
        self, context: MiddlewareContext[Any], name: str
    ) -> tuple[Charges | None, Charges | None]:
        """The tool's (fixed price, estimate); the default estimate for a tool of unknown cost."""
        # Looking a tool up costs about as much as the Redis round trip of the
        # check, so a price is remembered for PRICE_TTL seconds: a tool
        # re-registered with a new price is charged it within that delay.
        now = time.monotonic()
        cached = self._prices.get(name)
        if cached is not None and cached[0] > now:
            return cached[1], cached[2]
        server = context.fastmcp_context.fastmcp if context.fastmcp_context else None
        if server is None:
            return None, self.estimate
        tool = await server.get_tool(name)
        price, estimate = (
            (None, None) if tool is None else _tool_spec(self.governor.policy, name, tool.meta)
        )
        if price is None and estimate is None:
            estimate = self.estimate
        if len(self._prices) >= 1024:  # names come from callers: keep the cache bounded
            self._prices.clear()
        self._prices[name] = (now + PRICE_TTL, price, estimate)
        return price, estimate


def tool_price(policy: Policy, tool: str, meta: Mapping[str, Any] | None) -> Charges | None:
    """The fixed price a tool's ``meta`` declares (``{"mcpbg": {...}}``), validated.

    None when the tool declares none. A malformed declaration raises
    :class:`InvalidInputError` naming the tool, the field and the value, so
    the call fails before the tool runs rather than running unpriced.

    >>> from mcp_budget_governor import Limit, Unit, Window, usd
    >>> p = Policy.of(Limit("spend", cap=usd(5), window=Window.DAY, unit=Unit.USD_MICROS))
    >>> tool_price(p, "search", {"mcpbg": {"cost_usd": "0.01", "limit": "spend"}})
    {'spend': 10000}
    """
    return _tool_spec(policy, tool, meta)[0]


def tool_estimate(policy: Policy, tool: str, meta: Mapping[str, Any] | None) -> Charges | None:
    """The estimate a tool's ``meta`` declares (``estimate_usd`` dollars as a string,
    or ``estimate`` in the limits' unit), validated like :func:`tool_price`.

    >>> from mcp_budget_governor import Limit, Unit, Window, usd
    >>> p = Policy.of(Limit("spend", cap=usd(5), window=Window.DAY, unit=Unit.USD_MICROS))
    >>> tool_estimate(p, "browse", {"mcpbg": {"estimate_usd": "0.05", "limit": "spend"}})
    {'spend': 50000}
    """
    return _tool_spec(policy, tool, meta)[1]


_FIELDS = frozenset({"limit", "cost", "cost_usd", "estimate", "estimate_usd"})


def _tool_spec(
    policy: Policy, tool: str, meta: Mapping[str, Any] | None
) -> tuple[Charges | None, Charges | None]:
    """(fixed price, estimate) of a tool's ``meta``; either may be None."""
    if not meta or META_KEY not in meta:
        return None, None
    spec = meta[META_KEY]
    where = f"tool {tool!r} meta.{META_KEY}"
    if not isinstance(spec, Mapping):
        raise InvalidInputError(where, spec, 'expected {"limit": ..., "cost_usd": ...}')
    unknown = set(spec) - _FIELDS
    if unknown:
        raise InvalidInputError(f"{where}.{sorted(unknown)[0]}", spec, "unknown field")
    names = spec.get("limit")
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, Sequence) or not names or not all(isinstance(n, str) for n in names):
        raise InvalidInputError(
            f"{where}.limit", spec.get("limit"), "expected a limit name or a list"
        )
    has_cost = "cost" in spec or "cost_usd" in spec
    has_estimate = "estimate" in spec or "estimate_usd" in spec
    if ("cost" in spec and "cost_usd" in spec) or not (has_cost or has_estimate):
        raise InvalidInputError(where, spec, "give exactly one of cost_usd (dollars) or cost")
    if "estimate" in spec and "estimate_usd" in spec:
        raise InvalidInputError(
            where, spec, "give exactly one of estimate_usd (dollars) or estimate"
        )
    for limit_name in names:
        if limit_name not in policy:
            problem = f"no such limit (known: {', '.join(lim.name for lim in policy)})"
            raise InvalidInputError(f"{where}.limit", limit_name, problem)
    price = _amounts(policy, spec, names, where, "cost") if has_cost else None
    estimate = _amounts(policy, spec, names, where, "estimate") if has_estimate else None
    return price, estimate


def _amounts(
    policy: Policy, spec: Mapping[str, Any], names: Sequence[str], where: str, kind: str
) -> dict[str, int]:
    """``{limit: amount}`` of ``kind`` (``cost`` or ``estimate``), dollars or units."""
    dollars = f"{kind}_usd"
    out: dict[str, int] = {}
    for limit_name in names:
        lim = policy[limit_name]
        if dollars in spec:
            value = spec[dollars]
            if lim.unit is not Unit.USD_MICROS:
                raise InvalidInputError(
                    f"{where}.{dollars}", value, f"limit {limit_name!r} counts {lim.unit}"
                )
            if kind == "estimate" and not isinstance(value, str):
                # A float is not an exact amount of money: say it as a string.
                raise InvalidInputError(
                    f"{where}.{dollars}", value, 'expected dollars as a string, such as "0.05"'
                )
            try:
                out[limit_name] = usd(value)
            except InvalidInputError as exc:
                raise InvalidInputError(f"{where}.{dollars}", value, exc.problem) from None
        else:
            out[limit_name] = check_amount(spec[kind], f"{where}.{kind}")
    return out


#: The key of the approval question in an ``input_required`` result.
APPROVAL_REQUEST = "mcpbg_approval"


class _AskInRound(Exception):
    """The call ends in an ``input_required`` result: the approval question."""

    def __init__(self, result: mt.InputRequiredResult) -> None:
        self.result = result


def _answered_in_round(
    fc: Any, decision: Decision, message: str, tool: str, state: str, answered: bool
) -> bool:
    """The approval of a 2026-07-28 client (SEP-2322 multi round trip): on a retry
    that ``answered`` our question and was still refused, False: the usual refusal;
    asked nothing yet, the question goes out as the call's result (raises
    :class:`_AskInRound`) with ``state``
    (:func:`~mcp_budget_governor.approval.approval_state`: the limit, the caller, a
    one-time id) as its ``request_state``, which the framework seals, so a client
    cannot approve a question it was never asked. A client that declares no
    elicitation capability in the request is not asked."""
    limit = decision.limit or ""
    meta = fc.request_context.meta or {}
    declared = meta.get("io.modelcontextprotocol/clientCapabilities") or {}
    if not isinstance(declared, Mapping) or "elicitation" not in declared:
        return False  # a client that cannot elicit: the normal refusal
    if answered:
        # The approval, if any, was tried with the check (spent already, another
        # caller's, lapsed or declined): refused, not asked again and again.
        log.info("tool %r: no usable approval to go over %r", tool, limit)
        return False
    schema = {
        "type": "object",
        "properties": {"value": {"type": "boolean", "title": "Go over budget"}},
        "required": ["value"],
    }
    question = mt.ElicitRequest(
        params=mt.ElicitRequestFormParams(message=message, requested_schema=schema)
    )
    raise _AskInRound(
        mt.InputRequiredResult(input_requests={APPROVAL_REQUEST: question}, request_state=state)
    )


def _yes(responses: Any) -> bool:
    """Whether the answer to our approval question is an accepted "yes"."""
    answer = (responses or {}).get(APPROVAL_REQUEST)
    if isinstance(answer, Mapping):
        answer = mt.ElicitResult.model_validate(answer)
    return (
        isinstance(answer, mt.ElicitResult)
        and answer.action == "accept"
        and (answer.content or {}).get("value") is True
    )


#: The approval key's shape in Redis: 32 bytes as lowercase hex (ts/src/backends/redis.ts).
_APPROVAL_HEX = re.compile(r"[0-9a-f]{64}")


def shared_request_state(
    redis_url: str, *, ttl: float = 600.0, audience: str | None = None, timeout: float = 2.0
) -> RequestStateSecurity:
    """The request-state seal of every replica on ``redis_url``, for
    ``FastMCP(name, request_state_security=shared_request_state(url))``.

    Its key is the one the TypeScript middleware shares on that Redis
    (:data:`~mcp_budget_governor.keys.APPROVAL_KEY`, 32 random bytes as 64 hex
    digits): read, else created once with SET NX and read back, so the first
    replica to start sets it and every other one, in either language, reads the
    same. The replicas must also share the server's name (or ``audience``): the
    seal names it. ``ttl``: seconds a question stays answerable. Read once, here,
    synchronously (``timeout`` seconds): an unreachable Redis raises
    :class:`~mcp_budget_governor.errors.BackendUnavailableError`, a key holding
    anything else :class:`~mcp_budget_governor.errors.GovernorError`.
    """
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < math.inf:
        raise InvalidInputError("ttl", ttl, "expected seconds, a finite number more than 0")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < 3600:
        raise InvalidInputError("timeout", timeout, "expected seconds, more than 0, under 3600")
    key = _approval_key(check_redis_url(redis_url, "redis_url"), float(timeout))
    return RequestStateSecurity(keys=[key], ttl=float(ttl), audience=audience)


def _approval_key(url: str, timeout: float) -> bytes:
    """The approval key stored in the Redis at ``url``, created there if missing."""
    if url.lower().startswith(CLUSTER_SCHEME):  # as in TypeScript: one Redis, not a cluster
        raise InvalidInputError(
            "redis_url", redact(url), "expected one Redis, not a cluster (redis://host:port/db)"
        )
    import redis
    from redis import exceptions as redis_errors

    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        value = client.get(APPROVAL_KEY)
        if value is None:
            client.set(APPROVAL_KEY, secrets.token_hex(32), nx=True)
            value = client.get(APPROVAL_KEY)
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
        raise BackendUnavailableError.redis(exc, url) from None
    except redis_errors.ResponseError as exc:  # e.g. WRONGTYPE: not a string
        value, shape = None, f"the error {str(exc).split(' ', 1)[0]}"
    else:
        shape = f"{len(value)} bytes" if isinstance(value, bytes) else "nothing"
    finally:
        client.close()
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else ""
    if not _APPROVAL_HEX.fullmatch(text):
        # The value's shape, not the value: a near-miss may still be someone's key.
        raise GovernorError(
            f"{APPROVAL_KEY} in redis {redact(url)} holds no approval key (expected 64 "
            f"lowercase hex digits, got {shape}); delete it to have a new one made"
        )
    return bytes.fromhex(text)
