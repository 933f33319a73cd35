"""``mcpbg serve``: the admin HTTP API (and the dashboard) over the CLI's own functions.

Every route needs a bearer token (:mod:`.auth`): a missing or wrong one is
401, a read token on a write route 403. Reads: ``GET /v1/budgets`` (the rows
of ``mcpbg budgets --json``), ``/v1/costs`` (``mcpbg costs --json``),
``/v1/alerts`` (the stream worker's alerts, kept in Redis; breaker trips and
the latest refusals, from the ledger),
``/v1/events/{id}``, ``/v1/caps`` (``mcpbg caps list --json``); writes:
``POST``/``DELETE /v1/caps``, ``POST /v1/grants``, ``POST /v1/resets``, built
and validated by the same ``admin.py`` builders as the CLI's verbs. Errors
are JSON: ``{"error": ..., "field": ..., "value": ...}``. ``/openapi.json``
describes it all.

>>> from mcp_budget_governor import Limit, Policy, Scope, Window
>>> from mcp_budget_governor.console.auth import Tokens
>>> app = build_app(Console(
...     Policy.of(Limit("burst", cap=2, window=Window.MINUTE, scope=Scope.USER)),
...     backend=None, tokens=Tokens("r" * 16, "w" * 16)))
>>> sorted(openapi()["paths"])[:3]
['/dashboard', '/dashboard/data', '/openapi.json']
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import BackendUnavailableError, GovernorError, InvalidInputError
from ..numbers import whole
from ..policy import Policy
from .auth import Tokens

#: The cookie the dashboard's browser carries the read token in (``/dashboard?token=``).
COOKIE = "mcpbg_token"

#: Seconds a login link (:meth:`Console.login_link`) stays valid, if unused.
LOGIN_TTL = 900.0

_SCOPES = ("user", "tenant", "tool", "session", "agent")
_NO_LEDGER = "mcpbg serve was started without --archive-dir or --ledger-dir"


@dataclass
class Console:
    """What the routes read and write: the policy, the counters' backend, the ledger
    folders (costs, alerts, events), the governor writes go through, the tokens."""

    policy: Policy
    backend: Any
    tokens: Tokens
    archive_dir: str | None = None
    ledger_dir: str | None = None
    governor: Any = None
    #: what a write says it did: "appended to the ledger" or "written"
    where: str = "written"
    extra: dict[str, Any] = field(default_factory=dict)
    #: one-time login codes (:meth:`login_link`) and when each lapses (epoch seconds)
    logins: dict[str, float] = field(default_factory=dict)

    def login_link(self, ttl: float = LOGIN_TTL) -> str:
        """A path that logs one browser in once: ``/login?code=...`` sets the read token's
        cookie and sends it to the dashboard. The token itself never appears in a URL, so
        it reaches no address bar, history or access log; a used or lapsed code is refused."""
        code = secrets.token_urlsafe(24)
        self.logins[code] = time.time() + ttl
        return f"/login?code={code}"

    def redeem(self, code: str) -> bool:
        """True once for a code :meth:`login_link` made, within its time to live."""
        lapses = self.logins.pop(code, None)
        return lapses is not None and time.time() < lapses

    def ledger(self, since: Any = None, until: Any = None) -> Any:
        from ..projections.ledger_view import open_ledger

        if self.archive_dir is None and self.ledger_dir is None:
            raise InvalidInputError("ledger", None, _NO_LEDGER)
        return open_ledger(self.archive_dir, self.ledger_dir, since=since, until=until)

    async def worker_alerts(self, n: int, limit: str | None = None) -> list[dict[str, Any]]:
        """The ``n`` newest alerts the stream worker kept in the counters' Redis
        (``stream/alerts/store.py``), newest first; none on another backend."""
        from ..stream.alerts.store import latest_alerts

        client = getattr(self.backend, "client", None)
        if client is None or not hasattr(client, "xrevrange"):
            return []  # Postgres counters, or none: the worker keeps no alerts there
        import redis

        try:
            return await latest_alerts(client, n, limit=limit)
        except (redis.RedisError, OSError) as exc:  # 503: try again later
            raise BackendUnavailableError.redis(exc) from None


# -- errors ---------------------------------------------------------------------


def _field(name: str) -> str:
    """An option's name as the API's field (``--cap-usd`` -> ``cap_usd``)."""
    return name.lstrip("-").replace("-", "_") if name.startswith("--") else name


def error(status: int, message: str, fld: str | None = None, value: Any = None) -> JSONResponse:
    """One line of JSON: what is wrong, and the field and value it is about."""
    body: dict[str, Any] = {"error": _text_of(message)}
    if fld is not None:
        body["field"] = _text_of(fld)
        ok = isinstance(value, int | float | bool | None)
        body["value"] = value if ok else _text_of(value if isinstance(value, str) else repr(value))
    return JSONResponse(body, status_code=status)


def _text_of(text: str) -> str:
    """``text`` on one line and encodable: what the caller sent may hold a lone
    surrogate (``"\\ud800"``, valid JSON), which UTF-8 cannot carry; it is shown
    escaped, so the refusal itself cannot fail."""
    return " ".join(text.splitlines()).encode("utf-8", "backslashreplace").decode("utf-8")


#: Sent with every response: the console's pages load nothing but its own files, are
#: never framed by another site, and are never sniffed into another type.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every HTTP response (refusals included)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.raw = [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.raw]}
            await send(message)

        await self.app(scope, receive, with_headers)


Handler = Callable[[Request], Awaitable[Response]]


def _guard(handler: Handler) -> Handler:
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except InvalidInputError as exc:
            return error(400, exc.problem, _field(exc.field), exc.value)
        except KeyError as exc:  # an unknown limit, plan...
            return error(400, str(exc).strip("'\""))
        except BackendUnavailableError as exc:  # the counters' Redis: try again later
            return error(503, str(exc))
        except GovernorError as exc:
            return error(400, str(exc))

    return run


class Auth:
    """Every route: 401 without a valid token, 403 for a read token on a write route.

    Reads accept the header or the dashboard's cookie; writes only the header (a
    cookie alone never changes anything, so no cross-site request can)."""

    def __init__(self, app: ASGIApp, tokens: Tokens) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        if scope["path"] == "/login":
            await _login(request, self.tokens)(scope, receive, send)
            return
        write = request.method not in ("GET", "HEAD")
        header = request.headers.get("authorization")
        if header is None and not write:
            cookie = request.cookies.get(COOKIE)
            query = request.query_params.get("token") if scope["path"] == "/dashboard" else None
            given = query or cookie
            header = f"Bearer {given}" if given else None
        level = self.tokens.level(header)
        if level is None:
            response: Response = error(401, "missing or wrong bearer token")
            response.headers["WWW-Authenticate"] = 'Bearer realm="mcpbg"'
        elif write and level != "write":
            response = error(403, "this route needs the write token")
        elif scope["path"] == "/dashboard" and "token" in request.query_params:
            # Moved into a cookie, out of the address bar and the history.
            response = RedirectResponse("/dashboard", status_code=303)
            response.set_cookie(
                COOKIE, request.query_params["token"], httponly=True, samesite="strict"
            )
        else:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)


def _login(request: Request, tokens: Tokens) -> Response:
    """A one-time login link: its code, once, buys the read token's cookie."""
    console: Console = request.app.state.console
    if not console.redeem(request.query_params.get("code", "")):
        return error(
            401,
            "this login link was used already or has lapsed: mcpbg serve prints a new one "
            "at each start",
        )
    response = RedirectResponse("/dashboard", status_code=303)
    response.set_cookie(COOKIE, tokens.read or tokens.write, httponly=True, samesite="strict")
    return response


# -- reads ----------------------------------------------------------------------


def _params(request: Request, allowed: tuple[str, ...]) -> dict[str, str]:
    got = dict(request.query_params)
    got.pop("token", None)
    for name in got:
        if name not in allowed:
            raise InvalidInputError(
                name, got[name], f"unknown parameter; one of {', '.join(allowed)}"
            )
    return got


#: The most a count in a query (``max_keys``, ``top``, ``n``) may ask for.
MAX_COUNT = 1_000_000


def _int(params: dict[str, str], name: str) -> int | None:
    text = params.get(name)
    return None if text is None else whole(text, name, least=1, most=MAX_COUNT)


async def budgets(request: Request) -> Response:
    from ..projections.budgets import DEFAULT_MAX_KEYS, budget_report

    c: Console = request.app.state.console
    p = _params(request, (*_SCOPES, "max_keys"))
    report = await budget_report(
        c.policy,
        c.backend,
        max_keys=_int(p, "max_keys") or DEFAULT_MAX_KEYS,
        user=p.get("user"),
        tenant=p.get("tenant"),
        tool=p.get("tool"),
        session=p.get("session"),
        agent=p.get("agent"),
    )
    return JSONResponse(report.as_json())


_COST_PARAMS = (
    "by",
    "period",
    "from",
    "to",
    "user",
    "tenant",
    "tool",
    "model",
    "limit",
    "top",
    "session",
)


def cost_filter(p: dict[str, str]) -> Any:
    """The ``mcpbg costs`` filter from query parameters (``from``/``to``/``period``)."""
    from ..projections.costs import Filter
    from ..windows import parse_period, parse_range

    start: datetime | None
    end: datetime | None
    if "period" in p:
        if "from" in p or "to" in p:
            raise InvalidInputError("period", p["period"], "give period or from/to")
        start, end = parse_period(p["period"])
    else:
        start, end = parse_range(p.get("from"), p.get("to"))
    return Filter(
        start,
        end,
        p.get("user"),
        p.get("tenant"),
        p.get("tool"),
        p.get("model"),
        p.get("limit"),
        p.get("session"),
    )


async def costs(request: Request) -> Response:
    from ..projections.costs import costs_json, costs_reports

    c: Console = request.app.state.console
    p = _params(request, _COST_PARAMS)
    flt = cost_filter(p)
    top = _int(p, "top")
    by = [b.strip() for b in p["by"].split(",") if b.strip()] if p.get("by") else None

    def read() -> Any:
        con = c.ledger(flt.start, flt.end)
        try:
            return costs_json(costs_reports(con, flt, by=by, top=top, policy=c.policy))
        finally:
            con.close()

    return _json(await run_in_threadpool(read))


def _json(data: Any) -> Response:
    # default=str: decimals and times as the CLI's --json writes them
    return Response(json.dumps(data, default=str), media_type="application/json")


async def alerts(request: Request) -> Response:
    from ..projections.costs import breaker_trips, costs_json
    from .data import latest_refusals, refusals_by_reason

    c: Console = request.app.state.console
    p = _params(request, (*_COST_PARAMS, "n"))
    flt = cost_filter(p)
    n = _int(p, "n") or 50
    worker = await c.worker_alerts(n, p.get("limit"))

    def read() -> Any:
        con = c.ledger(flt.start, flt.end)
        try:
            return {
                "breaker_trips": costs_json([breaker_trips(con, flt)])["breaker trips"],
                "refusals_by_reason": refusals_by_reason(con, flt),
                "latest_refusals": latest_refusals(con, flt, n),
            }
        finally:
            con.close()

    if c.archive_dir is None and c.ledger_dir is None:
        # Kafka + Redis without an archive: the worker's alerts are still there.
        return _json({"alerts": worker, "ledger_error": _NO_LEDGER})
    return _json({"alerts": worker, **await run_in_threadpool(read)})


async def event(request: Request) -> Response:
    from .data import event_rows

    c: Console = request.app.state.console
    _params(request, ())
    event_id = request.path_params["id"]

    def read() -> Any:
        con = c.ledger()
        try:
            return event_rows(con, event_id)
        finally:
            con.close()

    rows = await run_in_threadpool(read)
    if not rows:
        return error(404, "no such event in the ledger", "id", event_id)
    return _json({"id": event_id, "type": rows[0].get("type"), "rows": rows})


async def caps_list(request: Request) -> Response:
    from ..projections.changes import change_rows

    c: Console = request.app.state.console
    _params(request, ())
    return _json(await change_rows(c.policy, c.backend))


# -- writes ---------------------------------------------------------------------


async def _body(request: Request, allowed: tuple[str, ...]) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise InvalidInputError("body", "<not JSON>", "expected a JSON object") from None
    if not isinstance(body, dict):
        raise InvalidInputError("body", body, "expected a JSON object")
    for name in body:
        if name not in allowed:
            raise InvalidInputError(name, body[name], f"unknown field; one of {', '.join(allowed)}")
    limit = body.get("limit")
    if not isinstance(limit, str) or not limit:
        raise InvalidInputError("limit", limit, "expected a limit's name")
    scope = body.get("scope", {})
    if not isinstance(scope, dict) or not all(isinstance(v, str) for v in scope.values()):
        raise InvalidInputError("scope", scope, 'expected {"tenant": "acme", ...}')
    for name in ("reason", "actor"):
        if not isinstance(body.get(name, ""), str):
            raise InvalidInputError(name, body[name], "expected text")
    for name, value in [*body.items(), *(("scope", k) for k in scope), *scope.items()]:
        if isinstance(value, str) and not _encodable(value):
            # JSON may carry a lone surrogate ("\\ud800"); the ledger and Redis cannot.
            raise InvalidInputError(name, value, "not valid Unicode (a lone surrogate)")
    return body


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _text(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise InvalidInputError(name, value, "expected a number or its text")
    return str(value)


def _done(c: Console, change: Any) -> Response:
    return JSONResponse(
        {
            "kind": change.kind.value,
            "limit": change.limit,
            "field": change.field,
            "key": change.key,
            "amount": change.amount,
            "where": c.where,
        }
    )


_WRITE = ("limit", "scope", "reason", "actor")


async def caps_set(request: Request) -> Response:
    from .. import admin

    c: Console = request.app.state.console
    body = await _body(request, (*_WRITE, "cap", "cap_usd", "until"))
    limit, scope = body["limit"], body.get("scope", {})
    cap = admin.parse_amount(
        c.policy, limit, ("cap_usd", _text(body, "cap_usd")), ("cap", _text(body, "cap"))
    )
    until = admin.parse_until(c.policy, _text(body, "until"))
    admin.cap_change(c.policy, limit, scope, cap, until=until, now=time.time())
    change = await c.governor.set_cap(
        limit,
        cap,
        until=until,
        reason=body.get("reason", ""),
        actor=body.get("actor", ""),
        **scope,
    )
    return _done(c, change)


async def caps_unset(request: Request) -> Response:
    from .. import admin

    c: Console = request.app.state.console
    body = await _body(request, _WRITE)
    limit, scope = body["limit"], body.get("scope", {})
    admin.uncap_change(c.policy, limit, scope)
    change = await c.governor.unset_cap(
        limit, reason=body.get("reason", ""), actor=body.get("actor", ""), **scope
    )
    return _done(c, change)


async def grants(request: Request) -> Response:
    from .. import admin

    c: Console = request.app.state.console
    body = await _body(request, (*_WRITE, "amount", "usd"))
    limit, scope = body["limit"], body.get("scope", {})
    amount = admin.parse_amount(
        c.policy, limit, ("usd", _text(body, "usd")), ("amount", _text(body, "amount"))
    )
    admin.grant_change(c.policy, limit, scope, amount, now=time.time())
    change = await c.governor.grant(
        limit, amount, reason=body.get("reason", ""), actor=body.get("actor", ""), **scope
    )
    return _done(c, change)


async def resets(request: Request) -> Response:
    from .. import admin

    c: Console = request.app.state.console
    body = await _body(request, _WRITE)
    limit, scope = body["limit"], body.get("scope", {})
    admin.grant_change(c.policy, limit, scope, None, now=time.time(), used=0)
    change = await c.governor.reset(
        limit, reason=body.get("reason", ""), actor=body.get("actor", ""), **scope
    )
    return _done(c, change)


# -- the document and the app --------------------------------------------------


def _q(*names: str) -> list[dict[str, Any]]:
    return [
        {"name": n, "in": "query", "required": False, "schema": {"type": "string"}} for n in names
    ]


_WRITE_BODY = {
    "type": "object",
    "required": ["limit", "scope"],
    "properties": {
        "limit": {"type": "string"},
        "scope": {"type": "object", "additionalProperties": {"type": "string"}},
        "reason": {"type": "string"},
        "actor": {"type": "string"},
    },
}

#: (path, method, handler, summary, query parameters, body extra properties)
ROUTES: tuple[tuple[str, str, Handler, str, list[dict[str, Any]], dict[str, Any] | None], ...] = (
    (
        "/v1/budgets",
        "GET",
        budgets,
        "mcpbg budgets --json: every counter in its current period (filter by scope values)",
        _q(*_SCOPES, "max_keys"),
        None,
    ),
    (
        "/v1/costs",
        "GET",
        costs,
        "mcpbg costs --json: spend by tenant, user, tool, model, day",
        _q(*_COST_PARAMS),
        None,
    ),
    (
        "/v1/alerts",
        "GET",
        alerts,
        "the stream worker's latest alerts (limit, scope, level, time; from Redis), "
        "breaker trips and refusals from the ledger",
        _q(*_COST_PARAMS, "n"),
        None,
    ),
    (
        "/v1/events/{id}",
        "GET",
        event,
        "one ledger event, a row per charge",
        [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
        None,
    ),
    ("/v1/caps", "GET", caps_list, "mcpbg caps list --json", [], None),
    (
        "/v1/caps",
        "POST",
        caps_set,
        "mcpbg caps set (write token)",
        [],
        {"cap": {"type": "string"}, "cap_usd": {"type": "string"}, "until": {"type": "string"}},
    ),
    ("/v1/caps", "DELETE", caps_unset, "mcpbg caps unset (write token)", [], {}),
    (
        "/v1/grants",
        "POST",
        grants,
        "mcpbg grant (write token)",
        [],
        {"amount": {"type": "string"}, "usd": {"type": "string"}},
    ),
    ("/v1/resets", "POST", resets, "mcpbg reset (write token)", [], {}),
    ("/dashboard", "GET", lambda r: _dashboard(r), "the live dashboard (HTML)", _q("token"), None),
    (
        "/dashboard/data",
        "GET",
        lambda r: _dashboard_data(r),
        "what the dashboard draws",
        _q("period"),
        None,
    ),
    ("/openapi.json", "GET", lambda r: _openapi(r), "this document", [], None),
)


def openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 document of :data:`ROUTES`."""
    from .. import __version__

    paths: dict[str, dict[str, Any]] = {}
    err = {
        "description": "error",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "error": {"type": "string"},
                        "field": {"type": "string"},
                        "value": {},
                    },
                }
            }
        },
    }
    for path, method, _, summary, params, extra in ROUTES:
        op: dict[str, Any] = {
            "summary": summary,
            "parameters": params,
            "security": [{"bearer": []}],
            "responses": {"200": {"description": "ok"}, "400": err, "401": err, "403": err},
        }
        if extra is not None:
            schema = json.loads(json.dumps(_WRITE_BODY))
            schema["properties"].update(extra)
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": schema}},
            }
        paths.setdefault(path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "mcpbg admin API", "version": __version__},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": paths,
    }


async def _openapi(request: Request) -> Response:
    return JSONResponse(openapi())


async def _dashboard(request: Request) -> Response:
    from .dashboard import page

    return HTMLResponse(page())


async def _dashboard_data(request: Request) -> Response:
    from .dashboard import snapshot

    c: Console = request.app.state.console
    p = _params(request, ("period",))
    return _json(await snapshot(c, p.get("period")))


async def _static(request: Request) -> Response:
    from .report import static_file

    name = request.path_params["name"]
    try:
        text, media = static_file(name)
    except KeyError:
        return error(404, "no such file", "name", name)
    return Response(text, media_type=media, headers={"Cache-Control": "max-age=3600"})


async def _root(request: Request) -> Response:
    return RedirectResponse("/dashboard", status_code=307)


def build_app(console: Console) -> Starlette:
    """The ASGI app: every route behind :class:`Auth`."""
    routes = [Route(path, _guard(h), methods=[m]) for path, m, h, *_ in ROUTES]
    routes += [
        Route("/static/{name}", _guard(_static), methods=["GET"]),
        Route("/", _root, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(SecurityHeaders), Middleware(Auth, tokens=console.tokens)],
    )
    app.state.console = console
    return app


async def serve_console(console: Console, host: str, port: int, *, name: str = "serve") -> None:
    """Serve ``console`` until interrupted; once listening, print a one-time login link
    (the port's real number, also for port 0) that a person can open."""
    import uvicorn

    config = uvicorn.Config(build_app(console), host=host, port=port, log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():  # noqa: ASYNC110 (uvicorn has only a flag)
        await asyncio.sleep(0.05)
    if server.started:
        bound = server.servers[0].sockets[0].getsockname()[1]
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        print(
            f"mcpbg {name}: the dashboard: open http://{shown}:{bound}{console.login_link()}\n"
            f"  (a one-time login link: it sets a cookie and is spent; Ctrl-C stops)",
            flush=True,
        )
    await task
