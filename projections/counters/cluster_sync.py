"""Reading and correcting counters on Redis Cluster, slot by slot (``mcpbg reconcile``).

On one Redis a snapshot is one ``MULTI`` (:func:`.sync.snapshot`). A cluster
runs a transaction in one slot only, and the projection keeps a watermark
hash per slot (``WATERMARK_KEY`` + the slot's hash tag, see
:meth:`.cluster.ClusterBackend.apply`). So each slot is read in one ``MULTI``
on its master: its counters and its own watermarks, which is one exact cut
of that slot.

The slot's watermarks alone would hide a failover that lost writes: the
promoted replica holds an older watermark, consistent with its older
counters, while the worker has moved on (it resumes from the resume
watermark, ``WATERMARK_KEY``, which another master may hold) and will never
re-read the lost events. So the resume watermarks are read first, and each
slot is compared with the ledger up to the greater of the two per
partition: the resume watermark only moves once every slot has applied a
batch, so every event at or below it, read before the slot, must be in it.
A fix that finds a slot's watermark behind raises it to the resume
watermark with the correction (in one ``lua/rewrite.lua`` call, refused if
the slot's watermarks moved meanwhile), so a later redelivery of the lost
offsets cannot count them a second time.

The failover lost the slot's seen-id entries of those events too (the
``mcpbg:v1:_seen:<day>{<tag>}`` sets, by which a slot skips a producer
retry at a new offset), and a raised watermark does not stand for them. So
the fix also adds back, to the slot's seen sets, the id of every event the
ledger has charging one of the slot's counters at or below the offsets it is
compared up to (``SADD``: the ids the slot kept are already there), as
``mcpbg replay`` writes the seen sets of one Redis. They go in before the
correction: a fix refused because the worker moved the slot meanwhile then
leaves ids of events the ledger counts once and the counters are still
short of, which the next reconcile reports, rather than corrected counters
that a retry could push past the ledger.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import redis
from redis import exceptions as redis_errors
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from mcp_budget_governor.errors import BackendUnavailableError
from mcp_budget_governor.keys import INTERNAL_PREFIX, PREFIX, SEEN_PREFIX, WATERMARK_KEY
from mcp_budget_governor.urls import parse_cluster_url

from .cluster import slot_tag
from .sync import Hashes, SeenIds, Snapshot, _counter, _decode, write_counters

__all__ = [
    "SlotRead",
    "SlotSnapshot",
    "cluster_client",
    "is_cluster",
    "read_slots",
    "scan_keys",
    "slot_snapshots",
]

_UNAVAILABLE = (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError)
_SEEN_CHUNK = 10_000


def is_cluster(store: Any) -> TypeGuard[RedisCluster]:
    """Whether ``store`` is a Redis Cluster client (``mcpbg reconcile`` on a cluster)."""
    return isinstance(store, RedisCluster)


def cluster_client(url: str) -> RedisCluster:
    """A client for the cluster at ``url``; unreachable: a one-line error."""
    nodes = [
        ClusterNode(h, p)  # type: ignore[no-untyped-call]
        for h, p in parse_cluster_url(url, "--redis-url")
    ]
    try:
        return RedisCluster(startup_nodes=nodes, socket_timeout=30.0, socket_connect_timeout=5.0)
    except (*_UNAVAILABLE, redis_errors.RedisClusterException) as exc:
        raise BackendUnavailableError.redis(exc, url) from None


def _node(client: RedisCluster, key: str) -> redis.Redis:
    node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
    conn: redis.Redis = client.get_redis_connection(node)
    return conn


def scan_keys(client: RedisCluster, match: str | None = None) -> set[str]:
    """Every counter key on every master (the projection's own keys left out); with
    ``match``, every key of that pattern instead (the run-time caps hashes)."""
    found: set[str] = set()
    try:
        for node in client.get_primaries():  # type: ignore[no-untyped-call]
            for raw in client.get_redis_connection(node).scan_iter(
                match=f"{PREFIX}:[^_]*" if match is None else match, count=5000
            ):
                key = _decode(raw)
                if match is not None or not key.startswith(INTERNAL_PREFIX):
                    found.add(key)
    except _UNAVAILABLE as exc:
        raise BackendUnavailableError.redis(exc) from None
    return found


def resume_watermarks(client: RedisCluster) -> dict[str, int]:
    try:
        raw = client.hgetall(WATERMARK_KEY)
    except _UNAVAILABLE as exc:
        raise BackendUnavailableError.redis(exc) from None
    return {_decode(k): int(v) for k, v in raw.items()}


@dataclass(frozen=True, slots=True)
class SlotSnapshot:
    """One slot read at one instant. ``snap.watermarks`` is what its counters must
    equal the ledger up to; ``own`` its own watermark hash as read."""

    slot: int
    snap: Snapshot
    own: dict[str, int]

    @property
    def watermark_key(self) -> str:
        return WATERMARK_KEY + slot_tag(self.slot)

    def behind(self) -> dict[str, int]:
        """The partitions whose slot watermark is below what the slot is compared up to."""
        return {p: o for p, o in self.snap.watermarks.items() if self.own.get(p, -1) < o}


def slot_snapshots(client: RedisCluster, keys: Iterable[str]) -> list[SlotSnapshot]:
    """Each slot of ``keys`` read in one ``MULTI`` on its master, after the resume
    watermarks (the module docstring says why in this order)."""
    return [
        SlotSnapshot(
            read.slot,
            Snapshot(
                read.now,
                read.upto,
                {k: _counter(raw, ttl) for k, (raw, ttl) in read.hashes.items()},
            ),
            read.own,
        )
        for read in read_slots(client, keys)
    ]


@dataclass(frozen=True, slots=True)
class SlotRead:
    """The hashes of one slot read in one ``MULTI`` on its master: its clock, its own
    watermarks, what it is compared up to (the greater of those and the resume
    watermarks, per partition) and each hash with its TTL."""

    slot: int
    now: int
    own: dict[str, int]
    upto: dict[str, int]
    hashes: Hashes

    @property
    def watermark_key(self) -> str:
        return WATERMARK_KEY + slot_tag(self.slot)


def read_slots(client: RedisCluster, keys: Iterable[str]) -> list[SlotRead]:
    """Each slot of ``keys`` read in one ``MULTI`` on its master, after the resume
    watermarks: what :func:`slot_snapshots` reads, and the run-time changes' reconcile
    (:mod:`.changes_sync`)."""
    resume = resume_watermarks(client)
    by_slot: dict[int, list[str]] = {}
    for key in sorted(set(keys)):
        by_slot.setdefault(key_slot(key.encode()), []).append(key)
    out = []
    try:
        for slot, slot_keys in sorted(by_slot.items()):
            pipe = _node(client, slot_keys[0]).pipeline(transaction=True)
            pipe.time()
            pipe.hgetall(WATERMARK_KEY + slot_tag(slot))
            for key in slot_keys:
                pipe.hgetall(key)
                pipe.ttl(key)
            head = pipe.execute()
            own = {_decode(k): int(v) for k, v in head[1].items()}
            upto = {p: max(own.get(p, -1), resume.get(p, -1)) for p in {*own, *resume}}
            hashes: Hashes = {
                key: (head[2 + 2 * i], int(head[3 + 2 * i])) for i, key in enumerate(slot_keys)
            }
            out.append(SlotRead(slot, int(head[0][0]), own, upto, hashes))
    except _UNAVAILABLE as exc:
        raise BackendUnavailableError.redis(exc) from None
    return out


def correct_slot(
    client: RedisCluster,
    part: SlotSnapshot,
    corrections: Sequence[tuple[str, int, int]],
    drop: Mapping[str, Sequence[str]],
    seen: SeenIds,
) -> int:
    """Add back the seen ids ``seen`` of the slot's counters (:func:`.sync.ledger_seen_ids`),
    then add ``corrections`` to its counters, drop its stale in-flight entries and
    raise its watermarks that were behind, in one step on its master. Returns how
    many seen ids the slot had lost."""
    node = _node(client, corrections[0][0])
    by_day: dict[str, tuple[set[str], int]] = {}
    for key in part.snap.counters:
        for day, (day_ids, expire_at) in seen.get(key, {}).items():
            by_day.setdefault(day, (set(), expire_at))[0].update(day_ids)
    added = 0
    try:
        for day, (ids, expire_at) in sorted(by_day.items()):
            ordered = sorted(ids)
            seen_key = f"{SEEN_PREFIX}:{day}{slot_tag(part.slot)}"  # as cluster.apply names it
            for i in range(0, len(ordered), _SEEN_CHUNK):
                pipe = node.pipeline(transaction=True)
                pipe.sadd(seen_key, *ordered[i : i + _SEEN_CHUNK])
                pipe.expireat(seen_key, expire_at)
                added += int(pipe.execute()[0])
    except _UNAVAILABLE as exc:
        raise BackendUnavailableError.redis(exc) from None
    behind = part.behind()
    write_counters(
        node,
        corrections,
        watermarks=part.own if behind else None,
        add=True,
        drop=drop,
        set_watermarks=behind or None,
        watermark_key=part.watermark_key,
    )
    return added
