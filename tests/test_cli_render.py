"""The CLI's shared output: tables print ids as written, errors are one line with exit code 2."""

from __future__ import annotations

import io

import pytest

from mcp_budget_governor.cli.render import fail, print_table, table


def test_cells_are_printed_as_written_never_as_markup(capsys: pytest.CaptureFixture[str]) -> None:
    print_table("spend", ["user", "usd"], [["[bold red]mallory[/]", "$1.00"], [None, "x"]])
    out = capsys.readouterr().out
    assert "[bold red]mallory[/]" in out
    assert "\x1b[" not in out


def test_fail_prints_one_line_naming_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert fail("costs", "--period: '2026-13' is not a month") == 2
    err = capsys.readouterr().err
    assert err == "mcpbg costs: --period: '2026-13' is not a month\n"


HEADERS = ["user", "tenant", "model_calls", "input_tokens", "usd"]
ROWS = [
    ["customer-" + "x" * 60, "acme", "12", "1,234,567", "$1234.567890"],
    ["bob", "globex-" + "y" * 30, "3", "9", "-$0.000001"],
]


@pytest.mark.parametrize("width", [200, 80, 60, 40])
def test_a_table_fits_its_width_and_never_splits_an_amount(width: int) -> None:
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=width, highlight=False).print(
        table("spend", HEADERS, ROWS, numeric=HEADERS[2:], width=width)
    )
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= width
    for amount in ("$1234.567890", "-$0.000001", "1,234,567"):
        assert amount in text  # whole, on one line
    assert ("field" in text) is (width < 60)  # too narrow side by side: one block per record
