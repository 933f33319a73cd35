"""``mcpbg serve``: every route behind its token, and the same numbers as the CLI's JSON.

A real uvicorn on a loopback port (testing.thread_server), a real Redis, a file ledger.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("duckdb")

from mcp_budget_governor import usd
from mcp_budget_governor.cli import main
from mcp_budget_governor.console.api import ROUTES
from testing.console_server import READ, WRITE, Served, serve_console


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, redis_service: Any) -> Iterator[Served]:
    with serve_console(tmp_path_factory.mktemp("serve"), redis_service, 7) as s:
        yield s


def call(
    served: Served, method: str, path: str, token: str | None, body: Any = None
) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(
        served.url + path,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers=headers,
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def cli_json(*argv: str) -> Any:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    assert code in (0, 1), out.getvalue()
    return json.loads(out.getvalue())


def _concrete(path: str) -> str:
    return path.replace("{id}", "0190-no-such-event")


_WRITE_BODY = {"limit": "tenant_spend", "scope": {"tenant": "acme"}, "cap_usd": "2"}


@pytest.mark.parametrize(
    ("path", "method"), [(p, m) for p, m, *_ in ROUTES] + [("/static/chart.umd.min.js", "GET")]
)
def test_every_route_refuses_a_missing_or_wrong_token(
    served: Served, path: str, method: str
) -> None:
    body = _WRITE_BODY if method != "GET" else None
    for token in (None, "wrong-token-0123456789abcdef", READ[:-1]):
        status, reply = call(served, method, _concrete(path), token, body)
        assert status == 401, (path, method, token, reply)
        assert reply == {"error": "missing or wrong bearer token"}


@pytest.mark.parametrize(("path", "method"), [(p, m) for p, m, *_ in ROUTES if m != "GET"])
def test_a_read_token_on_a_write_route_is_403(served: Served, path: str, method: str) -> None:
    status, reply = call(served, method, path, READ, _WRITE_BODY)
    assert status == 403 and "write token" in reply["error"]


def test_read_routes_answer_either_token(served: Served) -> None:
    for path, method, *_ in ROUTES:
        if method != "GET" or "{id}" in path:
            continue
        for token in (READ, WRITE):
            status, _ = call(served, "GET", path, token)
            assert status == 200, (path, token)


def test_budgets_agree_with_the_cli_json(served: Served) -> None:
    for flt in ([], ["--tenant", "acme"], ["--user", "u1"]):
        cli, api = _budgets_both_ways(served, flt)
        if _periods(api) != _periods(cli):  # a minute rolled over between the two reads
            cli, api = _budgets_both_ways(served, flt)
        assert _at_rest(api) == _at_rest(cli) and api["rows"]
        # The projected exhaustion moves with the clock (the rate is spent / time
        # elapsed), so two reads a moment apart agree on it within seconds, not exactly.
        for a, c in zip(api["rows"], cli["rows"], strict=True):
            assert (a["projected_exhaust_at"] is None) == (c["projected_exhaust_at"] is None)
            if a["projected_exhaust_at"] is not None:
                gap = _epoch(a["projected_exhaust_at"]) - _epoch(c["projected_exhaust_at"])
                assert abs(gap) <= 60, (a, c)
    rows = {r["name"]: r for r in _budgets_both_ways(served, ["--tenant", "acme"])[0]["rows"]}
    assert rows["tenant_spend"]["spent"] == 750_000


def _budgets_both_ways(served: Served, flt: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``mcpbg budgets --json`` with the filters ``flt``, and ``GET /v1/budgets`` with the same."""
    cli = cli_json(
        "budgets", "--policy", str(served.policy), "--redis-url", served.redis_url, "--json", *flt
    )
    query = "&".join(f"{flt[i][2:]}={flt[i + 1]}" for i in range(0, len(flt), 2))
    status, api = call(served, "GET", "/v1/budgets" + (f"?{query}" if query else ""), READ)
    assert status == 200
    return cli, api


def _periods(doc: dict[str, Any]) -> list[str]:
    return [r["period"] for r in doc["rows"]]


def _at_rest(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` without what depends on the moment it was read (``at``, the forecast time)."""
    rows = [{k: v for k, v in r.items() if k != "projected_exhaust_at"} for r in doc["rows"]]
    return {**{k: v for k, v in doc.items() if k != "at"}, "rows": rows}


def _epoch(iso: str) -> float:
    return datetime.strptime(iso, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def test_costs_agree_with_the_cli_json(served: Served) -> None:
    for args, query in (
        ([], ""),
        (["--by", "tenant,user"], "?by=tenant,user"),
        (["--tenant", "globex"], "?tenant=globex"),
    ):
        cli = cli_json("costs", "--ledger-dir", str(served.ledger), "--json", *args)
        status, api = call(served, "GET", "/v1/costs" + query, READ)
        assert status == 200 and api == cli, query


def test_alerts_events_and_errors_name_field_and_value(served: Served) -> None:
    status, alerts = call(served, "GET", "/v1/alerts", READ)
    assert status == 200
    assert alerts["breaker_trips"][0]["breaker"] == "global_spend"
    reasons = {r["reason"]: r["refusals"] for r in alerts["refusals_by_reason"]}
    assert reasons == {"burst: quota (429)": 3, "global_spend: breaker tripped (503)": 1}
    latest = alerts["latest_refusals"][0]
    status, ev = call(served, "GET", f"/v1/events/{latest['id']}", READ)
    assert status == 200 and ev["type"] == "mcpbg.rejected.v1"
    assert call(served, "GET", "/v1/events/nope", READ) == (
        404,
        {"error": "no such event in the ledger", "field": "id", "value": "nope"},
    )
    status, err = call(served, "GET", "/v1/costs?by=planet", READ)
    assert status == 400 and err["field"] == "by" and err["value"] == "planet"
    status, err = call(served, "GET", "/v1/budgets?colour=red", READ)
    assert (status, err["field"], err["value"]) == (400, "colour", "red")
    bad = {**_WRITE_BODY, "cap_usd": "-3"}
    status, err = call(served, "POST", "/v1/caps", WRITE, bad)
    assert (status, err["field"], err["value"]) == (400, "cap_usd", "-3"), err
    status, err = call(served, "POST", "/v1/caps", WRITE, {**_WRITE_BODY, "scope": {"user": "u1"}})
    assert status == 400 and err["field"] == "scope", err
    status, doc = call(served, "GET", "/openapi.json", READ)
    assert status == 200 and doc["openapi"].startswith("3.")
    assert {"/v1/budgets", "/v1/costs", "/v1/caps", "/v1/grants"} <= set(doc["paths"])


def test_writes_through_the_api_and_the_cli_api_option(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    status, change = call(served, "POST", "/v1/caps", WRITE, _WRITE_BODY)
    assert status == 200 and change["kind"] == "cap_set" and change["amount"] == usd(2)
    monkeypatch.setenv("MCPBG_READ_TOKEN", READ)
    monkeypatch.setenv("MCPBG_WRITE_TOKEN", WRITE)
    listed = cli_json("caps", "list", "--api", served.url, "--json")
    assert [r["scope"] for r in listed if r["kind"] == "cap"] == ["tenant=acme"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert (
            main(
                [
                    "grant",
                    "tenant_spend",
                    "--tenant",
                    "globex",
                    "--usd",
                    "1",
                    "--api",
                    served.url,
                    "--reason",
                    "goodwill",
                ]
            )
            == 0
        )
    assert "granted tenant_spend" in out.getvalue()
    rows = {
        r["name"]: r
        for r in cli_json("budgets", "--api", served.url, "--tenant", "acme", "--json")["rows"]
    }
    assert rows["tenant_spend"]["limit"] == usd(2)
    assert rows["tenant_spend"]["limit_source"].startswith("run-time")
    status, _ = call(
        served, "DELETE", "/v1/caps", WRITE, {"limit": "tenant_spend", "scope": {"tenant": "acme"}}
    )
    assert status == 200
    status, _ = call(
        served, "POST", "/v1/resets", WRITE, {"limit": "burst", "scope": {"user": "u1"}}
    )
    assert status == 200


def test_costs_html_writes_the_report_for_any_period(served: Served, tmp_path: Path) -> None:
    path = tmp_path / "costs.html"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            [
                "costs",
                "--ledger-dir",
                str(served.ledger),
                "--policy",
                str(served.policy),
                "--html",
                str(path),
            ]
        )
    assert code == 0
    html = path.read_text()
    assert 'id="spend"' in html and 'id="reasons"' in html and "Chart.js v4" in html
    assert '"tenant": "acme"' in html and "breaker tripped" in html  # caps and the trip drawn


def test_mcpbg_serve_runs_and_refuses_without_tokens(served: Served) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MCPBG_READ_TOKEN": READ, "MCPBG_WRITE_TOKEN": WRITE}
    argv = [
        sys.executable,
        "-m",
        "mcp_budget_governor.cli",
        "serve",
        "--policy",
        str(served.policy),
        "--redis-url",
        served.redis_url,
        "--ledger-dir",
        str(served.ledger),
        "--port",
        str(port),
    ]
    no_tokens = {k: v for k, v in env.items() if not k.endswith("_TOKEN")}
    refused = subprocess.run(argv, env=no_tokens, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "needs a token" in refused.stderr
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):  # until it listens (a wait, not a timing assertion)
            try:
                status, doc = call(
                    Served(
                        url,
                        *[getattr(served, f) for f in ("policy", "ledger", "redis_url", "server")],
                    ),
                    "GET",
                    "/v1/budgets?tenant=acme",
                    READ,
                )
                break
            except OSError:
                time.sleep(0.2)
        assert status == 200 and doc["rows"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


_BURST = {"limit": "burst", "scope": {"user": "u1"}}
_HUGE = "1E+999999999999999999"


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        *[
            ("POST", "/v1/caps", {**_BURST, "cap": n}, "cap")
            for n in ["\u00b2", "\u0661\u0662", "1_000", " 5"]
        ],
        ("POST", "/v1/caps", {**_WRITE_BODY, "cap_usd": _HUGE}, "cap_usd"),
        ("POST", "/v1/caps", {**_WRITE_BODY, "cap_usd": "\u0661.\u0665"}, "cap_usd"),
        ("POST", "/v1/grants", {**_WRITE_BODY, "cap_usd": None, "usd": _HUGE}, "usd"),
        ("POST", "/v1/grants", {**_BURST, "amount": "\u00b2"}, "amount"),
        ("POST", "/v1/caps", {**_WRITE_BODY, "scope": {"tenant": "\ud800"}}, None),
        ("POST", "/v1/caps", {**_WRITE_BODY, "reason": "\ud800\n"}, None),
        ("GET", "/v1/budgets?max_keys=%C2%B2", None, "max_keys"),
        ("GET", "/v1/costs?top=%D9%A1%D9%A2", None, "top"),
        ("GET", "/v1/alerts?n=+5", None, "n"),
    ],
)
def test_a_malformed_number_or_string_is_400_with_one_line(
    served: Served, method: str, path: str, body: Any, field: str | None
) -> None:
    if body is not None:
        body = {k: v for k, v in body.items() if v is not None}
    status, reply = call(served, method, path, WRITE, body)
    assert status == 400, reply
    assert isinstance(reply, dict) and "\n" not in reply["error"], reply
    if field is not None:
        assert reply["field"] == field, reply


def _headers(served: Served, path: str, authorization: str | None) -> tuple[int, Any]:
    req = urllib.request.Request(served.url + path)
    if authorization is not None:
        req.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers


def test_every_response_carries_the_security_headers(served: Served) -> None:
    for path, token in [
        ("/dashboard", f"Bearer {READ}"),
        ("/v1/budgets", f"Bearer {READ}"),
        ("/static/mcpbg-charts.js", f"Bearer {READ}"),
        ("/v1/budgets", None),  # the 401 too
        ("/v1/budgets?colour=red", f"Bearer {READ}"),  # and a 400
    ]:
        status, headers = _headers(served, path, token)
        assert status in (200, 400, 401), (path, status)
        csp = headers["Content-Security-Policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, path
        assert headers["X-Frame-Options"] == "DENY", path
        assert headers["X-Content-Type-Options"] == "nosniff", path


def test_the_bearer_scheme_is_case_insensitive(served: Served) -> None:
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert _headers(served, "/v1/budgets", f"{scheme} {READ}")[0] == 200, scheme
    assert _headers(served, "/v1/budgets", f"Basic {READ}")[0] == 401


def test_the_same_token_for_reading_and_writing_is_refused() -> None:
    from mcp_budget_governor.console.auth import Tokens
    from mcp_budget_governor.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"^MCPBG_READ_TOKEN: .*MCPBG_WRITE_TOKEN") as err:
        Tokens.from_env({"MCPBG_READ_TOKEN": WRITE, "MCPBG_WRITE_TOKEN": WRITE})
    assert WRITE not in str(err.value)
