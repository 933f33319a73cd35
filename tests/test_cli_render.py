"""The CLI's shared output: tables print ids as written, errors are one line with exit code 2."""

from __future__ import annotations

import pytest

from mcp_budget_governor.cli.render import fail, print_table


def test_cells_are_printed_as_written_never_as_markup(capsys: pytest.CaptureFixture[str]) -> None:
    print_table("spend", ["user", "usd"], [["[bold red]mallory[/]", "$1.00"], [None, "x"]])
    out = capsys.readouterr().out
    assert "[bold red]mallory[/]" in out
    assert "\x1b[" not in out


def test_fail_prints_one_line_naming_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert fail("costs", "--period: '2026-13' is not a month") == 2
    err = capsys.readouterr().err
    assert err == "mcpbg costs: --period: '2026-13' is not a month\n"
