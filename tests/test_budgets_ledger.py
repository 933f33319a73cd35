"""``mcpbg budgets`` with a ledger: open reservations and session roots with their forks.

Through the command, on real Redis, with a file ledger (``--ledger-dir``).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from mcp_budget_governor import Context, Governor, Policy, usd
from mcp_budget_governor.cli import main as mcpbg
from mcp_budget_governor.producers.file_ledger import FileLedger
from mcp_budget_governor.projections.budgets import NOT_KNOWN
from mcp_budget_governor.projections.counters.redis import RedisBackend

TOML = """\
[[limits]]
name = "user_spend"
cap_usd = "5"
window = "day"
scope = "user"

[[limits]]
name = "per_session"
cap = 100
window = "session"
"""


async def run_cli(argv: list[str]) -> int:
    """The command as a user runs it, in its own thread (it starts its own event loop)."""
    return await asyncio.to_thread(mcpbg, argv)


async def test_open_reservations_and_session_forks(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(TOML)
    policy = Policy.from_file(path)
    folder = tmp_path / "ledger"
    ledger = FileLedger(folder, fsync="always")
    gov = Governor(policy, RedisBackend.from_url(redis_url, timeout=2.0), ledger=ledger)
    base = ["budgets", "--policy", str(path), "--redis-url", redis_url]
    with_ledger = [*base, "--ledger-dir", str(folder)]

    # A root session and two forks; alice holds a reservation while her work runs.
    for session in ("fix-4821", "fork-1", "fork-2"):
        root = None if session == "fix-4821" else "fix-4821"
        assert (await gov.check(Context(user="bob", session=session, session_root=root))).admitted
    held = await gov.reserve("user_spend", usd("0.40"), Context(user="alice"))

    assert await run_cli([*with_ledger, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    [open_] = doc["open_reservations"]
    assert (open_["id"], open_["limit"], open_["amount"]) == (held.id, "user_spend", 400_000)
    [session_row] = [r for r in doc["rows"] if r["name"] == "per_session"]
    assert session_row["spent"] == 3  # one budget for the root and its forks
    assert (session_row["session_root"], session_row["forks"]) == ("fix-4821", ["fork-1", "fork-2"])

    assert await run_cli(with_ledger) == 0
    table = capsys.readouterr().out
    assert "open reservations" in table and held.id in table and "$0.400000" in table
    assert "fork-1, fork-2" in table

    await gov.settle(held, usd("0.10"))
    assert await run_cli([*with_ledger, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["open_reservations"] == []  # settled: gone
    assert await run_cli(with_ledger) == 0
    table = capsys.readouterr().out
    assert "no open reservations" in table and held.id not in table

    # Without a ledger: not known (one line), never a zero.
    assert await run_cli([*base, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["open_reservations"] is None
    [session_row] = [r for r in doc["rows"] if r["name"] == "per_session"]
    assert (session_row["session_root"], session_row["forks"]) == ("fix-4821", None)
    assert await run_cli(base) == 0
    table = capsys.readouterr().out
    assert "no open reservations" not in table
    assert " ".join(NOT_KNOWN.split()) in " ".join(table.split())
    await gov.aclose()
