/**
 * An approval over an OnExceed.ASK limit, spent once, by the caller it was
 * given to (Python: mcp_budget_governor/approval.py). A 2026-07-28 client's
 * approval travels in the requestState sealed with the question:
 * approvalText() is what is sealed (the limit, a digest of the caller identify()
 * produced, a one-time id, when it lapses); on the retry openApproval() gives it
 * back only to the same caller before it lapses, and the governor charges its
 * marker (spendOp, cap 1) in the same atomic charge as the admission it allows:
 * a second use, by anyone, is refused like an unapproved call.
 */
import { createHash, randomBytes } from "node:crypto";

import { contextKey, type Context } from "./context.js";
import { SPENT_PREFIX } from "./keys.js";
import type { CounterOp } from "./planning.js";

/** The approved limit, its one-time id and when it lapses (epoch seconds). */
export interface Approval {
  readonly limit: string;
  readonly once: string;
  readonly until: number;
}

/** The sealed text's version: any other shape (an older release's bare limit) opens to nothing. */
const VERSION = "mcpbg2";
const ONCE = /^[0-9a-f]{32}$/;

/** A digest of every field of `caller`: equal for the same caller and tool only. */
export function callerKey(caller: Context): string {
  return createHash("sha256").update(contextKey(caller)).digest("hex");
}

/** The text to seal into the question's requestState: `ttl` seconds to answer. */
export function approvalText(limit: string, caller: Context, now: number, ttl: number): string {
  return JSON.stringify([VERSION, limit, callerKey(caller), randomBytes(16).toString("hex"), Math.floor(now + ttl)]);
}

/** The approval `text` carries for `caller` at `now` (epoch seconds); null for another shape, caller, or a lapsed one. */
export function openApproval(text: unknown, caller: Context, now: number): Approval | null {
  if (typeof text !== "string" || !text.startsWith(`["${VERSION}"`)) return null;
  let parts: unknown;
  try {
    parts = JSON.parse(text);
  } catch {
    return null;
  }
  if (!Array.isArray(parts) || parts.length !== 5) return null;
  const [, limit, key, once, until] = parts as unknown[];
  if (typeof limit !== "string" || key !== callerKey(caller) || typeof once !== "string" || !ONCE.test(once)) return null;
  if (typeof until !== "number" || !Number.isSafeInteger(until) || !(now < until)) return null;
  return { limit, once, until };
}

/**
 * The marker an admission spends: cap 1, so it fits once; it lives until the
 * approval lapses. `lead`: seconds the store's clock runs ahead of the real one
 * (a governor's simulated clock), so the marker outlives the approval there too.
 */
export function spendOp(approval: Approval, lead = 0): CounterOp {
  const expireAt = approval.until + 1 + Math.ceil(Math.max(lead, 0));
  return { key: `${SPENT_PREFIX}:${approval.once}`, amount: 1, cap: 1, enforce: true, expireAt, ref: null };
}
