"""``lua/charge_many.lua`` runs N charges in one script call exactly as N calls of
``lua/charge.lua`` one after another.

Every case runs the same charges, from the same state, on one private Redis twice:
one by one through charge.lua in database 1 (an error a charge raises is its
reply), and all together in one EVALSHA of charge_many in database 2. Then the
replies must be equal, in order (an error by its message, less the script name and
line Redis adds), and so must every key: its type, its whole content and its expiry
(PEXPIRETIME: a counter's EXPIREAT to the millisecond; an expiry Redis counts from
its own clock, an operation marker's or a lease set's, moved only by the time
between the two runs).

The charges: the conformance vectors (``conformance/vectors.json``) alone, repeated
and all in one batch, from several states; random sequences built by
``RedisBackend.charge_args`` (refusals, zero and negative amounts, operation markers
found again, ledger events, priced admissions, grants, run-time caps and plans,
session counters, leases, the epoch marker); and the edges of exactness and of
errors, where one charge's failure must stay that charge's alone.

The cases at the end are the divergences an earlier charge_many.lua had, each
reduced to its smallest case: amounts summed past 2^53, an expiry already past,
a stored part or an argument that HINCRBY refuses.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from benchmarks.bench_lua import many_args
from mcp_budget_governor.caps import PLANS_KEY, CapRef, caps_key
from mcp_budget_governor.counters import Charge, CounterOp, with_cost
from mcp_budget_governor.keys import EPOCH_KEY, LEASE_PREFIX, lease_key, queue_key
from mcp_budget_governor.lua import many_source, source
from mcp_budget_governor.projections.counters.redis import RedisBackend
from testing.services import start_redis

VECTORS = json.loads(
    (Path(__file__).resolve().parents[1] / "conformance" / "vectors.json").read_text("utf-8")
)
MAX_EXACT = 2**53 - 1
# The caller clock of the charges built here: whole seconds, so that expiries after
# it are after Redis' own clock too (an expiry in the past is a case of its own).
NOW_S = int(time.time())
NOW_MS = NOW_S * 1000

Args = list[Any]  # charge.lua's arguments after EVALSHA <sha>: numkeys, KEYS, ARGV
Setup = Callable[[redis.Redis], None]


@dataclass
class Twin:
    """One private Redis: database 1 for charge.lua one by one, 2 for charge_many."""

    seq: redis.Redis
    many: redis.Redis
    charge_sha: str
    many_sha: str


@pytest.fixture(scope="module")
def twin() -> Iterator[Twin]:
    service = start_redis(prefer_local=True)  # FLUSHDB below: a server of this module's own
    try:
        base = service.url.rsplit("/", 1)[0]  # the URL names db 0, which would win over db=
        seq, many = redis.Redis.from_url(f"{base}/1"), redis.Redis.from_url(f"{base}/2")
        assert seq.connection_pool.connection_kwargs["db"] == 1
        assert many.connection_pool.connection_kwargs["db"] == 2
        yield Twin(
            seq,
            many,
            seq.script_load(source("charge")),
            seq.script_load(many_source()),
        )
        seq.close()
        many.close()
    finally:
        service.stop()


# -- the two runs ------------------------------------------------------------------


_WHERE = re.compile(r" script: [0-9a-f]{40}, on @user_script:\d+\.$")
_LINE = re.compile(r"user_script:\d+: ")


def plain(reply: Any) -> Any:
    """A reply with each error as ("error", its message), where the script's name and
    line (which differ between the two scripts) are left out."""
    if isinstance(reply, redis.ResponseError):
        return ("error", _LINE.sub("", _WHERE.sub("", str(reply))))
    if isinstance(reply, list):
        return [plain(r) for r in reply]
    return reply


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def dump(client: redis.Redis) -> dict[bytes, tuple[str, Any, int]]:
    """Every key: its type, its content and its PEXPIRETIME (-1: none)."""
    read: dict[str, Callable[[bytes], Any]] = {
        "hash": client.hgetall,  # a dict: field order is no part of the state
        "string": client.get,
        "zset": lambda key: client.zrange(key, 0, -1, withscores=True),
        "list": lambda key: client.lrange(key, 0, -1),
    }
    out = {}
    for key in client.keys("*"):
        kind = client.type(key).decode()
        out[key] = (kind, read[kind](key), client.pexpiretime(key))
    return out


def run_both(twin: Twin, charges: Sequence[Args], *setups: Setup) -> list[Any]:
    """Run ``charges`` both ways from the state ``setups`` write, assert the replies
    and the states equal, and return the replies (errors as :func:`plain` gives them)."""
    for client in (twin.seq, twin.many):
        client.flushdb()
        for setup in setups:
            setup(client)
    seq_from = server_ms(twin.seq)
    one_by_one: list[Any] = []
    for args in charges:
        try:
            one_by_one.append(twin.seq.evalsha(twin.charge_sha, *args))
        except redis.ResponseError as exc:  # charge.lua raised: that charge's reply
            one_by_one.append(exc)
    seq_to = server_ms(twin.seq)
    many_from = server_ms(twin.many)
    try:
        batched = twin.many.evalsha(twin.many_sha, *many_args(charges))
    except redis.ResponseError as exc:  # the whole call failed: no list to compare
        batched = exc
    many_to = server_ms(twin.many)
    assert plain(batched) == plain(one_by_one)

    seq_state, many_state = dump(twin.seq), dump(twin.many)
    assert sorted(many_state) == sorted(seq_state)
    for key, (kind, content, expiry) in seq_state.items():
        assert many_state[key][:2] == (kind, content), key
        moved = many_state[key][2] - expiry
        if kind == "hash" or expiry < 0 or moved == 0:  # EXPIREAT: an instant, or none
            assert moved == 0, key
        else:  # SET EX, PEXPIRE: counted from Redis' clock, written in each run's span
            assert many_from - seq_to - 1 <= moved <= many_to - seq_from + 1, key
    return plain(one_by_one)


def commands(*cmds: Sequence[Any]) -> Setup:
    """A setup that sends ``cmds`` as they are."""

    def setup(client: redis.Redis) -> None:
        for cmd in cmds:
            client.execute_command(*cmd)

    return setup


# -- charge.lua's arguments, read back ---------------------------------------------


def counters(args: Args) -> list[tuple[str, int]]:
    """Per counter of charge.lua arguments: its key and the index in ``args`` of its
    amount (then its cap, enforce, expire_at), after charge.lua's header."""
    text = [a.decode() if isinstance(a, bytes) else str(a) for a in args]
    nk = int(text[0])
    argv = 1 + nk  # where ARGV[1] stands in args
    flags = text[argv + 1]
    first = ("e" in flags) + ("o" in flags)
    off, queues = (7, int(text[argv + 5])) if "l" in flags else (3, 0)
    n, width = nk - first - queues, 4
    if "c" in flags:
        n, width = (n - 1) // 2, 5
    return [(text[1 + first + i], argv + off - 1 + i * width) for i in range(n)]


def later(args: Args, seconds: int) -> Args:
    """``args`` with every counter's expire_at moved ``seconds`` later (lease sets
    have none)."""
    out = list(args)
    for _, at in counters(args):
        if int(out[at + 3]):
            out[at + 3] = str(int(out[at + 3]) + seconds)
    return out


def renamed(args: Args, ids: dict[str, str]) -> Args:
    """``args`` with operation and event ids replaced (in the op marker's key too)."""
    out = []
    for a in args:
        for old, new in ids.items():
            a = a.replace(old, new) if isinstance(a, str) else a
        out.append(a)
    return out


# -- the conformance vectors -------------------------------------------------------

VECTOR_NOW = int(VECTORS["charge"][0]["now"])
CHARGE_VECTORS = [c["command"] for c in VECTORS["charge"] + VECTORS["charge_priced"]]
# Their expiries are bucket ends after the vectors' fixed clock, which Redis' own
# clock may have passed: moved this much later, a repeat meets the counter the first
# call made (an expiry in the past is a divergence of its own, below).
SHIFT = max(0, NOW_S - VECTOR_NOW) + 86_400
OP_ID, EVENT_ID, COST_ID = "0000000000aa", "0000000000bb", "0000000000ee"


def vector_args(command: list[str], twin: Twin) -> Args:
    assert command[:2] == ["EVALSHA", twin.charge_sha]  # the vectors are this charge.lua's
    return command[2:]


def changes(client: redis.Redis) -> None:
    """Every run-time change of the vectors (caps, plans, grants, resets) and the epoch
    marker, as change.lua writes them."""
    sha = client.script_load(source("change"))
    for change in VECTORS["changes"]:
        if "command" in change:
            client.evalsha(sha, *change["command"][2:])
    client.set(EPOCH_KEY, "vectors")


def full(client: redis.Redis) -> None:
    """Every vector's counter at its default cap (a lease set full of live leases), and
    an in-flight part and a grant on some: enforced charges meet refusals."""
    for command in CHARGE_VECTORS:
        args = command[2:]
        for j, (key, at) in enumerate(counters(args)):
            cap = int(args[at + 1])
            if key.startswith(LEASE_PREFIX):
                client.zadd(key, {f"held-{i}": VECTOR_NOW * 1000 + 60_000 for i in range(cap)})
            else:
                client.hset(key, mapping={"c": cap - j % 2, "f": j % 2, "g": j % 3 // 2})


STATES: dict[str, tuple[Setup, ...]] = {
    "empty": (),
    "changed": (changes,),
    "full": (changes, full),
}


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("i", range(len(CHARGE_VECTORS)))
def test_each_vector_alone(twin: Twin, state: str, i: int) -> None:
    """A batch of one: the vector's exact arguments."""
    run_both(twin, [vector_args(CHARGE_VECTORS[i], twin)], *STATES[state])


def three_calls(args: Args) -> list[Args]:
    """The same check three times: again under new ids (a second call), then the
    first ids again (a replay: its marker holds, or its event is charged twice)."""
    again = renamed(
        args, {OP_ID: "0000000000a1", EVENT_ID: "0000000000b1", COST_ID: "0000000000e1"}
    )
    return [args, again, args]


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("i", range(len(CHARGE_VECTORS)))
def test_each_vector_three_times_in_one_batch(twin: Twin, state: str, i: int) -> None:
    args = later(vector_args(CHARGE_VECTORS[i], twin), SHIFT)
    run_both(twin, three_calls(args), *STATES[state])


@pytest.mark.parametrize("state", STATES)
def test_every_vector_in_one_batch(twin: Twin, state: str) -> None:
    every = [later(vector_args(c, twin), SHIFT) for c in CHARGE_VECTORS]
    batch = [steps[k] for k in range(3) for steps in map(three_calls, every)]
    replies = run_both(twin, batch, *STATES[state])
    refused = [r for r in replies if isinstance(r, list) and r[0] > 0]
    if state == "full":
        assert refused  # the full counters refuse, and the batch goes on past them
    else:
        assert not refused and replies[0][0] == 0


# -- random sequences --------------------------------------------------------------

# (key, limit, scope field): windows, and sessions (whose expiry each write moves).
POOL = [
    ("mcpbg:v1:calls:user=u1:20261207", "calls", "user=u1"),
    ("mcpbg:v1:calls:global:20261207T10", "calls", ""),
    ("mcpbg:v1:spend:tenant=t1:202612", "spend", "tenant=t1"),
    ("mcpbg:v1:chat:agent=a,session=s1:session", "chat", "agent=a,session=s1"),
    ("mcpbg:v1:chat:agent=b,session=s2:session", "chat", "agent=b,session=s2"),
]
LEASES = lease_key("parallel", "user=u1")
OP_IDS = ["op-1", "op-2", "op-3", "op-4"]  # few, so that some repeat and find their marker
EVENT_IDS = ["ev-1", "ev-2", "ev-3"]


def backends() -> list[RedisBackend]:
    """Builders of charge.lua arguments (no connection is made): plain, with the epoch
    marker checked, and with caps resolved by the caller (flag 'g')."""
    return [
        RedisBackend(aioredis.Redis(), clock=lambda: NOW_S, coalesce=False, **options)
        for options in ({}, {"require_epoch": True}, {"resolved_caps": True})
    ]


BACKENDS = backends()


def random_state(rng: random.Random) -> Setup:
    """Counters with some parts, grants and expiries; caps hashes, plans, leases and a
    waiting queue; the epoch marker mostly; now and then a counter that is not one."""
    cmds: list[tuple[Any, ...]] = []
    if rng.random() < 0.85:
        cmds.append(("SET", EPOCH_KEY, "e-1"))
    for key, _, _ in POOL:
        fields: list[Any] = []
        for field, low, high, p in (("c", -2, 9, 0.5), ("f", 0, 4, 0.3), ("g", 0, 5, 0.3)):
            if rng.random() < p:
                fields += [field, rng.randint(low, high)]
        if rng.random() < 0.2:
            fields += ["e:ev-0", 1]
        if fields:
            cmds.append(("HSET", key, *fields))
            if rng.random() < 0.7:
                cmds.append(("EXPIREAT", key, NOW_S + rng.randint(600, 3600)))
    for limit in ("calls", "spend", "chat"):
        for field in ("user=u1", "", "tenant=t1", "agent=a,session=s1"):
            if rng.random() < 0.3:
                untl = rng.choice([0, NOW_S - 10, NOW_S + 100])
                value = rng.choice([f"{rng.randint(0, 12)} {untl} ops%0Awhy", "x", "7"])
                cmds.append(("HSET", caps_key(limit), field, value))
    for field in ("user=u1", "tenant=t1"):
        if rng.random() < 0.4:
            cmds.append(("HSET", PLANS_KEY, field, rng.choice(["pro", "free", "gold"])))
    for i in range(rng.randint(0, 3)):
        score = NOW_MS + rng.choice([-1000, 30_000])  # expired, or live
        cmds.append(("ZADD", LEASES, score, f"held-{i}"))
    if rng.random() < 0.3:
        cmds.append(("ZADD", queue_key(LEASES), NOW_MS - 100, "w-0/1500"))
        if rng.random() < 0.5:  # else a refused waiting call gives it one
            cmds.append(("PEXPIREAT", queue_key(LEASES), NOW_MS + 600_000))
    if rng.random() < 0.15:  # one counter that is no counter: its charges alone fail
        key = rng.choice(POOL)[0]
        cmds += [("DEL", key), rng.choice([("SET", key, "x"), ("HSET", key, "c", "abc")])]
    return commands(*cmds)


def random_op(rng: random.Random, resolve: bool) -> CounterOp:
    key, limit, field = rng.choice(POOL)
    ref = None
    if resolve and rng.random() < 0.8:
        ref = CapRef(
            caps_key(limit),
            field,
            value_cap=rng.choice([None, None, 4]),
            plan_fields=("user=u1", "tenant=t1"),
            file_plan=rng.choice([None, "free"]),
            plan_caps=rng.choice([(), (("pro", 9), ("free", 2))]),
        )
    expire_at = NOW_S + (1800 + rng.randint(0, 60) if key.endswith(":session") else 7200)
    amount = rng.choice([0, 1, 1, 1, 2, 3, -1, -2, 6])
    return CounterOp(key, amount, rng.randint(0, 12), rng.random() < 0.75, expire_at, ref)


def random_charge(rng: random.Random) -> Args:
    resolve = rng.random() < 0.4
    ops = [random_op(rng, resolve) for _ in range(rng.randint(1, 4))]
    lease = ticket = None
    if rng.random() < 0.15:
        ops.insert(rng.randint(0, len(ops)), CounterOp(LEASES, 1, rng.randint(0, 3), True, 0))
        lease = rng.choice(["lease-1", "lease-2"])
        ticket = rng.choice([None, "w-0/1500", "w-1/1500"])
    mode = rng.random()
    if mode < 0.5:  # inline, with an operation marker
        event_id, op_id = None, rng.choice(OP_IDS)
    elif mode < 0.8:  # a ledger event: in-flight parts
        event_id, op_id = rng.choice(EVENT_IDS), None
    elif mode < 0.9:  # an admission and its price, two events
        event_id, op_id = with_cost("ev-a", "ev-c", rng.randrange(len(ops))), None
    else:  # inline, no marker
        event_id, op_id = None, None
    charge = Charge(tuple(ops), event_id, rng.random() < 0.6, op_id, lease, 30.0, ticket)
    return rng.choice(BACKENDS).charge_args(charge)


def random_case(seed: int) -> tuple[Setup, list[Args]]:
    rng = random.Random(seed)
    return random_state(rng), [random_charge(rng) for _ in range(rng.randint(2, 40))]


SEEDS = range(120)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_sequences(twin: Twin, seed: int) -> None:
    setup, charges = random_case(seed)
    run_both(twin, charges, setup)


def test_the_random_sequences_meet_every_outcome(twin: Twin) -> None:
    """The seeds above are worth their time: between them, charges are admitted,
    refused, stopped by a missing epoch marker, and fail alone."""
    seen = set()
    for seed in SEEDS[:60]:
        setup, charges = random_case(seed)
        for reply in run_both(twin, charges, setup):
            if isinstance(reply, tuple):
                seen.add("error")
            else:
                seen.add({0: "admitted", -1: "no epoch"}.get(reply[0], "refused"))
    assert seen == {"admitted", "refused", "no epoch", "error"}


# -- exactness and errors ----------------------------------------------------------


def inline(
    key: str,
    amount: int | str,
    *,
    enforce: str = "1",
    expire_at: int = NOW_S + 3600,
    event_id: str = "",
    cap: int = 100,
) -> Args:
    """charge.lua's arguments for one counter (inline, or in flight under ``event_id``),
    flagged 'u', its amount as given."""
    return [1, key, event_id, "u", str(amount), str(cap), enforce, str(expire_at), str(NOW_MS)]


def test_near_the_exact_range(twin: Twin) -> None:
    """A counter a few units under 2^53 - 1: charges up to the bound are counted, one
    past it is reported {-2, i} and writes nothing, one already past it too."""
    setup = commands(
        ("HSET", "near", "c", MAX_EXACT - 3, "g", 1),
        ("HSET", "past", "c", MAX_EXACT + 1),
        ("HSET", "low", "f", -MAX_EXACT + 1),
    )
    ahead = str(NOW_S + 60)
    batch = [
        inline("near", 2, cap=MAX_EXACT),
        inline("near", 2, enforce="0"),  # would reach 2^53 + 1
        inline("near", 1, enforce="0"),  # reaches the bound exactly
        inline("near", 0, cap=MAX_EXACT),  # no room for a zero charge's one unit
        inline("near", -5, enforce="0"),
        [2, "ok", "past", "", "u", "1", "9", "1", ahead, "1", "9", "0", ahead, str(NOW_MS)],
        inline("low", -1, enforce="0", event_id="ev-1"),
        inline("low", -1, enforce="0", event_id="ev-2"),  # in flight below -(2^53 - 1)
        inline("near", 1, enforce="0"),
    ]
    assert run_both(twin, batch, setup) == [
        [0, MAX_EXACT - 3],
        [-2, 1],
        [0, MAX_EXACT - 1],
        [1, MAX_EXACT],
        [0, MAX_EXACT],
        [-2, 2],
        [0, -MAX_EXACT + 1],
        [-2, 1],
        [0, MAX_EXACT - 5],
    ]


# kind of breakage -> (its setup, the charges of the batch below that fail, good's total
# before the last charge)
BROKEN: dict[str, tuple[Setup, list[int], int]] = {
    "c not an integer": (commands(("HSET", "bad", "c", "abc")), [1, 3], 5),
    "c with a space": (commands(("HSET", "bad", "c", " 5")), [1, 3], 5),
    "f not an integer": (commands(("HSET", "bad", "f", "1.5")), [2], 5),
    "a string": (commands(("SET", "bad", "x")), [1, 2, 3], 3),
    "a list": (commands(("RPUSH", "bad", "x")), [1, 2, 3], 3),
}


@pytest.mark.parametrize("broken", BROKEN)
def test_a_broken_counter_fails_its_charges_alone(twin: Twin, broken: str) -> None:
    """Only the charges that write (or read) the broken part fail; a charge that wrote
    its first counter before its second failed keeps that write, both ways; every
    other charge of the batch is counted as one by one."""
    setup, failing, good = BROKEN[broken]
    ahead = str(NOW_S + 60)
    batch = [
        inline("good", 3),
        inline("bad", 1),
        inline("bad", 1, event_id="ev-1"),
        [2, "good", "bad", "", "u", "2", "100", "1", ahead, "1", "100", "1", ahead, str(NOW_MS)],
        inline("other", 4, event_id="ev-2"),
        inline("good", 5),
    ]
    replies = run_both(twin, batch, setup)
    assert [i for i, r in enumerate(replies) if isinstance(r, tuple)] == failing
    assert replies[0] == [0, 0] and replies[4] == [0, 0] and replies[5] == [0, good]


def test_charges_that_fail_in_charge_lua_fail_alone(twin: Twin) -> None:
    """Errors charge.lua returns or raises itself: a wrong argument count, a malformed
    event id, an amount that is no number, a bad caller clock read by a timed cap."""
    timed = commands(("HSET", caps_key("x"), "f", f"5 {NOW_S + 60} -"))
    resolved = [3, "k", caps_key("x"), PLANS_KEY, "", "uc", "1", "100", "1", str(NOW_S + 60), "f"]
    batch = [
        inline("k", 1),
        inline("k", 1)[:-1],  # no clock: one argument short
        inline("k", 1, event_id="a b"),
        inline("k", "abc"),
        [*resolved, "not-a-clock"],
        [*resolved, str(NOW_MS)],  # the run-time cap, 5, holds
        inline("k", 1),
    ]
    replies = run_both(twin, batch, timed)
    assert [i for i, r in enumerate(replies) if isinstance(r, tuple)] == [1, 2, 3, 4]
    assert replies[5] == [0, 1, 5] and replies[6] == [0, 2]


# -- divergences an earlier charge_many.lua had (minimal cases) --


def test_amounts_summing_past_2_53(twin: Twin) -> None:
    """c = 2^53 - 1, then -(2^53 - 1) and -2: c ends at -2 (a summed change,
    -(2^53 + 1), would round to -2^53 and leave -1)."""
    batch = [inline("k", -MAX_EXACT, enforce="0"), inline("k", -2, enforce="0")]
    run_both(twin, batch, commands(("HSET", "k", "c", MAX_EXACT)))


def test_an_expiry_in_the_past_deletes_the_counter_between_charges(twin: Twin) -> None:
    """Two charges of 5 on a new counter whose expire_at has passed for Redis: the
    second reads 0 ([0, 0] twice): the counter is gone between them."""
    run_both(twin, [inline("k", 5, expire_at=1000), inline("k", 5, expire_at=1000)])


def test_a_stored_part_with_a_leading_zero(twin: Twin) -> None:
    """[0, 0] for 'other', an error for 'k' ('007' is no integer to HINCRBY), and
    'other' written."""
    batch = [inline("other", 1), inline("k", 5)]
    run_both(twin, batch, commands(("HSET", "k", "c", "007")))


@pytest.mark.parametrize(
    ("amount", "expire_at"),
    [("5.5", None), ("+5", None), ("-0", None), ("5", "1.5")],
    ids=["amount 5.5", "amount +5", "amount -0", "expire_at 1.5"],
)
def test_malformed_arguments(twin: Twin, amount: str, expire_at: str | None) -> None:
    """The first charge fails (Redis refuses the amount, or the EXPIREAT of 1.5) and
    the second is counted, though Lua would read each as a number."""
    args = inline("k", amount)
    if expire_at is not None:
        args[7] = expire_at
    run_both(twin, [args, inline("k", 1)])
