"""Windows and their calendar buckets.

A counter never resets: each instant falls in a bucket, and the bucket's label
is part of the counter key, so tomorrow is simply another key and yesterday's
expires on its own. Two replicas computing the bucket of one instant produce
the same label by construction.

MINUTE and HOUR buckets are always UTC. DAY and MONTH follow the policy's time
zone (UTC by default); a non-UTC zone is part of the label so that changing
the zone can never fold two different periods into one counter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from enum import StrEnum
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .errors import InvalidInputError, PolicyError

#: Seconds a counter outlives its bucket, so late charges still land in it.
GRACE_SECONDS = 3600
#: A session has no known end: its counters live this long after their last write.
SESSION_TTL_SECONDS = 86_400
SESSION_BUCKET = "session"


class Window(StrEnum):
    """The period a limit counts over."""

    MINUTE = "minute"
    HOUR = "hour"
    DAY = "day"
    MONTH = "month"
    SESSION = "session"


@dataclass(frozen=True, slots=True)
class Bucket:
    """One period of a window: its key label and its bounds in epoch seconds.

    ``end`` is None for a SESSION bucket, which lasts as long as the session.
    """

    label: str
    start: float | None
    end: float | None

    def expire_at(self, now: float) -> int:
        """The absolute expiry (epoch seconds) a counter in this bucket gets."""
        if self.end is None:
            return math.ceil(now) + SESSION_TTL_SECONDS
        return math.ceil(self.end) + GRACE_SECONDS

    def seconds_left(self, now: float) -> int | None:
        """Whole seconds until the bucket ends (at least 1), None for sessions."""
        if self.end is None:
            return None
        return max(1, math.ceil(self.end - now))


def zone(name: str | None) -> tzinfo:
    """Resolve a policy time zone name; None or "UTC" mean UTC."""
    if name is None:
        return UTC
    if not isinstance(name, str) or not name:
        # Checked first: a policy file can hold a number or a list here.
        raise PolicyError("Policy.timezone", name, "expected an IANA time zone name")
    if name.upper() in ("UTC", "Z", "ETC/UTC"):
        return UTC
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise PolicyError("Policy.timezone", name, "unknown IANA time zone") from None


def _tz_suffix(tz: tzinfo) -> str:
    return "" if tz is UTC else f"@{tz}"


def bucket_for(window: Window, now: float, tz: tzinfo = UTC) -> Bucket:
    """The bucket of ``window`` that contains the instant ``now`` (epoch seconds).

    >>> bucket_for(Window.DAY, 1_764_374_400.0).label   # 2025-11-29T00:00:00Z
    '20251129'
    """
    if window is Window.SESSION:
        return Bucket(SESSION_BUCKET, None, None)
    if window is Window.MINUTE:
        start = math.floor(now / 60) * 60
        return _utc_bucket(start, 60, "%Y%m%dT%H%M")
    if window is Window.HOUR:
        start = math.floor(now / 3600) * 3600
        return _utc_bucket(start, 3600, "%Y%m%dT%H")
    return _calendar_bucket(window, math.floor(now / 60), tz)


def utc_bounds(window: Window, at: datetime) -> tuple[datetime, datetime]:
    """The UTC bucket of ``window`` holding ``at``, as ``[start, end)`` datetimes.

    The bucket rule of the counters, for the commands that take a period
    (``--period 2026-11``: the month's bucket).

    >>> utc_bounds(Window.MONTH, datetime(2026, 12, 5, tzinfo=UTC))[1].isoformat()
    '2027-01-01T00:00:00+00:00'
    """
    if window is Window.SESSION:
        raise InvalidInputError("window", window.value, "a session has no calendar bounds")
    bucket = bucket_for(window, at.timestamp(), UTC)
    assert bucket.start is not None and bucket.end is not None
    return datetime.fromtimestamp(bucket.start, UTC), datetime.fromtimestamp(bucket.end, UTC)


_LABEL_FORMS = {
    Window.MINUTE: (re.compile(r"[0-9]{8}T[0-9]{4}"), "%Y%m%dT%H%M"),
    Window.HOUR: (re.compile(r"[0-9]{8}T[0-9]{2}"), "%Y%m%dT%H"),
    Window.DAY: (re.compile(r"[0-9]{8}"), "%Y%m%d"),
    Window.MONTH: (re.compile(r"[0-9]{6}"), "%Y%m"),
}


@lru_cache(maxsize=4096)
def bucket_of(window: Window, label: str) -> Bucket | None:
    """The bucket of ``window`` whose label is ``label``; None when no instant has it.

    The inverse of :func:`bucket_for`, for labels read from the ledger: the
    bucket is recomputed by ``bucket_for`` and its label must come back
    unchanged, so the two can never disagree.

    >>> bucket_of(Window.DAY, "20251129").end, bucket_of(Window.DAY, "2025-11-29")
    (1764460800.0, None)
    """
    if window is Window.SESSION:
        return Bucket(SESSION_BUCKET, None, None) if label == SESSION_BUCKET else None
    text, at_sign, zone_name = label.partition("@")
    form, fmt = _LABEL_FORMS[window]
    if not form.fullmatch(text) or (at_sign and window in (Window.MINUTE, Window.HOUR)):
        return None
    try:
        tz = zone(zone_name) if at_sign else UTC
        moment = datetime.strptime(text, fmt)
        # Noon of the day (mid-month): inside the bucket whatever the zone's offset or DST.
        if window is Window.DAY:
            moment = moment.replace(hour=12)
        elif window is Window.MONTH:
            moment = moment.replace(day=15)
        bucket = bucket_for(window, moment.replace(tzinfo=tz).timestamp(), tz)
    except (PolicyError, ValueError, OverflowError):  # unknown zone; no such date; year 9999+1
        return None
    return bucket if bucket.label == label else None


@lru_cache(maxsize=4096)
def _utc_bucket(start: int, length: int, fmt: str) -> Bucket:
    label = datetime.fromtimestamp(start, UTC).strftime(fmt)
    return Bucket(label, float(start), float(start + length))


@lru_cache(maxsize=4096)
def _calendar_bucket(window: Window, minute: int, tz: tzinfo) -> Bucket:
    # Cached per minute: DAY/MONTH boundaries in every IANA zone fall on whole minutes.
    local = datetime.fromtimestamp(minute * 60, tz)
    if window is Window.DAY:
        start = datetime(local.year, local.month, local.day, tzinfo=tz)
        nxt = (start + timedelta(days=1)).replace(hour=0)
        label = start.strftime("%Y%m%d")
    else:
        start = datetime(local.year, local.month, 1, tzinfo=tz)
        year, month = (local.year + 1, 1) if local.month == 12 else (local.year, local.month + 1)
        nxt = datetime(year, month, 1, tzinfo=tz)
        label = start.strftime("%Y%m")
    return Bucket(label + _tz_suffix(tz), start.timestamp(), nxt.timestamp())
