"""Policy files: every Limit and Policy option from TOML; a bad file names file:line, key, value."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_budget_governor import (
    FailMode,
    InvalidInputError,
    Limit,
    OnExceed,
    Plan,
    Policy,
    PolicyError,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.cli import main as mcpbg
from mcp_budget_governor.policy import Anonymous
from mcp_budget_governor.policy_file import (
    LIMIT_KEYS,
    PolicyFileError,
    load_file,
    load_policy,
    loads,
    locate,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "policy.toml"

#: The example file, written in Python: the file must mean exactly this.
EXAMPLE_POLICY = Policy.of(
    Limit("per_user_calls", cap=2_000, window=Window.DAY, scope=Scope.USER, alert_at=(80, 100)),
    Limit("burst", cap=30, window=Window.MINUTE, scope=Scope.USER),
    Limit("search_per_user", cap=200, window=Window.HOUR, scope=(Scope.USER, Scope.TOOL)),
    Limit(
        "tenant_tokens",
        cap=50_000_000,
        unit=Unit.TOKENS,
        window=Window.MONTH,
        scope=Scope.TENANT,
        alert_at=(50, 80, 100),
    ),
    Limit(
        "user_spend",
        cap=usd(5),
        unit=Unit.USD_MICROS,
        window=Window.DAY,
        scope=Scope.USER,
        alert_at=(80,),
    ),
    Limit(
        "tenant_spend",
        cap=usd(25),
        unit=Unit.USD_MICROS,
        window=Window.DAY,
        scope=Scope.TENANT,
        caps={"acme": usd(100)},
    ),
    Limit(
        "global_spend",
        cap=usd(25),
        unit=Unit.USD_MICROS,
        window=Window.DAY,
        breaker=True,
        gated=False,
        fail_mode=FailMode.CLOSED,
        alert_at=(50, 80, 100),
    ),
    Limit(
        "tenant_calls_trial",
        cap=100_000,
        window=Window.DAY,
        scope=Scope.TENANT,
        on_exceed=OnExceed.ALERT,
    ),
    plans=[Plan("pro", caps={"tenant_spend": usd(250), "burst": 90})],
    assignments={"beta": "pro"},
    timezone="Europe/Paris",
    anonymous=Anonymous.REFUSE,
)


def test_example_policy_means_what_it_says() -> None:
    policy = Policy.from_file(EXAMPLE)
    assert policy == EXAMPLE_POLICY
    assert policy.limits == EXAMPLE_POLICY.limits
    assert str(policy.tz) == "Europe/Paris"


def test_every_limit_field_can_be_written_in_a_file() -> None:
    """A new Limit field is a file key at once; the file sets each to a non-default value."""
    assert set(LIMIT_KEYS) == {f.name for f in dataclasses.fields(Limit)} | {"cap_usd"}
    text = """
        anonymous = "shared"
        timezone = "America/New_York"
        [[limits]]
        name = "everything"
        cap = 7
        window = "month"
        anchor_day = 31
        anchors = { "tool=t,tenant=acme" = 15 }
        scope = ["tool", "tenant"]
        unit = "tokens"
        breaker = true
        gated = false
        fail_mode = "closed"
        local_fallback = false
        status = 418
        on_exceed = "alert"
        alert_at = [90, 10, 50]
        caps = { "tenant=acme,tool=search" = 9 }
        tools = ["search", "brave_*"]
    """
    policy = loads(textwrap.dedent(text))
    expected = Limit(
        "everything",
        cap=7,
        window=Window.MONTH,
        anchor_day=31,
        anchors={"tenant=acme,tool=t": 15},
        scope=(Scope.TENANT, Scope.TOOL),
        unit=Unit.TOKENS,
        breaker=True,
        gated=False,
        fail_mode=FailMode.CLOSED,
        local_fallback=False,
        status=418,
        on_exceed=OnExceed.ALERT,
        alert_at=(10, 50, 90),
        caps={"tenant=acme,tool=search": 9},
        tools=("search", "brave_*"),
    )
    assert policy.limits == (expected,)
    defaults = Limit("x", cap=1, window=Window.DAY)
    for f in dataclasses.fields(Limit):
        if f.name not in ("name", "cap"):
            assert getattr(expected, f.name) != getattr(defaults, f.name), f.name
    assert policy.anonymous is Anonymous.SHARED
    assert policy.timezone == "America/New_York"


@pytest.mark.parametrize(
    ("written", "micros"),
    [('"25.00"', 25_000_000), ('"25"', 25_000_000), ("25", 25_000_000), ('"0.000001"', 1),
     ('"0"', 0), ("1_000", 1_000_000_000), ('"9007199254.740991"', 2**53 - 1)],
)  # fmt: skip
def test_money_caps_are_exact_dollars(written: str, micros: int) -> None:
    policy = loads(f'[[limits]]\nname = "s"\ncap_usd = {written}\nwindow = "day"\n')
    assert policy["s"].cap == micros
    assert policy["s"].unit is Unit.USD_MICROS


def test_scope_forms() -> None:
    text = """
        limits = [
          { name = "g1", cap = 1, window = "day" },
          { name = "g2", cap = 1, window = "day", scope = "global" },
          { name = "u", cap = 1, window = "day", scope = "user" },
          { name = "ut", cap = 1, window = "day", scope = ["tool", "user"] },
          { name = "s", cap = 1, window = "session", scope = "user" },
        ]
    """
    policy = loads(textwrap.dedent(text))
    assert [lim.dimensions for lim in policy] == [
        (),
        (),
        (Scope.USER,),
        (Scope.USER, Scope.TOOL),
        (Scope.USER, Scope.SESSION),
    ]


def test_an_empty_scope_list_is_refused_naming_the_field() -> None:
    """``scope = []`` once became a global limit without a word: a limit meant per
    tenant, its dimensions forgotten, would have capped everyone together."""
    text = '[[limits]]\nname = "t"\ncap = 1\nwindow = "day"\nscope = []\n'
    with pytest.raises(PolicyError, match=r"limits\[0\]\.scope.*empty list") as err:
        loads(text)
    assert "\n" not in str(err.value).strip()


# -- the locator ---------------------------------------------------------------

TRICKY = '''\
# a comment with [[limits]] and name = "fake" in it
timezone = "UTC"   # trailing comment
description = """
[[limits]]
name = "not a table: inside a multi-line string"
window = 'x' \\""" still inside
"""
literal = \'\'\'
cap = 1 ''still'' inside\'\'\'

[[limits]]
name = "a#b"
"cap" = 1
window = 'c:\\path'
scope = [
  "user",   # the first
  # a comment line in the array
  "tool",
]
alert_at = [ 10,
 20 ]

[limits.meta]
note = "a table inside the first element"

[[limits]]
  name = "second"
  meta.deep.key = 1
  inline = { a = 1, b = [ 1,
     2 ], c = { d = "}" } }

[other]
list = [ { x = 1 },
         { x = 2, y = "]" } ]
"escaped \\" key" = 1
'''


def test_locator_finds_lines_in_tricky_layouts() -> None:
    lines = locate(TRICKY)
    expected: dict[tuple[Any, ...], int] = {
        ("timezone",): 2,
        ("description",): 3,
        ("literal",): 8,
        ("limits", 0): 11,
        ("limits", 0, "name"): 12,
        ("limits", 0, "cap"): 13,
        ("limits", 0, "window"): 14,
        ("limits", 0, "scope"): 15,
        ("limits", 0, "scope", 0): 16,
        ("limits", 0, "scope", 1): 18,
        ("limits", 0, "alert_at", 0): 20,
        ("limits", 0, "alert_at", 1): 21,
        ("limits", 0, "meta"): 23,
        ("limits", 0, "meta", "note"): 24,
        ("limits", 1): 26,
        ("limits", 1, "name"): 27,
        ("limits", 1, "meta", "deep", "key"): 28,
        ("limits", 1, "inline", "b", 1): 30,
        ("limits", 1, "inline", "c", "d"): 30,
        ("other", "list", 0, "x"): 33,
        ("other", "list", 1, "y"): 34,
        ("other", 'escaped " key'): 35,
    }
    assert {k: lines.get(k) for k in expected} == expected
    assert ("limits", 2) not in lines  # the fake headers in comments and strings are no tables


def test_locator_handles_crlf_and_inline_arrays_of_tables() -> None:
    text = (
        'limits = [\r\n  { name = "a", cap = 1, window = "day" },\r\n\r\n'
        '  { name = "b",\r\n    cap = 2, window = "fortnight" },\r\n]\r\n'
    )
    lines = locate(text)
    assert lines[("limits", 0, "window")] == 2
    assert lines[("limits", 1)] == 4
    assert lines[("limits", 1, "window")] == 5
    # TOML 1.0 keeps an inline table on one line: tomllib refuses, at the right line.
    with pytest.raises(PolicyFileError, match=r"^crlf\.toml:4: TOML: "):
        loads(text, source="crlf.toml")
    text = text.replace('"b",\r\n    cap', '"b", cap')
    with pytest.raises(PolicyFileError) as exc:
        loads(text, source="crlf.toml")
    assert str(exc.value).startswith("crlf.toml:4: limits[1].window: unknown Window")


# -- malformed files -----------------------------------------------------------

GOOD = """\
timezone = "UTC"

[[limits]]
name = "per_user"
cap = 100
window = "day"
scope = "user"

[[limits]]
name = "spend"
cap_usd = "25.00"
window = "day"
"""


def bad(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new, 1)


def extra(line: str) -> str:
    """GOOD with ``line`` added to the first limit, at line 8."""
    return bad('scope = "user"', f'scope = "user"\n{line}')


def dollars(written: str) -> str:
    """GOOD with the second limit's ``cap_usd`` (line 11) written as ``written``."""
    return bad('cap_usd = "25.00"', f"cap_usd = {written}")


WINDOW = 'window = "day"\nscope'


# (document, line, field, value, words in the problem)
MALFORMED: list[tuple[str, int | None, str, Any, str]] = [
    (bad(WINDOW, "window = day\nscope"), 6, "TOML", "window = day", "Invalid value"),
    (bad("cap = 100", "cap = 100\ncap = 5"), 6, "TOML", "cap = 5", "column"),
    (GOOD + "[[limits]\n", 13, "TOML", "[[limits]", "column"),
    (bad("timezone", "limts = []\ntimezone"), 1, "limts", "limts", "did you mean 'limits'"),
    (bad("scope =", "widow = 1\nscope ="), 7, "limits[0].widow", "widow", "did you mean 'window'"),
    (
        bad(WINDOW, 'window = "fortnight"\nscope'),
        6,
        "limits[0].window",
        "fortnight",
        "unknown Window",
    ),
    (extra('unit = "dollars"'), 8, "limits[0].unit", "dollars", "unknown Unit"),
    (bad('scope = "user"', 'scope = "planet"'), 7, "limits[0].scope", "planet", "not a Scope"),
    (
        bad('scope = "user"', 'scope = ["user", "user"]'),
        7,
        "limits[0].scope",
        ["user", "user"],
        "twice",
    ),
    (bad('scope = "user"', 'scope = ["user", 3]'), 7, "limits[0].scope", 3, "not a Scope"),
    (bad('scope = "user"', "scope = 42"), 7, "limits[0].scope", 42, "Scope"),
    (bad("cap = 100", "cap = -5"), 5, "limits[0].cap", -5, "negative"),
    (bad("cap = 100", "cap = 9007199254740992"), 5, "limits[0].cap", 2**53, "largest"),
    (bad("cap = 100", "cap = 99999999999999999999"), 5, "limits[0].cap", 10**20 - 1, "largest"),
    (bad("cap = 100", "cap = 1.5"), 5, "limits[0].cap", 1.5, "cap_usd"),
    (bad("cap = 100", 'cap = "100"'), 5, "limits[0].cap", "100", "whole number"),
    (bad("cap = 100", "cap = inf"), 5, "limits[0].cap", float("inf"), "whole number"),
    (bad("cap = 100", "cap = true"), 5, "limits[0].cap", True, "integer"),
    (bad("cap = 100\n", ""), 3, "limits[0]", None, "missing required key 'cap'"),
    (bad('name = "per_user"\n', ""), 3, "limits[0]", None, "missing required key 'name'"),
    (dollars("25.5"), 11, "limits[1].cap_usd", 25.5, "float"),
    (dollars('"-1"'), 11, "limits[1].cap_usd", "-1", "negative"),
    (dollars("-1"), 11, "limits[1].cap_usd", -1, "negative"),
    (dollars('"$25"'), 11, "limits[1].cap_usd", "$25", "six decimals"),
    (dollars('"0.0000001"'), 11, "limits[1].cap_usd", "0.0000001", "six decimals"),
    (dollars('"1e3"'), 11, "limits[1].cap_usd", "1e3", "six decimals"),
    (dollars('"9007199254.740992"'), 11, "limits[1].cap_usd", "9007199254.740992", "largest"),
    (dollars('"25.00"\ncap = 5'), 11, "limits[1].cap_usd", "25.00", "not both"),
    (
        bad('cap_usd = "25.00"', 'cap_usd = "25.00"\nunit = "calls"'),
        12,
        "limits[1].unit",
        "calls",
        "usd_micros",
    ),
    (bad('name = "spend"', 'name = "per_user"'), 10, "limits[1].name", "per_user", "duplicate"),
    (
        bad('name = "spend"', 'name = "_hidden"'),
        10,
        "limits[1].name",
        "_hidden",
        "starting with a letter",
    ),
    (bad('name = "spend"', 'name = "has space"'), 10, "limits[1].name", "has space", "characters"),
    (
        bad('timezone = "UTC"', 'timezone = "Mars/Olympus"'),
        1,
        "timezone",
        "Mars/Olympus",
        "unknown IANA",
    ),
    (bad('timezone = "UTC"', "timezone = 2"), 1, "timezone", 2, "IANA"),
    (extra("alert_at = [80, 0]"), 8, "limits[0].alert_at", 0, "percentages"),
    (extra("alert_at = [80, 5000]"), 8, "limits[0].alert_at", 5000, "percentages"),
    (extra("alert_at = [80.5]"), 8, "limits[0].alert_at", 80.5, "percentages"),
    (extra('alert_at = "80"'), 8, "limits[0].alert_at", "80", "percentages"),
    (extra('fail_mode = "maybe"'), 8, "limits[0].fail_mode", "maybe", "FailMode"),
    (extra('on_exceed = "shrug"'), 8, "limits[0].on_exceed", "shrug", "OnExceed"),
    (extra('breaker = "yes"'), 8, "limits[0].breaker", "yes", "True or False"),
    (extra("status = 200"), 8, "limits[0].status", 200, "400 to 599"),
    (bad('timezone = "UTC"', 'anonymous = "maybe"'), 1, "anonymous", "maybe", "Anonymous"),
    ('timezone = "UTC"\n', None, "limits", None, "missing"),  # nowhere to point at
    ("limits = 5\n", 1, "limits", 5, "array of tables"),
    (dollars("true"), 11, "limits[1].cap_usd", True, "expected dollars"),
    (dollars("[25]"), 11, "limits[1].cap_usd", [25], "expected dollars"),
    (GOOD + "x = ", 13, "TOML", "", "end of the file"),
    ("limits = [1]\n", 1, "limits[0]", 1, "table"),
    (
        'limits = [\n  {name = "a", cap = 1, window = "day"},\n'
        '  {name = "b", cap = 1, window = "year"},\n]\n',
        3,
        "limits[1].window",
        "year",
        "unknown Window",
    ),
]


@pytest.mark.parametrize(("text", "line", "field", "value", "words"), MALFORMED)
def test_malformed_file_names_line_field_and_value(
    tmp_path: Path, text: str, line: int | None, field: str, value: Any, words: str
) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    with pytest.raises(PolicyFileError) as exc:
        Policy.from_file(path)
    err = exc.value
    assert isinstance(err, PolicyError)  # callers catching PolicyError still do
    assert (err.file, err.line, err.field) == (str(path), line, field)
    if field != "TOML" or value:
        assert err.value == value
    assert words in err.problem
    message = str(err)
    where = path if line is None else f"{path}:{line}"
    assert message.startswith(f"{where}: {field}: ")
    assert "\n" not in message


def test_bad_window_message_reads_as_the_issue_asks(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(bad(WINDOW, 'window = "fortnight"\nscope'))
    with pytest.raises(PolicyFileError) as exc:
        load_file(path)
    assert str(exc.value) == (
        f"{path}:6: limits[0].window: unknown Window "
        "(one of MINUTE, HOUR, DAY, WEEK, MONTH, SESSION) (got 'fortnight')"
    )


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="no such file"):
        load_file(tmp_path / "missing.toml")
    with pytest.raises(InvalidInputError, match=r"\.toml"):
        load_file(tmp_path / "policy.json")
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'timezone = "UTC"\n# caf\xe9\n')
    with pytest.raises(PolicyFileError, match=r"latin\.toml:2: file: not UTF-8"):
        load_file(latin)


# -- load_policy: the one way to name a policy ----------------------------------

MODULE_POLICY = Policy.of(Limit("m", cap=1, window=Window.DAY))
NOT_A_POLICY = 42


def test_load_policy_accepts_a_file_or_a_module_attribute(tmp_path: Path) -> None:
    assert load_policy(str(EXAMPLE)) == EXAMPLE_POLICY
    assert load_policy(EXAMPLE) == EXAMPLE_POLICY
    assert load_policy("test_policy_file:MODULE_POLICY") is MODULE_POLICY
    for spec, words in [
        ("", "expected"),
        ("no_colon", "expected"),
        ("test_policy_file:", "expected"),
        ("no_such_module_x:P", "cannot load"),
        ("test_policy_file:MISSING", "cannot load"),
        ("test_policy_file:NOT_A_POLICY", "not a Policy but int"),
        (str(tmp_path / "absent.toml"), "no such file"),
    ]:
        with pytest.raises(InvalidInputError, match=words):
            load_policy(spec)


# -- through the command line: exit code 2, one line naming file:line ------------


def test_mcpbg_budgets_rejects_a_malformed_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "policy.toml"
    for text, line, field, _, words in MALFORMED[:8]:
        path.write_text(text)
        code = mcpbg(["budgets", "--policy", str(path), "--redis-url", "redis://127.0.0.1:1/0"])
        err = capsys.readouterr().err
        assert code == 2
        assert err.startswith(f"mcpbg budgets: {path}:{line}: {field}: "), err
        assert words in err
        assert err.count("\n") == 1


def test_mcpbg_budgets_malformed_policy_exit_code_in_a_real_process(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(bad("cap = 100", "cap = -5"))
    proc = subprocess.run(
        [sys.executable, "-m", "mcp_budget_governor.cli", "budgets", "--policy", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "MCPBG_REDIS_URL": "redis://127.0.0.1:1/0"},
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == (
        f"mcpbg budgets: {path}:5: limits[0].cap: must be non-negative (got -5)\n"
    )


# -- the locator on generated layouts ----------------------------------------------

DECOYS = (
    "# [[limits]] name = 'decoy'",
    '   # window = "day"',
    "",
    'decoy_{n} = """\n[[limits]]\nname = "x" # not a key\n"""',
    "decoy_{n} = '''\n[other]\n'''",
    'decoy_{n} = "a # b [c] {{d}} = e"',
)


@st.composite
def documents(draw: st.DrawFn) -> tuple[str, dict[tuple[Any, ...], int]]:
    """A TOML text in one of several layouts, and the line each key was written on."""
    lines: list[str] = []
    expected: dict[tuple[Any, ...], int] = {}
    decoys = 0

    def decoy() -> None:
        nonlocal decoys
        for _ in range(draw(st.integers(0, 2))):
            text = draw(st.sampled_from(DECOYS)).format(n=decoys)
            decoys += 1
            lines.extend(text.split("\n"))

    def here() -> int:
        return len(lines) + 1

    n = draw(st.integers(1, 4))
    inline = draw(st.booleans())
    decoy()
    if inline:
        lines.append("limits = [  # inline tables")
        for i in range(n):
            expected[("limits", i)] = expected[("limits", i, "window")] = here()
            lines.append(f'  {{ name = "l{i}", cap = {i}, window = "day" }},')
            if draw(st.booleans()):
                lines.append("  # between elements")
        lines.append("]")
        return "\n".join(lines) + "\n", expected
    for i in range(n):
        decoy()
        expected[("limits", i)] = here()
        lines.append(draw(st.sampled_from(["[[limits]]", "[[ limits ]]", "[[limits]]  # c"])))
        for key, value in (("name", f'"l{i}"'), ("cap", "1_000"), ("window", "'day'")):
            if draw(st.booleans()):
                lines.append("")
            expected[("limits", i, key)] = here()
            lines.append(f"{key} = {value}")
        if draw(st.booleans()):
            expected[("limits", i, "scope")] = here()
            expected[("limits", i, "scope", 1)] = here() + 2
            lines.extend(["scope = [", '  "user",  # one', '  "tool",', "]"])
        decoy()
    return "\n".join(lines) + "\n", expected


@settings(max_examples=200, deadline=None)
@given(documents())
def test_locator_on_generated_layouts(doc: tuple[str, dict[tuple[Any, ...], int]]) -> None:
    text, expected = doc
    tomllib.loads(text)  # the generator writes valid TOML
    lines = locate(text)
    assert {k: lines.get(k) for k in expected} == expected


def test_a_deeply_nested_file_is_a_policy_error_not_a_recursion_error() -> None:
    for text in ("x = " + "[" * 50_000 + "]" * 50_000, "x = " + "{a=" * 5_000 + "1" + "}" * 5_000):
        with pytest.raises(PolicyFileError, match=r"^deep\.toml: file: nested too deeply"):
            loads(text, source="deep.toml")
