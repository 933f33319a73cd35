/**
 * Ledger events: a `LedgerEntry` as the exact CloudEvent JSON line the Python ledger
 * writes (`mcp_budget_governor.events.encode`): the same keys in the same order, the
 * same escaping, the same time format (microseconds, rounded half to even), so a
 * Python worker projects TypeScript events as its own. `conformance/events.json`
 * holds the Python side's bytes; `ts/test/ledgerEvents.test.ts` checks these against
 * them and against the JSON Schema `mcpbg schema` prints.
 *
 * @example
 * encode({ id: newId(), type: "admitted", time: 1764442477, context: { user: "u_42" } },
 *        "/mcpbg/doc");
 * // '{"specversion":"1.0","id":"…","source":"/mcpbg/doc","type":"mcpbg.admitted.v1",…}'
 */

import { randomFillSync } from "node:crypto";

import type { Amount, EntryType, LedgerCharge, LedgerContext, LedgerEntry } from "./types.js";

export const SPECVERSION = "1.0";
export const CONTENT_TYPE = "application/json";
export const SCHEMA_VERSION = "v1";

/** Python's `money.MAX_AMOUNT`: every amount fits a double exactly. */
const MAX_AMOUNT = 2n ** 53n - 1n;

/** A ledger entry that cannot be encoded; `field` and `value` say which and why. */
export class LedgerEncodeError extends TypeError {
  constructor(
    readonly field: string,
    readonly value: unknown,
    reason: string,
  ) {
    super(`ledger entry: ${field}: ${reason} (got ${String(value)})`);
    this.name = "LedgerEncodeError";
  }
}

/** `mcpbg.metered.v1` for `"metered"`. */
export function typeName(kind: EntryType): string {
  return `mcpbg.${kind}.${SCHEMA_VERSION}`;
}

function roundHalfEven(x: number): number {
  const r = Math.round(x); // half up
  return r - x === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

/**
 * Epoch seconds as the RFC 3339 UTC time of a CloudEvent, to the microsecond: the
 * same digits as Python's `events.rfc3339` (floor, then the fraction rounded half to
 * even, as Python's `round`).
 *
 * @example rfc3339(1764442477.25) // "2025-11-29T18:54:37.250000Z"
 */
export function rfc3339(epoch: number): string {
  if (!Number.isFinite(epoch)) throw new LedgerEncodeError("time", epoch, "expected epoch seconds");
  let whole = Math.floor(epoch);
  let micros = roundHalfEven((epoch - whole) * 1_000_000);
  if (micros === 1_000_000) {
    whole += 1;
    micros = 0;
  }
  const second = new Date(whole * 1000).toISOString().slice(0, 19);
  return `${second}.${String(micros).padStart(6, "0")}Z`;
}

function str(value: string | null | undefined): string {
  return value == null ? "null" : JSON.stringify(value);
}

function int(value: Amount | undefined, field: string, fallback = 0): string {
  if (value === undefined) return String(fallback);
  if (typeof value === "bigint") {
    if (value > MAX_AMOUNT || value < -MAX_AMOUNT) {
      throw new LedgerEncodeError(field, value, "expected an integer within +-(2^53 - 1)");
    }
    return value.toString();
  }
  if (!Number.isSafeInteger(value)) {
    throw new LedgerEncodeError(field, value, "expected a whole number within +-(2^53 - 1)");
  }
  return String(value);
}

function strings(values: readonly string[] | undefined): string {
  return values === undefined || values.length === 0 ? "[]" : JSON.stringify(values);
}

const SUBJECT_DIMS = ["user", "tenant", "agent", "session", "tool"] as const;

/** The event's `subject`: the first known of user, tenant, agent, session, tool. */
export function subject(ctx: LedgerContext): string | null {
  for (const dim of SUBJECT_DIMS) {
    const value = ctx[dim];
    if (value != null) return `${dim}/${value}`;
  }
  return null;
}

const subjectCache = new WeakMap<LedgerContext, string>();

function subjectOf(ctx: LedgerContext): string {
  let json = subjectCache.get(ctx);
  if (json === undefined) {
    json = str(subject(ctx));
    subjectCache.set(ctx, json);
  }
  return json;
}

function contextJson(ctx: LedgerContext): string {
  let out =
    `{"user":${str(ctx.user)},"tenant":${str(ctx.tenant)},"tool":${str(ctx.tool)},` +
    `"session":${str(ctx.session)},"agent":${str(ctx.agent)}`;
  // Written only when set, as in Python: older events read the same.
  if (ctx.sessionRoot != null) out += `,"session_root":${JSON.stringify(ctx.sessionRoot)}`;
  if (ctx.call != null) out += `,"call":${JSON.stringify(ctx.call)}`;
  return out + "}";
}

// The context and the charges of a hot caller repeat call after call (a governor reuses
// one plan per context and minute), so their JSON is made once per object: entries,
// their contexts and their charge arrays are immutable once appended (readonly types).
const contextCache = new WeakMap<LedgerContext, string>();
const chargesCache = new WeakMap<readonly LedgerCharge[], string>();
const NO_CHARGES: readonly LedgerCharge[] = [];

function contextOf(ctx: LedgerContext): string {
  let json = contextCache.get(ctx);
  if (json === undefined) {
    json = contextJson(ctx);
    contextCache.set(ctx, json);
  }
  return json;
}

function chargesOf(charges: readonly LedgerCharge[]): string {
  let json = chargesCache.get(charges);
  if (json !== undefined) return json;
  json = "[";
  for (let i = 0; i < charges.length; i++) {
    const c = charges[i]!;
    if (i > 0) json += ",";
    json +=
      `{"limit":${JSON.stringify(c.limit)},"unit":${JSON.stringify(c.unit)},` +
      `"amount":${int(c.amount, `charges[${i}].amount`)},"window":${JSON.stringify(c.window)},` +
      `"bucket":${JSON.stringify(c.bucket)},"key":${JSON.stringify(c.key)},` +
      `"expire_at":${int(c.expireAt, `charges[${i}].expireAt`)}}`;
  }
  json += "]";
  chargesCache.set(charges, json);
  return json;
}

/**
 * One structured-mode CloudEvent as compact JSON (a string; UTF-8 on the wire), byte
 * for byte what Python's `events.encode(entry, source)` writes.
 */
export function encode(entry: LedgerEntry, source: string): string {
  const chargesJson = chargesOf(entry.charges ?? NO_CHARGES);
  let decision =
    `{"limit":${str(entry.limit)},"status":${int(entry.status, "status", 200)},` +
    `"over":${strings(entry.over)},"degraded":${entry.degraded === true ? "true" : "false"}`;
  if (entry.approved !== undefined && entry.approved.length > 0) {
    decision += `,"approved":${JSON.stringify(entry.approved)}`; // only when any, as in Python
    if (entry.spent !== undefined && entry.spent.length > 0) {
      const spent = entry.spent.map((s) => ({ limit: s.limit, once: s.once, until: s.until }));
      decision += `,"spent":${JSON.stringify(spent)}`;
    }
  }
  decision += "}";
  const u = entry.usage;
  const usage =
    u == null
      ? "null"
      : `{"model":${JSON.stringify(u.model)},"input_tokens":${int(u.inputTokens, "usage.inputTokens")},` +
        `"output_tokens":${int(u.outputTokens, "usage.outputTokens")},` +
        `"cache_read_tokens":${int(u.cacheReadTokens, "usage.cacheReadTokens")},` +
        `"cache_write_tokens":${int(u.cacheWriteTokens, "usage.cacheWriteTokens")},` +
        `"price_version":${str(u.priceVersion)}}`;
  let data =
    `{"context":${contextOf(entry.context)},"charges":${chargesJson},"decision":${decision},` +
    `"usage":${usage},"reservation":${str(entry.reservation)}`;
  const ch = entry.change;
  if (ch != null) {
    // Only run-time changes carry one: other events keep their bytes.
    data +=
      `,"change":{"limit":${JSON.stringify(ch.limit)},"key":${JSON.stringify(ch.key)},` +
      `"field":${JSON.stringify(ch.field ?? "")},"amount":${int(ch.amount, "change.amount")},` +
      `"until":${int(ch.until, "change.until")},"plan":${str(ch.plan)},` +
      `"actor":${JSON.stringify(ch.actor ?? "")},"reason":${JSON.stringify(ch.reason ?? "")}}`;
  }
  data += "}";
  return (
    `{"specversion":"${SPECVERSION}","id":${JSON.stringify(entry.id)},"source":${JSON.stringify(source)},` +
    `"type":"${typeName(entry.type)}","time":"${rfc3339(entry.time)}","subject":${subjectOf(entry.context)},` +
    `"datacontenttype":"${CONTENT_TYPE}","data":${data}}`
  );
}

/**
 * The ledger's partition key (the Kafka record key): the tenant, else the user, else
 * `-`, as UTF-8, so one scope stays in order (Python's `ledger.partition_key`).
 */
export function partitionKey(ctx: LedgerContext): Buffer {
  const scope = ctx.tenant ?? ctx.user;
  return Buffer.from(scope == null ? "-" : scope, "utf8");
}

const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    table[n] = c >>> 0;
  }
  return table;
})();

/** CRC-32 (IEEE, as Python's `zlib.crc32`), unsigned. */
export function crc32(data: Uint8Array): number {
  let c = 0xffffffff;
  for (const byte of data) c = CRC_TABLE[(c ^ byte) & 0xff]! ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

/** The partition (an index into the sorted partition ids) of a record's key. */
export function partitionOf(key: Uint8Array, partitions: number): number {
  return crc32(key) % partitions;
}

let lastMs = -1;
let sequence = 0;
const pool = Buffer.alloc(10 * 512);
let poolAt = pool.length;
// Ids are made on the hot path (every inline check's operation id): hex by table,
// and the millisecond's 14 characters ("xxxxxxxx-xxxx-") reused within it.
const HEX = Array.from({ length: 256 }, (_, b) => b.toString(16).padStart(2, "0"));
let textMs = -1;
let msText = "";

/**
 * A time-ordered UUIDv7 (RFC 9562): 48 bits of Unix milliseconds, then a 12-bit
 * counter that keeps ids made in one millisecond in order (seeded at random each
 * millisecond), then 62 random bits.
 */
export function newId(now: number = Date.now()): string {
  if (poolAt + 10 > pool.length) {
    randomFillSync(pool);
    poolAt = 0;
  }
  const r = poolAt;
  poolAt += 10;
  let ms = Math.max(Math.floor(now), lastMs);
  if (ms === lastMs) {
    sequence += 1;
    if (sequence > 0xfff) {
      ms += 1; // the counter ran out: borrow the next millisecond
      sequence = ((pool[r]! << 8) | pool[r + 1]!) & 0x7ff;
    }
  } else {
    sequence = ((pool[r]! << 8) | pool[r + 1]!) & 0x7ff; // room left to count up
  }
  lastMs = ms;
  if (ms !== textMs) {
    const h = ms.toString(16).padStart(12, "0");
    msText = `${h.slice(0, 8)}-${h.slice(8, 12)}-`;
    textMs = ms;
  }
  return (
    msText +
    (0x7000 | sequence).toString(16) +
    "-" +
    HEX[(pool[r + 2]! & 0x3f) | 0x80]! +
    HEX[pool[r + 3]!]! +
    "-" +
    HEX[pool[r + 4]!]! +
    HEX[pool[r + 5]!]! +
    HEX[pool[r + 6]!]! +
    HEX[pool[r + 7]!]! +
    HEX[pool[r + 8]!]! +
    HEX[pool[r + 9]!]!
  );
}

/** When a UUIDv7 was made (epoch seconds, to the millisecond); null if not a UUIDv7. */
export function idTime(eventId: string): number | null {
  const digits = eventId.replaceAll("-", "");
  if (digits.length !== 32 || digits[12] !== "7" || !/^[0-9a-fA-F]+$/.test(digits)) return null;
  return parseInt(digits.slice(0, 12), 16) / 1000;
}
