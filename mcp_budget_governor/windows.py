"""Windows and their calendar buckets.

A counter never resets: each instant falls in a bucket, and the bucket's label
is part of the counter key, so tomorrow is simply another key and yesterday's
expires on its own. Two replicas computing the bucket of one instant produce
the same label by construction.

MINUTE and HOUR buckets are always UTC. DAY, WEEK (ISO weeks, from Monday
00:00) and MONTH follow the policy's time zone (UTC by default); a non-UTC
zone is part of the label so that changing the zone can never fold two
different periods into one counter.

A MONTH may start on a billing day (its ``anchor``, 1 to 31): the period runs
from that day at 00:00 to the same day of the next month. In a month too short
for the day (31 in April, 29 to 31 in February) the period starts on the
month's last day instead. The label is the month the period starts in, and the
anchor when it is not 1, so calendar months keep their labels:

>>> at = 1764442477.0  # 2025-11-29T18:54:37Z
>>> [bucket_for(Window.MONTH, at, anchor=a).label for a in (1, 15, 30)]  # 30: since Oct 30
['202511', '202511+15', '202510+30']
>>> bucket_for(Window.WEEK, at, zone("Europe/Berlin")).label
'2025W48@Europe/Berlin'
"""

from __future__ import annotations

import calendar
import math
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta, tzinfo
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
    WEEK = "week"
    MONTH = "month"
    SESSION = "session"


@dataclass(frozen=True, slots=True)
class Bucket:
    """One period of a window: its key label and its bounds in epoch seconds.

    ``end`` is None for a SESSION bucket, which lasts as long as the session.

    >>> at = 1764442477.0  # 2025-11-29T18:54:37Z
    >>> bucket_for(Window.MINUTE, at).label, bucket_for(Window.DAY, at, zone("Europe/Paris")).label
    ('20251129T1854', '20251129@Europe/Paris')
    >>> day = bucket_for(Window.DAY, at)
    >>> day.end - day.start, day.expire_at(at) - day.end  # a day, then the grace
    (86400.0, 3600.0)
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


def bucket_for(window: Window, now: float, tz: tzinfo = UTC, anchor: int = 1) -> Bucket:
    """The bucket of ``window`` that contains the instant ``now`` (epoch seconds).

    ``anchor`` is the day a MONTH period starts on (see the module's notes);
    other windows ignore it.

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
    return _calendar_bucket(
        window, math.floor(now / 60), tz, anchor if window is Window.MONTH else 1
    )


#: The billing days a MONTH period may start on.
ANCHOR_DAYS = range(1, 32)


def check_anchor(value: object, field: str) -> int:
    """A billing day: a whole number from 1 to 31, else a :class:`PolicyError` naming ``field``.

    >>> check_anchor(15, "anchor_day")
    15
    >>> check_anchor(0, "Limit('x').anchor_day")
    Traceback (most recent call last):
    ...
    mcp_budget_governor.errors.PolicyError: Limit('x').anchor_day: expected a day of the month \
from 1 to 31 (29-31 start on the last day of shorter months) (got 0)
    """
    if isinstance(value, bool) or not isinstance(value, int) or value not in ANCHOR_DAYS:
        raise PolicyError(
            field,
            value,
            "expected a day of the month from 1 to 31 (29-31 start on the last day of"
            " shorter months)",
        )
    return value


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
    Window.WEEK: (re.compile(r"[0-9]{4}W[0-9]{2}"), ""),
    Window.MONTH: (re.compile(r"[0-9]{6}(?:\+[0-9]{2})?"), "%Y%m"),
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
    anchor = 1
    try:
        tz = zone(zone_name) if at_sign else UTC
        # Noon of a day inside the bucket, whatever the zone's offset or DST.
        if window is Window.WEEK:
            thursday = date.fromisocalendar(int(text[:4]), int(text[5:]), 4)
            moment = datetime(thursday.year, thursday.month, thursday.day, 12)
        elif window is Window.MONTH:
            text, _, day = text.partition("+")
            anchor = int(day) if day else 1
            if anchor not in ANCHOR_DAYS:
                return None
            moment = datetime.strptime(text, fmt)
            moment = moment.replace(day=_clamped(moment.year, moment.month, anchor), hour=12)
        else:
            moment = datetime.strptime(text, fmt)
            if window is Window.DAY:
                moment = moment.replace(hour=12)
        bucket = bucket_for(window, moment.replace(tzinfo=tz).timestamp(), tz, anchor)
    except (PolicyError, ValueError, OverflowError):  # unknown zone; no such date; year 9999+1
        return None
    return bucket if bucket.label == label else None


@lru_cache(maxsize=4096)
def _utc_bucket(start: int, length: int, fmt: str) -> Bucket:
    label = datetime.fromtimestamp(start, UTC).strftime(fmt)
    return Bucket(label, float(start), float(start + length))


def _clamped(year: int, month: int, anchor: int) -> int:
    """The day a period anchored on ``anchor`` starts in this month (its last day at most)."""
    return min(anchor, calendar.monthrange(year, month)[1])


def _next_month(year: int, month: int) -> tuple[int, int]:
    return (year + 1, 1) if month == 12 else (year, month + 1)


def _midnight(day: date, tz: tzinfo) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=tz)


@lru_cache(maxsize=4096)
def _calendar_bucket(window: Window, minute: int, tz: tzinfo, anchor: int) -> Bucket:
    # Cached per minute: DAY/WEEK/MONTH boundaries in every IANA zone fall on whole minutes.
    local = datetime.fromtimestamp(minute * 60, tz)
    today = local.date()
    if window is Window.DAY:
        start = _midnight(today, tz)
        nxt = _midnight(today + timedelta(days=1), tz)
        label = start.strftime("%Y%m%d")
    elif window is Window.WEEK:
        monday = today - timedelta(days=today.weekday())
        start = _midnight(monday, tz)
        nxt = _midnight(monday + timedelta(days=7), tz)
        iso = monday.isocalendar()
        label = f"{iso.year:04d}W{iso.week:02d}"
    else:
        year, month = today.year, today.month
        if today.day < _clamped(year, month, anchor):  # still in the period begun last month
            year, month = (year - 1, 12) if month == 1 else (year, month - 1)
        start = _midnight(date(year, month, _clamped(year, month, anchor)), tz)
        after = _next_month(year, month)
        nxt = _midnight(date(*after, _clamped(*after, anchor)), tz)
        label = f"{year:04d}{month:02d}" + ("" if anchor == 1 else f"+{anchor:02d}")
    return Bucket(label + _tz_suffix(tz), start.timestamp(), nxt.timestamp())


# --- periods named on the command line ---------------------------------------------

_MONTH = re.compile(r"(\d{4})-(\d{2})")
_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")
#: The earliest year a period may name (epoch seconds are never negative).
FIRST_YEAR = 1970
_PERIOD = "expected a month YYYY-MM or a day YYYY-MM-DD"


def parse_period(text: str, field: str = "--period") -> tuple[datetime, datetime]:
    """A UTC month ``YYYY-MM`` or day ``YYYY-MM-DD`` as its bucket ``[start, end)``.

    The one period rule of every command (``--period``, and the days of
    ``--from`` / ``--to``); surrounding blanks are ignored. Bad text is an
    :class:`InvalidInputError` naming ``field``, never a ``ValueError``.

    >>> [d.isoformat()[:10] for d in parse_period(" 2026-12-31")]
    ['2026-12-31', '2027-01-01']
    >>> parse_period("1969-12")
    Traceback (most recent call last):
    ...
    mcp_budget_governor.errors.InvalidInputError: --period: from 1970 on (got '1969-12')
    """
    raw = text.strip() if isinstance(text, str) else ""
    try:
        if month := _MONTH.fullmatch(raw):
            year, number = int(month.group(1)), int(month.group(2))
            if not 1 <= number <= 12:
                raise ValueError(raw)
            at, window = datetime(year, number, 1, tzinfo=UTC), Window.MONTH
        elif _DAY.fullmatch(raw):
            day = date.fromisoformat(raw)
            at, window = datetime(day.year, day.month, day.day, tzinfo=UTC), Window.DAY
        else:
            raise ValueError(raw)
    except ValueError:
        raise InvalidInputError(field, text, _PERIOD) from None
    if at.year < FIRST_YEAR:
        raise InvalidInputError(field, text, f"from {FIRST_YEAR} on")
    try:
        return utc_bounds(window, at)
    except (ValueError, OverflowError):
        # Its end (the next month or day) is past year 9999.
        raise InvalidInputError(field, text, "ends past year 9999") from None


def parse_instant(text: str, field: str) -> datetime:
    """A UTC date-time (``2026-11-03T10:00Z``; no offset means UTC) as an aware datetime."""
    raw = text.strip() if isinstance(text, str) else ""
    try:
        value = datetime.fromisoformat(raw.replace("Z", "+00:00").replace("z", "+00:00"))
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
    except (ValueError, OverflowError):
        raise InvalidInputError(
            field, text, "expected a UTC date or time, e.g. 2026-11-03 or 2026-11-03T10:00Z"
        ) from None
    if value.year < FIRST_YEAR:
        raise InvalidInputError(field, text, f"from {FIRST_YEAR} on")
    return value


def parse_bound(text: str, field: str, *, end: bool) -> datetime:
    """One end of ``--from`` / ``--to``: a month or day covers it whole, a time is the instant.

    ``end=True`` (``--to``): a month or day is included, so the bound is its
    end; ``--to 2026-11-03`` reads through the last second of that day.

    >>> parse_bound("2026-11-03", "--to", end=True).isoformat()
    '2026-11-04T00:00:00+00:00'
    >>> parse_bound("2026-11-03T10:00Z", "--to", end=True).isoformat()
    '2026-11-03T10:00:00+00:00'
    """
    raw = text.strip() if isinstance(text, str) else ""
    if _MONTH.fullmatch(raw) or _DAY.fullmatch(raw):
        return parse_period(text, field)[1 if end else 0]
    return parse_instant(text, field)


def parse_range(start: str | None, end: str | None) -> tuple[datetime | None, datetime | None]:
    """``--from`` / ``--to`` (either may be missing), ``--to`` inclusive of its day.

    >>> lo, hi = parse_range("2026-11-03", "2026-11-03")
    >>> hi - lo
    datetime.timedelta(days=1)
    """
    lo = None if start is None else parse_bound(start, "--from", end=False)
    hi = None if end is None else parse_bound(end, "--to", end=True)
    if lo is not None and hi is not None and hi <= lo:
        raise InvalidInputError("--to", end, f"must be after --from ({start})")
    return lo, hi
