"""Bad policy input fails at load time with an error naming the field and the value."""

from __future__ import annotations

from typing import Any

import pytest

from mcp_budget_governor import (
    FailMode,
    Governor,
    InvalidInputError,
    Limit,
    MemoryBackend,
    OnExceed,
    Policy,
    PolicyError,
    Scope,
    Unit,
    Window,
)


def make(**overrides: Any) -> Limit:
    fields: dict[str, Any] = {"name": "per_user", "cap": 10, "window": Window.DAY}
    fields.update(overrides)
    return Limit(**fields)


@pytest.mark.parametrize(
    ("overrides", "field", "value", "words"),
    [
        ({"cap": -1}, "Limit('per_user').cap", -1, "negative"),
        ({"cap": 1.5}, "Limit('per_user').cap", 1.5, "integer"),
        ({"cap": "10"}, "Limit('per_user').cap", "10", "integer"),
        ({"cap": True}, "Limit('per_user').cap", True, "integer"),
        ({"cap": 2**64}, "Limit('per_user').cap", 2**64, "largest"),
        ({"cap": 2**53}, "Limit('per_user').cap", 2**53, "largest"),
        ({"unit": "dollars"}, "Limit('per_user').unit", "dollars", "unknown Unit"),
        ({"window": "fortnight"}, "Limit('per_user').window", "fortnight", "unknown Window"),
        ({"window": None}, "Limit('per_user').window", None, "unknown Window"),
        ({"fail_mode": "maybe"}, "Limit('per_user').fail_mode", "maybe", "unknown FailMode"),
        ({"on_exceed": "shrug"}, "Limit('per_user').on_exceed", "shrug", "unknown OnExceed"),
        ({"scope": "planet"}, "Limit('per_user').scope", "planet", "not a Scope"),
        ({"scope": 42}, "Limit('per_user').scope", 42, "Scope"),
        ({"scope": (Scope.USER, "x")}, "Limit('per_user').scope", "x", "not a Scope"),
        (
            {"scope": (Scope.USER, Scope.USER)},
            "Limit('per_user').scope",
            (Scope.USER, Scope.USER),
            "twice",
        ),
        ({"status": 200}, "Limit('per_user').status", 200, "400 to 599"),
        ({"status": "429"}, "Limit('per_user').status", "429", "400 to 599"),
        ({"breaker": "yes"}, "Limit('per_user').breaker", "yes", "True or False"),
        ({"alert_at": [50, 0]}, "Limit('per_user').alert_at", 0, "percentages"),
        ({"alert_at": "80"}, "Limit('per_user').alert_at", "80", "percentages"),
        ({"name": "has space"}, "Limit.name", "has space", "characters"),
        ({"name": "a:b"}, "Limit.name", "a:b", "characters"),
        ({"name": ""}, "Limit.name", "", "characters"),
        ({"name": "x" * 65}, "Limit.name", "x" * 65, "characters"),
        ({"name": "_seen"}, "Limit.name", "_seen", "starting with a letter"),
    ],
)
def test_bad_limit_names_field_and_value(
    overrides: dict[str, Any], field: str, value: Any, words: str
) -> None:
    with pytest.raises(PolicyError) as info:
        make(**overrides)
    err = info.value
    assert err.field == field
    assert err.value == value
    assert words in str(err)
    assert field in str(err) and repr(value)[:40] in str(err)


def test_duplicate_names_and_non_limits_are_refused() -> None:
    with pytest.raises(PolicyError, match=r"limits\[1\].name.*duplicate.*'a'"):
        Policy.of(make(name="a"), make(name="a"))
    with pytest.raises(PolicyError, match=r"limits\[0\].*expected a Limit"):
        Policy.of("not a limit")  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match=r"Policy\.timezone.*Mars/Olympus"):
        Policy.of(make(), timezone="Mars/Olympus")
    with pytest.raises(InvalidInputError, match="expected a Policy"):
        Governor([make()], MemoryBackend())  # type: ignore[arg-type]


def test_lookup_of_unknown_limit_names_it() -> None:
    policy = Policy.of(make(name="a"), make(name="b"))
    with pytest.raises(PolicyError, match=r"limit: no such limit \(known: a, b\).*'zzz'"):
        policy["zzz"]
    assert "a" in policy and "zzz" not in policy and len(policy) == 2


def test_string_spellings_are_accepted_and_normalised() -> None:
    limit = make(
        unit="usd_micros",
        window="month",
        fail_mode="CLOSED",
        on_exceed="alert",
        scope=("user", Scope.TOOL),
        alert_at=[80, 50, 80],
    )
    assert limit.unit is Unit.USD_MICROS
    assert limit.window is Window.MONTH
    assert limit.fail_mode is FailMode.CLOSED
    assert limit.on_exceed is OnExceed.ALERT
    assert limit.scope == (Scope.USER, Scope.TOOL)
    assert limit.alert_at == (50, 80)
    assert make(scope=(Scope.TOOL, Scope.USER)).scope == (Scope.USER, Scope.TOOL)


def test_refusal_status_defaults() -> None:
    assert make().refusal_status == 429
    assert make(unit=Unit.TOKENS).refusal_status == 429
    assert make(unit=Unit.USD_MICROS).refusal_status == 402
    assert make(unit=Unit.USD_MICROS, breaker=True).refusal_status == 503
    assert make(breaker=True, status=507).refusal_status == 507
    assert make(window=Window.SESSION).scope == (Scope.SESSION,)
    assert make(scope=Scope.TENANT, window=Window.SESSION).scope_label == "tenant+session"
    assert make().scope_label == "global"


def test_context_rejects_non_strings() -> None:
    from mcp_budget_governor import Context

    with pytest.raises(InvalidInputError, match=r"Context.user.*42"):
        Context(user=42)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match=r"Context.tool.*lone surrogate"):
        Context(tool="bad\udcff")
    assert Context(user="漢字 🙂").user == "漢字 🙂"
