"""ASGI middleware: govern the HTTP requests of any ASGI app (Starlette, FastAPI, ...).

>>> from starlette.applications import Starlette
>>> from mcp_budget_governor import Context, Governor, Limit, MemoryBackend, Policy, Scope, Window
>>> governor = Governor(Policy.of(
...     Limit("burst", cap=30, window=Window.MINUTE, scope=Scope.USER)), MemoryBackend())
>>> app = BudgetASGIMiddleware(
...     Starlette(), governor,
...     identify=lambda scope: Context(user=dict(scope["headers"]).get(b"x-user", b"").decode()))

Per HTTP request (``lifespan`` and ``websocket`` pass through untouched):

1. ``route(scope)`` names the request; the name becomes ``Context.tool``
   (``Scope.TOOL``). It defaults to the path; return None to let a request
   through ungoverned. Paths in ``exempt_paths`` (by default the usual health
   checks, :data:`HEALTH_PATHS`) always pass ungoverned: a liveness probe must
   not fail because a user spent a quota.
2. ``identify(scope)`` (sync or async) returns the caller's
   :class:`~mcp_budget_governor.Context`, or None when it cannot tell; by
   default the authenticated user an authentication middleware put in
   ``scope["user"]`` (an OAuth token's subject, else its client id, else the
   user's ``identity``). A caller without a user id meets the policy's
   ``anonymous`` rule: refused (403) or counted in the anonymous bucket.
3. A refusal is answered without calling the app: status 429 (quota), 402
   (spend), 503 (breaker, or counters unreachable) or 403 (unidentified), a
   ``Retry-After`` header when waiting can help, and an RFC 9457 problem
   (``application/problem+json``: ``type``, ``title``, ``status``, ``detail``,
   ``instance``, the path) naming the reason, the limit and the hint
   (``retry_after``, ``resets_at``, ``message``).
4. Otherwise the app answers, and after its response is sent,
   ``cost(scope, status)`` (sync or async, ``{limit: amount}`` or None) is
   metered; None, or a callback that fails, charges ``fixed`` instead.
   ``fixed`` (``{limit: amount}``) is what every admitted request costs when
   nothing better is known: it is also charged when the app raises or is
   cancelled, such as when the client drops the connection mid-request (the
   rules of :func:`~mcp_budget_governor.integrations.flow.governed_call`).
   Without ``fixed``, such a request pays its admission only.

A :class:`~mcp_budget_governor.LimitExceeded` that a bare ASGI app raises
before starting its response is answered the same way (frameworks such as
Starlette answer an exception with a 500 themselves, before it gets here).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from typing import Any, TypeAlias

from mcp_budget_governor.context import EMPTY, Context
from mcp_budget_governor.decision import Decision
from mcp_budget_governor.errors import LimitExceeded
from mcp_budget_governor.governor import Governor
from mcp_budget_governor.integrations.flow import (
    Charges,
    fixed_charges,
    governed_call,
    identify_with,
    refusal_body,
    user_of_token,
)

__all__ = ["HEALTH_PATHS", "BudgetASGIMiddleware", "refusal_response"]

#: Paths that pass ungoverned unless ``exempt_paths`` says otherwise.
HEALTH_PATHS = frozenset({"/health", "/healthz", "/livez", "/readyz"})

Scope_: TypeAlias = MutableMapping[str, Any]
Message: TypeAlias = MutableMapping[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]
ASGIApp: TypeAlias = Callable[[Scope_, Receive, Send], Awaitable[None]]
Identify: TypeAlias = Callable[[Scope_], Context | Awaitable[Context | None] | None]
Route: TypeAlias = Callable[[Scope_], str | None]
Cost: TypeAlias = Callable[[Scope_, int], Charges | Awaitable[Charges | None] | None]


class BudgetASGIMiddleware:
    """Wraps an ASGI app; see the module docstring.

    - ``app``: the ASGI application to govern.
    - ``governor``: the :class:`~mcp_budget_governor.Governor` to enforce.
    - ``identify``: ``scope -> Context | None`` (sync or async).
    - ``route``: ``scope -> name | None``; the path by default, None skips.
    - ``cost``: ``(scope, status) -> {limit: amount} | None`` after the response.
    - ``fixed``: ``{limit: amount}`` charged per admitted request that ``cost`` does
      not price (failed, cancelled, dropped, or priced None).
    """

    def __init__(
        self,
        app: ASGIApp,
        governor: Governor,
        *,
        identify: Identify | None = None,
        route: Route | None = None,
        cost: Cost | None = None,
        fixed: Charges | None = None,
        exempt_paths: Collection[str] = HEALTH_PATHS,
    ) -> None:
        if not isinstance(governor, Governor):
            raise TypeError(f"BudgetASGIMiddleware needs a Governor, not {type(governor).__name__}")
        if isinstance(exempt_paths, str):
            raise TypeError("BudgetASGIMiddleware: exempt_paths= is a collection of paths")
        self.exempt_paths = frozenset(exempt_paths)
        self.fixed = fixed_charges(governor, fixed)
        for name, fn in (("identify", identify), ("route", route), ("cost", cost)):
            if fn is not None and not callable(fn):
                raise TypeError(f"BudgetASGIMiddleware: {name}= must be callable")
        self.app = app
        self.governor = governor
        self.identify = identify
        self.route = route
        self.cost = cost

    async def __call__(self, scope: Scope_, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        name = self.route(scope) if self.route is not None else scope.get("path")
        if name is None:
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def send_and_watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        async def respond() -> int:
            await self.app(scope, receive, send_and_watch)
            return status[0] if status else 500

        priced = None
        if self.cost is not None:
            cost = self.cost

            def priced(code: int) -> Any:
                return cost(scope, code)

        try:
            ctx = (await self._caller(scope)).with_tool(name)
            ctx = await self.governor.identified(ctx)
            await governed_call(self.governor, ctx, respond, fixed=self.fixed, priced=priced)
        except LimitExceeded as exc:
            if status:
                raise  # the app already answered: too late to refuse
            await refusal_response(exc.decision, scope.get("path"))(scope, receive, send)

    async def _caller(self, scope: Scope_) -> Context:
        if self.identify is not None:
            return await identify_with(self.identify, scope)
        return _scope_user(scope)


def _scope_user(scope: Scope_) -> Context:
    """The user an authentication middleware left in ``scope["user"]``, if any."""
    user = scope.get("user")
    if user is None or not getattr(user, "is_authenticated", False):
        return EMPTY
    name = user_of_token(getattr(user, "access_token", None)) or getattr(user, "identity", None)
    return Context(user=name) if isinstance(name, str) and name else EMPTY


def refusal_response(decision: Decision, instance: str | None = None) -> ASGIApp:
    """An ASGI app answering one refusal: its status, ``Retry-After`` and an RFC 9457
    problem body (``instance``: the request's path)."""
    problem = LimitExceeded(decision).to_problem_detail(instance)
    body = json.dumps({**problem, **refusal_body(decision)}).encode()
    headers: list[tuple[bytes, bytes]] = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode()),
    ]
    headers += [(k.lower().encode(), v.encode()) for k, v in decision.headers.items()]

    async def app(scope: Scope_, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": decision.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app
