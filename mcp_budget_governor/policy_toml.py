"""Policies written as TOML files: the text read and mapped onto what builds a policy.

A policy file maps onto :class:`Policy` and :class:`Limit` key for key and is
validated by their constructors, so a rule (caps, windows, scopes, names,
time zones, alert levels) has one implementation whether a policy is written in
Python or in a file. What this layer adds is what only a file needs:

- every key must be known (a misspelt ``widow = "day"`` would otherwise leave a
  limit silently inert), and the required ones (``name``, a cap, ``window``)
  must be present;
- money caps are written in dollars, ``cap_usd = "25.00"`` (a decimal string
  with at most six decimals, or a whole number), never as a float, which
  cannot hold money exactly; ``cap_usd`` implies ``unit = "usd_micros"``;
- each error names the file, the line, the key path and the value, e.g.
  ``policy.toml:12: limits[2].window: unknown Window ... (got 'fortnight')``.

``tomllib`` reports no positions for values, so :func:`locate` is a small
scanner of the same text that maps each key path to the line it is written on
(array-of-tables headers, dotted keys, inline tables and arrays, comments and
multi-line strings included). It only runs on text ``tomllib`` has accepted.

This module stands below :mod:`~mcp_budget_governor.policy`, whose
``Policy.from_file`` reads through it: what builds the policy (``Policy.of``)
is passed in. :mod:`~mcp_budget_governor.policy_file` binds it once.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any, Generic, TypeVar

from .caps import Plan
from .errors import InvalidInputError, PolicyError
from .limits import Limit
from .money import Unit, usd

#: What a policy file builds: a ``Policy``, from ``Policy.of(*limits, **options)``.
P = TypeVar("P")

#: A key path inside a document: table keys and array indices.
KeyPath = tuple[str | int, ...]

#: Keys of a ``[[limits]]`` table: the fields of :class:`Limit`, plus ``cap_usd``.
LIMIT_KEYS: tuple[str, ...] = (*(f.name for f in dataclasses.fields(Limit)), "cap_usd")
_REQUIRED = ("name", "window")
_DOLLARS = re.compile(r"[0-9]+(\.[0-9]{1,6})?")


_EMPTY_SCOPE = (
    'an empty list names no dimension: write scope = "global" for one counter '
    'for everyone, or name the dimensions (scope = ["tenant"])'
)


class PolicyFileError(PolicyError):
    """A policy file is invalid; the message starts with ``<file>:<line>:``.

    ``field`` is the key path in the file (``limits[2].window``), ``value`` what
    it holds, ``file`` and ``line`` (1-based, None when unknown) where it is.
    """

    def __init__(self, file: str, line: int | None, field: str, value: Any, problem: str) -> None:
        super().__init__(field, value, problem)
        self.file = file
        self.line = line
        where = file if line is None else f"{file}:{line}"
        self.args = (f"{where}: {self.args[0]}",)


# -- loading ------------------------------------------------------------------


def load_file(path: str | os.PathLike[str], of: Callable[..., P]) -> P:
    """Read and validate the policy file at ``path`` (TOML); ``of`` builds the policy."""
    p = Path(path)
    if p.suffix.lower() != ".toml":
        raise InvalidInputError("policy", str(path), "expected a .toml policy file")
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise InvalidInputError("policy", str(path), "no such file") from None
    except OSError as exc:
        raise InvalidInputError("policy", str(path), f"cannot read it ({exc.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise PolicyFileError(str(path), line, "file", str(path), "not UTF-8 text") from None
    return loads(text, of, source=str(path))


def loads(text: str, of: Callable[..., P], *, source: str = "<policy>") -> P:
    """Validate the TOML policy ``text``; ``source`` names it in errors, ``of`` builds it."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _syntax_error(exc, text, source) from None
    except RecursionError:  # tomllib recurses once per [ or { level
        raise PolicyFileError(source, None, "file", source, "nested too deeply") from None
    try:
        lines = locate(text)
    except (IndexError, ValueError):  # pragma: no cover - tomllib accepted the text
        lines = {}
    return _Builder(source, lines, of).policy(doc)


def _syntax_error(exc: tomllib.TOMLDecodeError, text: str, source: str) -> PolicyFileError:
    # tomllib (3.11-3.13) puts the position only in the message: "... (at line 3, column 9)".
    message = str(exc)
    found = re.search(r"\(at line (\d+), column (\d+)\)$", message)
    if found is None:
        found_eof = message.endswith("(at end of document)")
        line = text.count("\n") + 1 if found_eof else None
        problem = re.sub(r"\s*\(at end of document\)$", " at the end of the file", message)
        return PolicyFileError(source, line, "TOML", "", problem)
    line, column = int(found[1]), int(found[2])
    problem = message[: found.start()].rstrip() + f" at column {column}"
    text_lines = text.splitlines()
    shown = text_lines[line - 1].strip() if line <= len(text_lines) else ""
    return PolicyFileError(source, line, "TOML", shown, problem)


# -- mapping the document onto the constructors --------------------------------


def _dotted(path: KeyPath) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "policy"


class _Builder(Generic[P]):
    """Maps a parsed document onto ``Policy``/``Limit``, translating their errors."""

    def __init__(self, source: str, lines: Mapping[KeyPath, int], of: Callable[..., P]) -> None:
        self.source = source
        self.lines = lines
        self.of = of

    def line(self, path: KeyPath) -> int | None:
        """The line of ``path``, else of its nearest located parent."""
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None

    def error(self, path: KeyPath, value: Any, problem: str) -> PolicyFileError:
        return PolicyFileError(self.source, self.line(path), _dotted(path), value, problem)

    def unknown(self, path: KeyPath, known: tuple[str, ...]) -> PolicyFileError:
        key = path[-1]
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
        return self.error(path, key, f"unknown key ({hint})")

    def policy(self, doc: dict[str, Any]) -> P:
        top_keys = self.policy_keys()
        for key in doc:
            if key not in top_keys:
                raise self.unknown((key,), top_keys)
        if "limits" not in doc:
            raise self.error(("limits",), None, "missing: a policy file needs [[limits]] tables")
        entries = doc["limits"]
        if not isinstance(entries, list):
            raise self.error(("limits",), entries, "expected an array of tables ([[limits]])")
        limits = [self.limit(i, entry) for i, entry in enumerate(entries)]
        # [gateway] is mcpbg proxy's table (gateway.py reads and checks it).
        skip = ("limits", "plans", "assign", "gateway")
        options = {k: v for k, v in doc.items() if k not in skip}
        by_name = {lim.name: lim for lim in limits}
        options["plans"] = self.plans(doc.get("plans", {}), by_name)
        assign = doc.get("assign", {})
        if not isinstance(assign, dict):
            raise self.error(("assign",), assign, 'expected a table: [assign] acme = "pro"')
        for who, plan in assign.items():
            if plan not in {p.name for p in options["plans"]}:
                known = ", ".join(p.name for p in options["plans"]) or "none"
                raise self.error(("assign", who), plan, f"no such plan (known: {known})")
        options["assignments"] = assign
        try:
            return self.of(*limits, **options)
        except PolicyError as exc:
            raise self.translate(exc, None) from None

    def policy_keys(self) -> tuple[str, ...]:
        # Every option Policy.of takes is a top-level key, so a new option is
        # accepted (and validated by Policy.of) without touching this module.
        # Plans and assignments are tables of their own ([plans.<name>], [assign]).
        options = inspect.signature(self.of).parameters.values()
        named = (p.name for p in options if p.kind is p.KEYWORD_ONLY)
        return (
            "limits",
            *(n for n in named if n not in ("plans", "assignments")),
            "plans",
            "assign",
            "gateway",
        )

    def plans(self, doc: Any, limits: Mapping[str, Limit]) -> list[Plan]:
        """``[plans.<name>]`` tables of ``limit = cap`` (dollars for money limits)."""
        if not isinstance(doc, dict):
            raise self.error(("plans",), doc, "expected tables: [plans.<name>]")
        out: list[Plan] = []
        for name, caps in doc.items():
            here: KeyPath = ("plans", name)
            if not isinstance(caps, dict):
                raise self.error(here, caps, "expected a table of limit = cap")
            converted: dict[str, int] = {}
            for limit, cap in caps.items():
                if limit not in limits:
                    raise self.error(
                        (*here, limit), limit, f"no such limit (known: {', '.join(limits)})"
                    )
                converted[limit] = self.amount((*here, limit), cap, limits[limit].unit)
            try:
                out.append(Plan(name, converted))
            except PolicyError as exc:
                raise self.error(here, exc.value, exc.problem) from None
        return out

    def amount(self, path: KeyPath, value: Any, unit: Unit) -> int:
        """A cap in a file: dollars for a money limit, else a whole number."""
        if unit is Unit.USD_MICROS:
            return self.dollars(path, value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(path, value, "expected a whole number")
        if value < 0:
            raise self.error(path, value, "must not be negative")
        return value

    def limit(self, i: int, entry: Any) -> Limit:
        here: KeyPath = ("limits", i)
        if not isinstance(entry, dict):
            raise self.error(here, entry, "expected a table of limit settings")
        for key in entry:
            if key not in LIMIT_KEYS:
                raise self.unknown((*here, key), LIMIT_KEYS)
        for key in _REQUIRED:
            concurrent = str(entry.get("unit", "")).lower() == Unit.CONCURRENT.value
            if key not in entry and not (key == "window" and concurrent):
                raise self.error(here, None, f"missing required key {key!r}")
        fields = dict(entry)
        if "cap_usd" in fields:
            if "cap" in fields:
                raise self.error(
                    (*here, "cap_usd"), fields["cap_usd"], "give cap or cap_usd, not both"
                )
            fields["cap"] = self.dollars((*here, "cap_usd"), fields.pop("cap_usd"))
            unit = fields.setdefault("unit", Unit.USD_MICROS.value)
            if not isinstance(unit, str) or unit.lower() != Unit.USD_MICROS.value:
                raise self.error(
                    (*here, "unit"),
                    unit,
                    "cap_usd is a money cap: unit must be usd_micros (or left out)",
                )
        elif "cap" not in fields:
            raise self.error(here, None, "missing required key 'cap' (or 'cap_usd' for money)")
        if fields.get("scope") == []:
            # Most likely dimensions left out by mistake: it would silently be global.
            raise self.error((*here, "scope"), [], _EMPTY_SCOPE)
        if fields.get("scope") == "global":
            fields["scope"] = None  # written out explicitly: no dimension
        if "caps" in fields:
            caps = fields["caps"]
            if not isinstance(caps, dict):
                raise self.error(
                    (*here, "caps"), caps, 'expected a table: caps = { acme = "100.00" }'
                )
            money = "cap_usd" in entry
            fields["caps"] = {
                k: self.amount((*here, "caps", k), v, Unit.USD_MICROS if money else Unit.CALLS)
                for k, v in caps.items()
            }
        try:
            return Limit(**fields)
        except PolicyError as exc:
            raise self.translate(exc, i) from None

    def dollars(self, path: KeyPath, value: Any) -> int:
        """``cap_usd``: a whole number, or a decimal string with at most six decimals."""
        if isinstance(value, float):
            raise self.error(
                path,
                value,
                'write dollars as a string, e.g. "25.00": a float cannot hold money exactly',
            )
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise self.error(path, value, 'expected dollars, e.g. "25.00"')
        if isinstance(value, str):
            if value.strip().startswith("-"):
                raise self.error(path, value, "must not be negative")
            if not _DOLLARS.fullmatch(value):
                raise self.error(
                    path,
                    value,
                    'expected dollars as digits with at most six decimals, e.g. "25.00"',
                )
            amount: int | Decimal = Decimal(value)
        else:
            amount = value
        if amount < 0:
            raise self.error(path, value, "must not be negative")
        try:
            return usd(amount)
        except InvalidInputError as exc:
            raise self.error(path, value, exc.problem) from None

    def translate(self, exc: PolicyError, index: int | None) -> PolicyFileError:
        """The file key a constructor error is about: ``Limit('x').cap`` -> ``limits[2].cap``.

        ``index`` is the ``[[limits]]`` entry being built, None for the policy.
        """
        field, value = exc.field, exc.value
        found = re.fullmatch(r"Policy\.limits\[(\d+)\]\.(\w+)", field)
        if found:
            return self.error(("limits", int(found[1]), found[2]), value, exc.problem)
        if index is not None:
            key = re.sub(r"^Limit(\(.*\))?\.", "", field)
            entry = re.fullmatch(r"caps\['(.*)'\]", key)
            if entry:
                return self.error(("limits", index, "caps", entry[1]), value, exc.problem)
            problem = exc.problem
            # A cap_usd was range-checked in dollars (dollars()) before Limit saw micros.
            if key == "cap" and isinstance(value, float | str):
                problem = 'expected a whole number (for money write cap_usd = "25.00")'
            # A nested key (anchors.acme) keeps its own line.
            return self.error(("limits", index, *key.split(".", 1)), value, problem)
        if field.startswith("Policy."):
            return self.error((field.removeprefix("Policy."),), value, exc.problem)
        return self.error((), value, f"{field}: {exc.problem}")


# -- where each key is written -------------------------------------------------


_BARE = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {
    "b": "\b",
    "t": "\t",
    "n": "\n",
    "f": "\f",
    "r": "\r",
    "e": "\x1b",
    '"': '"',
    "\\": "\\",
}


def locate(text: str) -> dict[KeyPath, int]:
    """Map every key path of a TOML document to its 1-based line.

    Tables and array elements map to where they start: ``("limits", 2)`` is
    the line of the third ``[[limits]]`` header (or of its ``{`` in an inline
    array), ``("limits", 2, "window")`` the line of its ``window`` key,
    ``("limits", 2, "scope", 1)`` the line of the second element of its
    ``scope`` array.

    >>> locate('a = 1\\n[[t]]\\nb = [\\n  2,\\n  3]\\n')[("t", 0, "b", 1)]
    5
    """
    return _Scanner(text).run()


class _Scanner:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.out: dict[KeyPath, int] = {}
        # Array-of-tables paths -> how many elements they have so far.
        self.arrays: dict[KeyPath, int] = {}

    @property
    def line(self) -> int:
        return self.text.count("\n", 0, self.pos) + 1

    def peek(self, n: int = 1) -> str:
        return self.text[self.pos : self.pos + n]

    def skip(self, *, newlines: bool) -> None:
        """Skip blanks; with ``newlines``, also line breaks and comments."""
        text = self.text
        while self.pos < len(text):
            ch = text[self.pos]
            if ch in " \t":
                self.pos += 1
            elif ch == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif newlines and ch in "\r\n":
                self.pos += 1
            else:
                break

    def run(self) -> dict[KeyPath, int]:
        table: KeyPath = ()
        while True:
            self.skip(newlines=True)
            if self.pos >= len(self.text):
                return self.out
            if self.peek(2) == "[[":
                table = self.header(array=True)
            elif self.peek() == "[":
                table = self.header(array=False)
            else:
                self.pair(table)

    def header(self, *, array: bool) -> KeyPath:
        line = self.line
        self.pos += 2 if array else 1
        self.skip(newlines=False)
        keys = self.key()
        self.skip(newlines=False)
        self.pos += 2 if array else 1
        path: KeyPath = ()
        for j, key in enumerate(keys):
            path = (*path, key)
            last = j == len(keys) - 1
            if last and array:
                count = self.arrays.get(path, 0)
                self.arrays[path] = count + 1
                self.out.setdefault(path, line)
                path = (*path, count)
            elif path in self.arrays:
                # [a.b] after [[a]] names a table inside a's latest element.
                path = (*path, self.arrays[path] - 1)
        self.out[path] = line
        return path

    def pair(self, table: KeyPath) -> None:
        line = self.line
        keys = self.key()
        path = table
        for key in keys:
            path = (*path, key)
            self.out.setdefault(path, line)
        self.out[path] = line
        self.skip(newlines=False)
        self.pos += 1  # '='
        self.skip(newlines=False)
        self.value(path)

    def key(self) -> list[str]:
        keys = [self.simple_key()]
        while True:
            self.skip(newlines=False)
            if self.peek() != ".":
                return keys
            self.pos += 1
            self.skip(newlines=False)
            keys.append(self.simple_key())

    def simple_key(self) -> str:
        ch = self.peek()
        if ch == '"':
            return self.basic_string()
        if ch == "'":
            return self.literal_string()
        found = _BARE.match(self.text, self.pos)
        if found is None:
            raise ValueError(f"no key at {self.pos}")
        self.pos = found.end()
        return found.group()

    def value(self, path: KeyPath) -> None:
        ch = self.peek()
        if self.peek(3) in ('"""', "'''"):
            self.multiline_string(self.peek(3))
        elif ch == '"':
            self.basic_string()
        elif ch == "'":
            self.literal_string()
        elif ch == "[":
            self.array(path)
        elif ch == "{":
            self.inline_table(path)
        else:
            found = re.compile(r"[^,\]}\r\n#]*").match(self.text, self.pos)
            assert found is not None  # the pattern matches the empty string
            self.pos = found.end()

    def array(self, path: KeyPath) -> None:
        self.pos += 1
        index = 0
        while True:
            self.skip(newlines=True)
            if self.peek() == "]":
                self.pos += 1
                return
            self.out[(*path, index)] = self.line
            self.value((*path, index))
            index += 1
            self.skip(newlines=True)
            if self.peek() == ",":
                self.pos += 1

    def inline_table(self, path: KeyPath) -> None:
        self.pos += 1
        while True:
            self.skip(newlines=True)
            if self.peek() == "}":
                self.pos += 1
                return
            self.pair(path)
            self.skip(newlines=True)
            if self.peek() == ",":
                self.pos += 1

    def basic_string(self) -> str:
        text = self.text
        self.pos += 1
        out: list[str] = []
        while text[self.pos] != '"':
            ch = text[self.pos]
            if ch == "\\":
                code = text[self.pos + 1]
                if code in "uU":
                    width = 4 if code == "u" else 8
                    out.append(chr(int(text[self.pos + 2 : self.pos + 2 + width], 16)))
                    self.pos += 2 + width
                    continue
                out.append(_ESCAPES.get(code, code))
                self.pos += 2
                continue
            out.append(ch)
            self.pos += 1
        self.pos += 1
        return "".join(out)

    def literal_string(self) -> str:
        end = self.text.index("'", self.pos + 1)
        value = self.text[self.pos + 1 : end]
        self.pos = end + 1
        return value

    def multiline_string(self, quote: str) -> None:
        text = self.text
        self.pos += 3
        while True:
            if quote == '"""' and text[self.pos] == "\\":
                self.pos += 2
                continue
            if text.startswith(quote, self.pos):
                self.pos += 3
                # Up to two quotes may close the content right before the delimiter.
                for _ in range(2):
                    if self.peek() == quote[0]:
                        self.pos += 1
                return
            self.pos += 1
