/**
 * Counter keys: `mcpbg:v1:<limit>:<scope>:<bucket>` (Python: keys.py).
 *
 * Scope values are percent-encoded (everything except `A-Z a-z 0-9 _ . -`
 * becomes `%XX` of its UTF-8 bytes); a value longer than MAX_VALUE_CHARS
 * (code points, as Python counts) or whose encoding would be, becomes `#` and
 * its SHA-256. The conformance vectors pin every character of this scheme.
 *
 * @example
 * counterKey("burst", scopeSegment(["user"], ["a:b"]), "20261129T1914")
 * // "mcpbg:v1:burst:user=a%3Ab:20261129T1914"
 */
import { createHash } from "node:crypto";

import type { ScopeName } from "./context.js";
import { SESSION_BUCKET } from "./windows.js";

export const PREFIX = "mcpbg:v1";
export const GLOBAL_SCOPE = "global";
export const MAX_VALUE_CHARS = 192;

/** The separators of the key scheme: one home, so a test can prove each is pinned. */
export interface Separators {
  /** Between the prefix, the limit, the scope and the bucket. */
  readonly segment: string;
  /** Between the dimensions of a composite scope. */
  readonly dimension: string;
  /** Between a dimension and its value. */
  readonly pair: string;
}

export const SEPARATORS: Separators = { segment: ":", dimension: ",", pair: "=" };

const SAFE = new Uint8Array(256);
for (const ch of "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-") SAFE[ch.charCodeAt(0)] = 1;
const HEX = "0123456789ABCDEF";
const encoder = new TextEncoder();

function hashed(raw: Uint8Array): string {
  return "#" + createHash("sha256").update(raw).digest("hex");
}

function codePoints(value: string): number {
  let n = 0;
  for (let i = 0; i < value.length; i++) {
    const c = value.charCodeAt(i);
    if (c >= 0xd800 && c <= 0xdbff && i + 1 < value.length) {
      const d = value.charCodeAt(i + 1);
      if (d >= 0xdc00 && d <= 0xdfff) i++;
    }
    n++;
  }
  return n;
}

/** Encode one scope value for a key segment: escape("a:b{c}") === "a%3Ab%7Bc%7D". */
export function escape(value: string): string {
  const raw = encoder.encode(value);
  if (codePoints(value) > MAX_VALUE_CHARS) return hashed(raw);
  let plain = true;
  for (const b of raw) {
    if (!SAFE[b]) {
      plain = false;
      break;
    }
  }
  if (plain) return value;
  let out = "";
  for (const b of raw) out += SAFE[b] ? String.fromCharCode(b) : "%" + HEX[b >> 4] + HEX[b & 15];
  return out.length > MAX_VALUE_CHARS ? hashed(raw) : out;
}

/** Builds keys with a given set of separators (the package uses SEPARATORS). */
export class KeyBuilder {
  constructor(readonly sep: Separators = SEPARATORS) {}

  /** `user=alice` or `tenant=acme,tool=search`; `global` for no scope. */
  scopeSegment(dims: readonly ScopeName[], values: readonly string[]): string {
    if (dims.length === 0) return GLOBAL_SCOPE;
    return dims.map((d, i) => `${d}${this.sep.pair}${escape(values[i] ?? "")}`).join(this.sep.dimension);
  }

  /** The Redis key of one counter. */
  counterKey(limit: string, scope: string, bucket: string): string {
    const s = this.sep.segment;
    return `${PREFIX}${s}${limit}${s}${scope}${s}${bucket}`;
  }

  /** The sorted set of one concurrency cap's leases for one scope value. */
  leaseKey(limit: string, scope: string): string {
    const s = this.sep.segment;
    return `${PREFIX}${s}_lease${s}${limit}${s}${scope}`;
  }

  /** The run-time caps hash of a limit (caps.caps_key). */
  capsKey(limit: string): string {
    return `${PREFIX}${this.sep.segment}_caps${this.sep.segment}${limit}`;
  }

  /** The marker of an applied inline charge (keys.op_key). */
  opKey(opId: string): string {
    return `${PREFIX}${this.sep.segment}_op${this.sep.segment}${opId}`;
  }
}

export const KEYS = new KeyBuilder();

export const scopeSegment = (dims: readonly ScopeName[], values: readonly string[]): string =>
  KEYS.scopeSegment(dims, values);
export const counterKey = (limit: string, scope: string, bucket: string): string =>
  KEYS.counterKey(limit, scope, bucket);
export const leaseKey = (limit: string, scope: string): string => KEYS.leaseKey(limit, scope);
export const capsKey = (limit: string): string => KEYS.capsKey(limit);
export const opKey = (opId: string): string => KEYS.opKey(opId);

/** A session counter's key ends so (scope values are escaped: the last segment is the bucket). */
export const SESSION_SUFFIX = `:${SESSION_BUCKET}`;

/** Whether a counter's expiry slides with each write (a session's); lua/charge.lua flag 's'. */
export function slides(key: string): boolean {
  return key.endsWith(SESSION_SUFFIX);
}

export const LEASE_PREFIX = `${PREFIX}:_lease`;

/** Where calls waiting for a slot of a lease set queue (Python: keys.queue_key): the
 * lease set is its hash tag, so both share one Redis Cluster slot. */
export const QUEUE_PREFIX = `${PREFIX}:_wait`;

export function queueKey(leaseSet: string): string {
  return `${QUEUE_PREFIX}:{${leaseSet}}`;
}
export const EPOCH_KEY = `${PREFIX}:_epoch`;
export const PLANS_KEY = `${PREFIX}:_plans`;
/** The key of the SDK middleware's default approval seal, shared by every replica on
 * this Redis (Python: keys.APPROVAL_KEY): 64 hex digits, created once with SET NX. */
export const APPROVAL_KEY = `${PREFIX}:_approval`;
/** Prefix of the markers of spent approvals (Python: keys.SPENT_PREFIX; approval.ts spendOp). */
export const SPENT_PREFIX = `${PREFIX}:_spent`;
