"""The Redis scripts, shipped as files and loaded from here, never inlined in Python.

Each script is its prelude, a newline, then its body (``<name>.lua``). The
prelude is ``lib.lua`` (the shared counter helpers) cut to what the body uses:
the file's header comment, then each top-level definition the body names,
directly or through another picked one, in lib.lua's order. Lua makes a
closure of every ``local function`` on every call, so a helper a script never
calls would cost it on each one. This module is the one home of that rule:
``layout`` gives each prelude as lib.lua line ranges, which the conformance
vectors carry to the TypeScript package so it assembles the same bytes.
"""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files

if __name__ != "mcp_budget_governor.lua":  # one name per module (README, Layout)
    raise ImportError("import mcp_budget_governor.lua, not lua")

SCRIPTS = ("charge", "apply", "usage", "rewrite", "change", "lease")

#: lib.lua lines, 1-based and inclusive: (first, last).
Lines = tuple[int, int]

_DEFINITION = re.compile(r"local function ([A-Za-z_]\w*)\(|local ([A-Za-z_]\w*) = \S")
# What names nothing: comments and strings (long or quoted), so a helper named
# in a comment ("lib.lua add") or a string ('add') is not picked.
_NOISE = re.compile(
    r"--\[(=*)\[.*?\]\1\]|--[^\n]*|\[(=*)\[.*?\]\2\]|'(?:\\.|[^'\\\n])*'|\"(?:\\.|[^\"\\\n])*\"",
    re.DOTALL,
)


_LIB = "lua/lib.lua"


class LibLayoutError(ValueError):
    """lib.lua has a line the prelude splitter cannot place."""


def _lines(lib: str) -> list[str]:
    if not lib.endswith("\n"):
        raise LibLayoutError(f"{_LIB} must end with a newline")
    return lib.split("\n")[:-1]


def chunks(lib: str) -> tuple[int, dict[str, Lines]]:
    """lib.lua split at its top-level definitions: the header's last line, and name -> lines.

    A definition (``local function NAME(`` up to its ``end`` at column 0, or a
    one-line ``local NAME = ...``) takes the comment lines just above it and
    the blank lines after it. The header is what comes before the first one
    (comment lines, then a blank line). Anything else at the top level (a
    statement, a comment no definition follows) raises LibLayoutError: the
    splitter would not know which scripts need it.
    """
    lines = _lines(lib)
    starts: list[tuple[str, int]] = []  # (name, first line) per definition
    comment: int | None = None  # first line of the comment block above this line
    inside = False  # in a function, before its `end`
    for number, line in enumerate(lines, 1):
        if inside:
            if line == "end":
                inside = False
            elif line[:1] not in ("", " ", "\t"):
                raise LibLayoutError(
                    f"{_LIB} line {number}: {line!r} at column 0 inside a function"
                )
            continue
        if line.startswith("--"):
            comment = number if comment is None else comment
            continue
        if line.strip() == "":
            if comment is not None and starts:
                raise LibLayoutError(f"{_LIB} line {comment}: a comment no definition follows")
            comment = None
            continue
        found = _DEFINITION.match(line)
        if found is None:
            raise LibLayoutError(
                f"{_LIB} line {number}: {line!r} is not a top-level definition the prelude splitter"
                " understands (`local function NAME(` ... `end`, or one line `local NAME = ...`)"
            )
        name = found.group(1) or found.group(2)
        if any(name == seen for seen, _ in starts):
            raise LibLayoutError(f"{_LIB} line {number}: {name} is defined twice")
        starts.append((name, number if comment is None else comment))
        comment = None
        inside = found.group(1) is not None
    if inside or comment is not None:
        raise LibLayoutError(
            f"{_LIB} ends inside a function or with a comment no definition follows"
        )
    if not starts:
        raise LibLayoutError(f"{_LIB} defines nothing")
    ends = [first - 1 for _, first in starts[1:]] + [len(lines)]
    spans = {name: (first, end) for (name, first), end in zip(starts, ends, strict=True)}
    return starts[0][1] - 1, spans


def _names(code: str, among: dict[str, Lines]) -> set[str]:
    code = _NOISE.sub(" ", code)
    return {name for name in among if re.search(rf"\b{name}\b", code)}


def layout(lib: str, body: str) -> tuple[Lines, ...]:
    """The lib.lua lines of ``body``'s prelude, adjacent ranges merged."""
    header, defined = chunks(lib)
    lines = _lines(lib)

    def text(span: Lines) -> str:
        return "\n".join(lines[span[0] - 1 : span[1]])

    picked: set[str] = set()
    todo = _names(body, defined)
    while todo:
        name = todo.pop()
        picked.add(name)
        todo |= _names(text(defined[name]), defined) - picked
    spans = [(1, header)] if header else []
    spans += [span for name, span in defined.items() if name in picked]
    merged: list[Lines] = []
    for first, last in spans:
        if merged and merged[-1][1] + 1 == first:
            merged[-1] = (merged[-1][0], last)
        else:
            merged.append((first, last))
    return tuple(merged)


def assemble(lib: str, body: str) -> str:
    """The script ``body`` runs as: its prelude of ``lib``, a newline, then the body."""
    lines = _lines(lib)
    spans = layout(lib, body)
    return "".join(line + "\n" for a, b in spans for line in lines[a - 1 : b]) + "\n" + body


def _read(file: str) -> str:
    return files(__name__).joinpath(file).read_text(encoding="utf-8")


def _known(name: str) -> None:
    if name not in SCRIPTS:
        raise KeyError(f"no Lua script named {name!r} (known: {', '.join(SCRIPTS)})")


@cache
def script_layout(name: str) -> tuple[Lines, ...]:
    """The lib.lua lines of script ``name``'s prelude (the conformance vectors carry them)."""
    _known(name)
    return layout(_read("lib.lua"), _read(f"{name}.lua"))


@cache
def source(name: str) -> str:
    """The full source of script ``name``: its prelude of shared helpers, then its body."""
    _known(name)
    return assemble(_read("lib.lua"), _read(f"{name}.lua"))


@cache
def many_source() -> str:
    """charge_many.lua: several charges in one script call, each decided by
    charge.lua's whole source (:func:`source`), put where ``CHARGE_LUA`` stands."""
    wrapper = _read("charge_many.lua")
    if wrapper.count("\nCHARGE_LUA\n") != 1:
        raise LibLayoutError("charge_many.lua must hold the line CHARGE_LUA once")
    return wrapper.replace("\nCHARGE_LUA\n", "\n" + source("charge") + "\n")
