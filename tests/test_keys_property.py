"""DESIGN invariant 7: distinct contexts never share a counter key.

Scope values come from callers and may hold anything that is text: separators,
braces, newlines, NUL, combining marks, emoji, 10 kB. Lone surrogates are not
text (they cannot be encoded as UTF-8, so neither a key nor the ledger could
carry them): ``Context`` refuses them, and the strategies here leave them out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import string
from urllib.parse import unquote_to_bytes

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcp_budget_governor import (
    Context,
    Governor,
    InvalidInputError,
    Limit,
    Policy,
    RedisBackend,
    Scope,
    Window,
)
from mcp_budget_governor.keys import MAX_VALUE_CHARS, PREFIX, escape
from mcp_budget_governor.planning import slot
from mcp_budget_governor.windows import UTC, bucket_for

NOW = 1_764_374_400.0 + 3_723.5  # 2025-11-29T01:02:03.5Z, a fixed instant
SAFE = set(string.ascii_letters + string.digits + "_.-")
ALL_SCOPES = [
    tuple(dims) for n in range(len(Scope) + 1) for dims in itertools.combinations(Scope, n)
]
# Pieces that break naive joining (separators, escape look-alikes, the hashed form's '#').
# fmt: off
ATOMS = (
    "a", "b", ":", ",", "=", "%", "%3A", "%25", "#", "{", "}", "\n", "\r\n", " ", "\t", "\x00",
    "user=", "tool=", "global", "é", "e\u0301", "😀", "\U0010fffd", "mcpbg:v1:", "~", "/",
)
# fmt: on

any_text = st.text(st.characters(codec="utf-8"), max_size=40)  # any text but surrogates
atom_text = st.lists(st.sampled_from(ATOMS), max_size=8).map("".join)
# Around the hashing threshold and up to 10 kB: one repeated character plus a tail.
long_text = st.builds(
    lambda ch, n, tail: ch * n + tail,
    st.sampled_from(("a", ":", "é", "😀", "\x00", "#")),
    st.one_of(st.integers(0, 10_000), st.integers(60, 200)),
    atom_text,
)
hostile = st.one_of(any_text, atom_text, long_text, st.just(""))

SETTINGS = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def percent_length(value: str) -> int:
    """Length of the plain percent-encoding, computed independently of keys.py."""
    raw = value.encode("utf-8")
    return sum(1 if chr(b) in SAFE else 3 for b in raw)


def check_escaped(value: str, escaped: str) -> None:
    assert escaped.isascii()
    assert 1 <= len(escaped) <= MAX_VALUE_CHARS or value == escaped == ""
    if escaped.startswith("#"):  # the hashed long form
        assert percent_length(value) > MAX_VALUE_CHARS
        assert len(escaped) == 65 and set(escaped[1:]) <= set("0123456789abcdef")
    else:  # the percent form: decoding it gives the value back, so it is injective
        assert percent_length(value) <= MAX_VALUE_CHARS
        assert set(escaped) <= SAFE | {"%"}
        assert unquote_to_bytes(escaped).decode("utf-8") == value


def related(value: str) -> st.SearchStrategy[str]:
    """Values close to ``value``: the ones an encoding would most likely confuse with it."""
    return st.one_of(
        st.just(value),
        st.just(escape(value)),
        st.just(value + "\x00"),
        st.sampled_from(ATOMS).map(lambda a: a + value),
        st.sampled_from(ATOMS).map(lambda a: value + a),
        st.just(value[:-1]),
        st.just(value.upper()),
        hostile,
    )


@SETTINGS
@given(st.data(), hostile)
def test_escape_is_injective_ascii_and_bounded(data: st.DataObject, a: str) -> None:
    b = data.draw(related(a))
    ea, eb = escape(a), escape(b)
    check_escaped(a, ea)
    check_escaped(b, eb)
    assert (ea == eb) == (a == b)


@pytest.mark.parametrize(
    ("value", "hashed"),
    [
        ("a" * MAX_VALUE_CHARS, False),
        ("a" * (MAX_VALUE_CHARS + 1), True),
        (":" * (MAX_VALUE_CHARS // 3), False),
        (":" * (MAX_VALUE_CHARS // 3) + "a", True),
        ("😀" * (MAX_VALUE_CHARS // 12), False),
        ("😀" * (MAX_VALUE_CHARS // 12) + "a", True),
    ],
)
def test_hashing_threshold(value: str, hashed: bool) -> None:
    escaped = escape(value)
    assert escaped.startswith("#") is hashed
    check_escaped(value, escaped)
    if hashed:
        # '#' itself is escaped, so no caller value can spell a hashed form.
        assert escape(escaped) == "%23" + escaped[1:] != escaped
        assert escaped == "#" + hashlib.sha256(value.encode()).hexdigest()


@pytest.mark.parametrize("value", ["\ud800", "a\udfff", "\udcff" * 300])
def test_lone_surrogates_are_refused_at_the_context(value: str) -> None:
    for field in ("user", "tenant", "tool", "session", "agent"):
        with pytest.raises(InvalidInputError) as info:
            Context(**{field: value})
        assert info.value.field == f"Context.{field}"


def contexts_over(values: st.SearchStrategy[str]) -> st.SearchStrategy[Context]:
    return st.builds(
        Context, user=values, tenant=values, tool=values, session=values, agent=values, call=values
    )


def key_of(name: str, dims: tuple[Scope, ...], window: Window, ctx: Context) -> str:
    s = slot(Limit(name, cap=1, window=window, scope=dims), ctx, NOW, UTC, 1, enforce=True)
    assert s is not None
    return s.key


def identity(name: str, dims: tuple[Scope, ...], window: Window, ctx: Context) -> tuple:
    """What a key must identify: the limit, its scope, the scoped values and the bucket."""
    dims = Limit(name, cap=1, window=window, scope=dims).dimensions
    values = tuple(getattr(ctx, d.value) for d in dims)
    return name, dims, values, bucket_for(window, NOW, UTC).label


def check_key(key: str, name: str, dims: tuple[Scope, ...], window: Window, ctx: Context) -> None:
    assert key.isascii()
    assert not any(c.isspace() or c in "{}\x00" or not c.isprintable() for c in key)
    prefix, version, limit, scope, bucket = key.split(":")  # exactly five fields
    assert (f"{prefix}:{version}", limit) == (PREFIX, name)
    assert bucket == bucket_for(window, NOW, UTC).label
    real_dims = Limit(name, cap=1, window=window, scope=dims).dimensions
    if not real_dims:
        assert scope == "global"
    else:
        parts = [p.split("=") for p in scope.split(",")]
        assert [d for d, _ in parts] == [d.value for d in real_dims]
        for (_, escaped), d in zip(parts, real_dims, strict=True):
            check_escaped(getattr(ctx, d.value), escaped)
    # Every escaped value is bounded, so a key is too: under 600 characters with
    # up to two scoped dimensions, about 1.1 kB with all five (a 64-character name).
    bound = (
        len(PREFIX)
        + len(name)
        + len(bucket)
        + 3
        + len(scope.split(",")) * (len("session=") + MAX_VALUE_CHARS + 1)
    )
    assert len(key) <= bound
    if len(real_dims) <= 2:
        assert len(key) <= 600


names = st.sampled_from(("a", "b", "a.b", "user", "x" * 64))
dim_sets = st.sampled_from(ALL_SCOPES)
windows = st.sampled_from(Window)


@st.composite
def context_pairs(draw: st.DrawFn) -> tuple[Context, Context]:
    """A context and a second one equal to it, or differing in chosen, adversarial ways."""
    a = draw(contexts_over(hostile))
    fields = ["user", "tenant", "tool", "session", "agent", "call"]
    b = dict(zip(fields, (getattr(a, f) for f in fields), strict=True))
    how = draw(st.sampled_from(("same", "change", "move_separator", "swap", "all")))
    if how == "change":
        for f in draw(st.lists(st.sampled_from(fields), min_size=1, unique=True)):
            b[f] = draw(related(b[f]))
    elif how == "move_separator":
        # user="a:b", tool="c" against user="a", tool="b:c" (and every other pair).
        f, g = draw(st.lists(st.sampled_from(fields), min_size=2, max_size=2, unique=True))
        sep = draw(st.sampled_from((":", ",", "=", ",user=", "%2C", "")))
        joined = b[f] + sep + b[g]
        cut = draw(st.integers(0, len(joined)))
        b[f], b[g] = joined[:cut], joined[cut:]
    elif how == "swap":
        f, g = draw(st.lists(st.sampled_from(fields), min_size=2, max_size=2, unique=True))
        b[f], b[g] = b[g], b[f]
    elif how == "all":
        return a, draw(contexts_over(hostile))
    return a, Context(**b)


@SETTINGS
@given(dims=dim_sets, window=windows, name=names, pair=context_pairs())
def test_distinct_contexts_never_share_a_key(
    dims: tuple[Scope, ...], window: Window, name: str, pair: tuple[Context, Context]
) -> None:
    a, b = pair
    key_a, key_b = key_of(name, dims, window, a), key_of(name, dims, window, b)
    check_key(key_a, name, dims, window, a)
    check_key(key_b, name, dims, window, b)
    assert (key_a == key_b) == (identity(name, dims, window, a) == identity(name, dims, window, b))


@SETTINGS
@given(
    first=st.tuples(names, dim_sets, windows),
    second=st.tuples(names, dim_sets, windows),
    ctx=contexts_over(st.one_of(atom_text, st.sampled_from(("a", "b", "user=a", "")))),
)
def test_distinct_limits_scopes_and_buckets_never_share_a_key(
    first: tuple[str, tuple[Scope, ...], Window],
    second: tuple[str, tuple[Scope, ...], Window],
    ctx: Context,
) -> None:
    key_a, key_b = key_of(*first, ctx), key_of(*second, ctx)
    assert (key_a == key_b) == (identity(*first, ctx) == identity(*second, ctx))


@pytest.mark.parametrize("dims", ALL_SCOPES, ids=lambda d: "+".join(s.value for s in d) or "global")
def test_every_scope_combination_separates_naive_collisions(dims: tuple[Scope, ...]) -> None:
    """For each scope: contexts that collide under naive joining get distinct keys,
    and a change outside the scope keeps the key."""
    base = ["a:b", "c", "a", "b:c", "x,tool=y", "x"]
    variants = {
        Context(*(base[(i + j) % len(base)] for j in range(5))) for i in range(len(base))
    } | {
        Context(user="a:b", tenant="t", tool="c", session="s", agent="g"),
        Context(user="a", tenant="t", tool="b:c", session="s", agent="g"),
        Context(user="a", tenant="t,user=a", tool="c", session="s", agent="g"),
        Context(user="", tenant="t", tool="c", session="s", agent="g"),
        Context(user="%3A", tenant="t", tool="c", session="s", agent="g"),
        Context(user=":", tenant="t", tool="c", session="s", agent="g"),
    }
    # The loop guard's dimension (Scope.CALL) takes the user's value: as hostile, and a
    # collision candidate with every other field.
    variants = {dataclasses.replace(c, call=c.user) for c in variants}
    by_identity: dict[tuple, str] = {}
    for ctx in variants:
        key = key_of("l", dims, Window.DAY, ctx)
        check_key(key, "l", dims, Window.DAY, ctx)
        ident = identity("l", dims, Window.DAY, ctx)
        assert by_identity.setdefault(ident, key) == key
    assert len(set(by_identity.values())) == len(by_identity)


# fmt: off
HOSTILE_IDS = [
    "a:b", "a", "b:c", "c", "", " ", "\n", "\r\n", "\t", "{x}", "{", "}", "x}{y", "%3A", ":",
    "%", "#", "=", ",", "user=a", "a,user=b", "é", "e\u0301", "😀", "\x00",
    "mcpbg:v1:per_user:user=a:20251129", "a" * 10_000, "a" * 9_999 + "b", "é" * 5_000,
    "😀" * 2_500, "\n" * 10_000, "{" * 10_000, "#" + "0" * 64,
    "#" + hashlib.sha256(b"a").hexdigest(),
]
# fmt: on


@pytest.mark.parametrize(
    ("dims", "field_pairs"),
    [
        ((Scope.USER,), None),
        ((Scope.USER, Scope.TOOL), [("user", "tool")]),
        ((Scope.TENANT, Scope.USER, Scope.TOOL), [("tenant", "user"), ("user", "tool")]),
    ],
    ids=["user", "user+tool", "tenant+user+tool"],
)
def test_hostile_identifiers_each_get_their_own_redis_counter(
    redis_url: str, dims: tuple[Scope, ...], field_pairs: list[tuple[str, str]] | None
) -> None:
    cap = 2
    contexts: list[Context] = []
    fields = [d.value for d in dims]
    for v in HOSTILE_IDS:  # each hostile value in each scoped field, the others plain
        for f in fields:
            contexts.append(Context(**{g: (v if g == f else "p") for g in fields}))
    for f, g in field_pairs or []:  # pairs that collide when joined naively
        for left, right in (("a:b", "c"), ("a", "b:c"), ("a,user=b", "c"), ("a", "b,tool=c")):
            others = {h: "p" for h in fields if h not in (f, g)}
            contexts.append(Context(**others, **{f: left, g: right}))
    contexts = list(dict.fromkeys(contexts))  # distinct in their scoped fields
    policy = Policy.of(Limit("hostile", cap=cap, window=Window.DAY, scope=dims))

    async def run() -> list[list[bool]]:
        async with Governor(policy, RedisBackend.from_url(redis_url, timeout=2.0)) as gov:
            # Round robin, so that two contexts sharing a key would starve one another.
            rounds = [[(await gov.check(ctx)).admitted for ctx in contexts] for _ in range(cap + 1)]
            usage = [await gov.usage("hostile", ctx) for ctx in contexts]
        assert usage == [cap] * len(contexts)
        return rounds

    rounds = asyncio.run(run())
    assert rounds == [[True] * len(contexts)] * cap + [[False] * len(contexts)]
    client = redis.Redis.from_url(redis_url)
    try:
        stored = {k.decode("ascii") for k in client.scan_iter(f"{PREFIX}:hostile:*")}
    finally:
        client.close()
    expected = {key_of("hostile", dims, Window.DAY, ctx).rsplit(":", 1)[0] for ctx in contexts}
    assert {k.rsplit(":", 1)[0] for k in stored} == expected
    assert len(stored) == len(contexts)


def test_internal_keys_are_never_counters() -> None:
    """The governor's own keys (``mcpbg:v1:_*``) parse as no counter, so no listing,
    sync or reconcile of counters ever takes one for a budget."""
    from mcp_budget_governor import keys
    from mcp_budget_governor.caps import PLANS_KEY, caps_key

    internal = [
        keys.WATERMARK_KEY,
        keys.EPOCH_KEY,
        keys.APPROVAL_KEY,
        f"{keys.SEEN_PREFIX}:20261129",
        keys.op_key("op_1"),
        keys.lease_key("parallel", "user=u_42"),
        keys.queue_key(keys.lease_key("parallel", "user=u_42")),
        PLANS_KEY,
        caps_key("daily"),
    ]
    for key in internal:
        assert key.startswith(keys.INTERNAL_PREFIX), key
        assert keys.parse_key(key) is None, key
