/**
 * Windows and their calendar buckets (Python: windows.py).
 *
 * MINUTE and HOUR buckets are UTC; DAY, WEEK (ISO weeks from Monday 00:00)
 * and MONTH follow the policy's time zone, which is part of the label when
 * not UTC. A MONTH may start on a billing day (`anchor`, 1 to 31; clamped to
 * the last day of shorter months).
 *
 * @example
 * bucketFor(Window.MONTH, 1764442477, zone(null), 15).label  // "202511+15"
 * bucketFor(Window.WEEK, 1764442477, zone("Europe/Berlin")).label  // "2025W48@Europe/Berlin"
 */
import { PolicyError } from "./errors.js";

export const GRACE_SECONDS = 3600;
export const SESSION_TTL_SECONDS = 86_400;
export const SESSION_BUCKET = "session";

/** The period a limit counts over. */
export const Window = {
  MINUTE: "minute",
  HOUR: "hour",
  DAY: "day",
  WEEK: "week",
  MONTH: "month",
  SESSION: "session",
} as const;
export type Window = (typeof Window)[keyof typeof Window];

/** A resolved time zone: UTC, or an IANA zone name. */
export interface Zone {
  readonly name: string | null;
}
export const UTC: Zone = Object.freeze({ name: null });

/** One period of a window: its key label and its bounds in epoch seconds (null: a session). */
export class Bucket {
  constructor(
    readonly label: string,
    readonly start: number | null,
    readonly end: number | null,
  ) {}

  /** The absolute expiry (epoch seconds) a counter in this bucket gets. */
  expireAt(now: number): number {
    if (this.end === null) return Math.ceil(now) + SESSION_TTL_SECONDS;
    return Math.ceil(this.end) + GRACE_SECONDS;
  }

  /** Whole seconds until the bucket ends (at least 1), null for sessions. */
  secondsLeft(now: number): number | null {
    if (this.end === null) return null;
    return Math.max(1, Math.ceil(this.end - now));
  }
}

const formatters = new Map<string, Intl.DateTimeFormat>();

function formatter(name: string): Intl.DateTimeFormat {
  let f = formatters.get(name);
  if (f === undefined) {
    f = new Intl.DateTimeFormat("en-US", {
      timeZone: name,
      hourCycle: "h23",
      year: "numeric",
      month: "numeric",
      day: "numeric",
      hour: "numeric",
      minute: "numeric",
      second: "numeric",
    });
    formatters.set(name, f);
  }
  return f;
}

/** Resolve a policy time zone name; null or "UTC" mean UTC. */
export function zone(name: unknown): Zone {
  if (name === null || name === undefined) return UTC;
  if (typeof name !== "string" || name === "") {
    throw new PolicyError("Policy.timezone", name, "expected an IANA time zone name");
  }
  if (["UTC", "Z", "ETC/UTC"].includes(name.toUpperCase())) return UTC;
  try {
    formatter(name);
  } catch {
    throw new PolicyError("Policy.timezone", name, "unknown IANA time zone");
  }
  return Object.freeze({ name });
}

interface Wall {
  y: number;
  m: number;
  d: number;
  H: number;
  M: number;
  S: number;
}

function wall(tz: Zone, epochSeconds: number): Wall {
  if (tz.name === null) {
    const t = new Date(epochSeconds * 1000);
    return {
      y: t.getUTCFullYear(),
      m: t.getUTCMonth() + 1,
      d: t.getUTCDate(),
      H: t.getUTCHours(),
      M: t.getUTCMinutes(),
      S: t.getUTCSeconds(),
    };
  }
  const parts: Record<string, number> = {};
  for (const p of formatter(tz.name).formatToParts(new Date(epochSeconds * 1000))) {
    if (p.type !== "literal") parts[p.type] = Number(p.value);
  }
  return {
    y: parts["year"] ?? 0,
    m: parts["month"] ?? 0,
    d: parts["day"] ?? 0,
    H: parts["hour"] ?? 0,
    M: parts["minute"] ?? 0,
    S: parts["second"] ?? 0,
  };
}

/** The zone's UTC offset (seconds east) at an instant. */
function offsetAt(tz: Zone, epochSeconds: number): number {
  if (tz.name === null) return 0;
  const w = wall(tz, epochSeconds);
  return Date.UTC(w.y, w.m - 1, w.d, w.H, w.M, w.S) / 1000 - Math.floor(epochSeconds);
}

/**
 * The instant of local midnight of a day in `tz`, as Python's
 * `datetime(y, m, d, tzinfo=ZoneInfo(...)).timestamp()` (fold=0: in a gap or
 * an overlap, the offset in force before the transition).
 */
function midnight(y: number, m: number, d: number, tz: Zone): number {
  const local = Date.UTC(y, m - 1, d) / 1000;
  if (tz.name === null) return local;
  const before = offsetAt(tz, local - 86_400);
  const after = offsetAt(tz, local + 86_400);
  const t1 = local - before;
  if (before === after || offsetAt(tz, t1) === before) return t1;
  const t2 = local - after;
  return offsetAt(tz, t2) === after ? t2 : t1;
}

const pad = (n: number, width = 2): string => String(n).padStart(width, "0");

function daysIn(y: number, m: number): number {
  return new Date(Date.UTC(y, m, 0)).getUTCDate();
}

function clamped(y: number, m: number, anchor: number): number {
  return Math.min(anchor, daysIn(y, m));
}

/** ISO year and week of a (proleptic Gregorian) date. */
function isoWeek(y: number, m: number, d: number): [number, number] {
  const t = new Date(Date.UTC(y, m - 1, d));
  const dow = (t.getUTCDay() + 6) % 7; // Monday 0
  t.setUTCDate(t.getUTCDate() - dow + 3); // Thursday of this week
  const year = t.getUTCFullYear();
  const jan4 = new Date(Date.UTC(year, 0, 4));
  const jan4dow = (jan4.getUTCDay() + 6) % 7;
  const week1Thursday = Date.UTC(year, 0, 4 - jan4dow + 3);
  return [year, 1 + Math.round((t.getTime() - week1Thursday) / (7 * 86_400_000))];
}

const utcCache = new Map<string, Bucket>();
const calendarCache = new Map<string, Bucket>();

function utcBucket(start: number, length: number, hour: boolean): Bucket {
  const cacheKey = `${start}:${length}`;
  let b = utcCache.get(cacheKey);
  if (b === undefined) {
    const t = new Date(start * 1000);
    const day = `${pad(t.getUTCFullYear(), 4)}${pad(t.getUTCMonth() + 1)}${pad(t.getUTCDate())}`;
    const label = `${day}T${pad(t.getUTCHours())}` + (hour ? "" : pad(t.getUTCMinutes()));
    b = new Bucket(label, start, start + length);
    if (utcCache.size > 4096) utcCache.clear();
    utcCache.set(cacheKey, b);
  }
  return b;
}

function calendarBucket(window: Window, minute: number, tz: Zone, anchor: number): Bucket {
  const cacheKey = `${window}:${minute}:${tz.name ?? ""}:${anchor}`;
  const hit = calendarCache.get(cacheKey);
  if (hit !== undefined) return hit;
  const w = wall(tz, minute * 60);
  let label: string;
  let start: number;
  let next: number;
  if (window === Window.DAY) {
    start = midnight(w.y, w.m, w.d, tz);
    const t = new Date(Date.UTC(w.y, w.m - 1, w.d + 1));
    next = midnight(t.getUTCFullYear(), t.getUTCMonth() + 1, t.getUTCDate(), tz);
    label = `${pad(w.y, 4)}${pad(w.m)}${pad(w.d)}`;
  } else if (window === Window.WEEK) {
    const dow = (new Date(Date.UTC(w.y, w.m - 1, w.d)).getUTCDay() + 6) % 7;
    const mon = new Date(Date.UTC(w.y, w.m - 1, w.d - dow));
    const sun = new Date(Date.UTC(w.y, w.m - 1, w.d - dow + 7));
    start = midnight(mon.getUTCFullYear(), mon.getUTCMonth() + 1, mon.getUTCDate(), tz);
    next = midnight(sun.getUTCFullYear(), sun.getUTCMonth() + 1, sun.getUTCDate(), tz);
    const [iy, iw] = isoWeek(mon.getUTCFullYear(), mon.getUTCMonth() + 1, mon.getUTCDate());
    label = `${pad(iy, 4)}W${pad(iw)}`;
  } else {
    let y = w.y;
    let m = w.m;
    if (w.d < clamped(y, m, anchor)) {
      if (m === 1) {
        y -= 1;
        m = 12;
      } else m -= 1;
    }
    start = midnight(y, m, clamped(y, m, anchor), tz);
    const [ny, nm] = m === 12 ? [y + 1, 1] : [y, m + 1];
    next = midnight(ny, nm, clamped(ny, nm, anchor), tz);
    label = `${pad(y, 4)}${pad(m)}` + (anchor === 1 ? "" : `+${pad(anchor)}`);
  }
  const b = new Bucket(label + (tz.name === null ? "" : `@${tz.name}`), start, next);
  if (calendarCache.size > 4096) calendarCache.clear();
  calendarCache.set(cacheKey, b);
  return b;
}

/** The bucket of `window` that contains the instant `now` (epoch seconds). */
export function bucketFor(window: Window, now: number, tz: Zone = UTC, anchor = 1): Bucket {
  switch (window) {
    case Window.SESSION:
      return new Bucket(SESSION_BUCKET, null, null);
    case Window.MINUTE:
      return utcBucket(Math.floor(now / 60) * 60, 60, false);
    case Window.HOUR:
      return utcBucket(Math.floor(now / 3600) * 3600, 3600, true);
    default:
      return calendarBucket(window, Math.floor(now / 60), tz, window === Window.MONTH ? anchor : 1);
  }
}

/** A billing day: a whole number from 1 to 31, else a PolicyError naming `field`. */
export function checkAnchor(value: unknown, field: string): number {
  if (typeof value !== "number" || !Number.isInteger(value) || value < 1 || value > 31) {
    throw new PolicyError(
      field,
      value,
      "expected a day of the month from 1 to 31 (29-31 start on the last day of shorter months)",
    );
  }
  return value;
}
