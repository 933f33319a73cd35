"""Each Redis script gets the lib.lua helpers its body uses and no others (lua/__init__.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mcp_budget_governor import lua
from mcp_budget_governor.lua import SCRIPTS, LibLayoutError, assemble, chunks, source

LIB = (Path(__file__).resolve().parents[1] / "lua" / "lib.lua").read_text("utf-8")

# What each body calls or reads of lib.lua, written out by hand (not by the rule
# under test), with what those helpers use in turn.
USES = {
    "charge": {"caller_ms", "add", "epoch_ok", "LEASE_PREFIX", "is_lease", "now_ms",
               "live_leases", "take_lease", "waiters_ahead"},
    "apply": {"caller_ms", "negate", "add", "epoch_ok", "change_key_ok", "apply_change"},
    "usage": set(),
    "rewrite": {"negate"},
    "change": {"caller_ms", "change_key_ok", "apply_change"},
    "lease": {"caller_ms", "LEASE_PREFIX", "is_lease", "now_ms", "live_leases", "take_lease",
              "QUEUE_PREFIX"},
}  # fmt: skip


def defines(code: str) -> set[str]:
    return set(re.findall(r"^local (?:function )?([A-Za-z_]\w*)", code, re.MULTILINE))


def test_lib_splits_into_its_definitions() -> None:
    header, defined = chunks(LIB)
    assert set(defined) == defines(LIB)
    assert LIB.splitlines()[header - 1] == ""  # the header ends with a blank line


def body_of(name: str) -> str:
    return (Path(__file__).resolve().parents[1] / "lua" / f"{name}.lua").read_text("utf-8")


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_script_has_the_helpers_it_uses_and_no_others(name: str) -> None:
    header, _ = chunks(LIB)
    full, body = source(name), body_of(name)
    assert full.endswith("\n" + body)
    prelude = full[: -len(body) - 1]
    assert defines(prelude) == USES[name], name
    assert prelude.startswith("".join(f"{line}\n" for line in LIB.split("\n")[:header]))


def test_charge_lacks_the_change_helpers() -> None:
    assert "local function apply_change" not in source("charge")
    assert "local function negate" not in source("charge")
    assert "local function add(" in source("charge")


def test_a_helper_brings_the_helpers_it_calls() -> None:
    got = assemble(LIB, "return now_ms()\n")
    assert defines(got) == {"now_ms", "caller_ms"}
    assert got.index("function caller_ms") < got.index("function now_ms")  # lib.lua's order
    assert defines(assemble(LIB, "return is_lease(KEYS[1])\n")) == {"is_lease", "LEASE_PREFIX"}


def test_names_in_comments_and_strings_are_not_uses() -> None:
    assert defines(assemble(LIB, "-- see lib.lua add\nreturn 'negate'\n")) == set()


def test_every_helper_gives_the_whole_lib() -> None:
    _, defined = chunks(LIB)
    assert assemble(LIB, " ".join(defined) + "\n") == LIB + "\n" + " ".join(defined) + "\n"


def test_the_layout_is_the_lib_lines_of_the_source() -> None:
    lines = LIB.split("\n")
    for name in SCRIPTS:
        head = "".join(line + "\n" for a, b in lua.script_layout(name) for line in lines[a - 1 : b])
        assert source(name) == head + "\n" + body_of(name)
        assert lua.script_layout(name) == lua.layout(LIB, body_of(name))


@pytest.mark.parametrize(
    ("lib", "message"),
    [
        (
            LIB + "redis.call('DEL', KEYS[1])\n",
            r"line 1\d\d: \"redis.call\('DEL', KEYS\[1\]\)\" is not",
        ),
        (
            LIB.replace("\nend\n", "\n  end\n", 1),
            r"line 25: 'local function negate\(amount\)' at column 0",
        ),
        (LIB + "local function f()\n  return 1\n", r"ends inside a function"),
        (LIB + "-- a note on nothing\n\n", r"a comment no definition follows"),
        (LIB + "local T = {\n  a = 1,\n}\n", r"is not a top-level definition"),
        (LIB + "local function negate(x)\n  return x\nend\n", r"negate is defined twice"),
        (LIB.rstrip("\n"), r"must end with a newline"),
    ],
)
def test_a_top_level_line_the_splitter_cannot_place_is_refused(lib: str, message: str) -> None:
    with pytest.raises(LibLayoutError, match=message):
        assemble(lib, "return 1\n")
