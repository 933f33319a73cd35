/**
 * Pure rules of a call: which counters it touches and what the answer is
 * (Python: planning.py). No I/O: the governor feeds in the clock and what the
 * backend returned.
 *
 * @example
 * checkPlan(policy, context({ user: "u_42" }), Date.now() / 1000).ops[0]?.key
 * // "mcpbg:v1:burst:user=u_42:20261129T1914"
 */
import { type Context, scopeValues } from "./context.js";
import { Decision, EXCEEDED, LEDGER_UNAVAILABLE, UNAVAILABLE, type MeterResult } from "./decision.js";
import { InvalidInputError } from "./errors.js";
import type { LedgerCharge, LedgerUnit, LedgerWindow } from "./ledger/types.js";
import { counterKey, leaseKey, scopeSegment } from "./keys.js";
import { type CapRef, type Limit, OnExceed, type Policy } from "./policy.js";
import { Bucket, bucketFor, type Zone } from "./windows.js";

/** The bucket of a concurrency cap's leases: no period, no end. */
export const LEASE_BUCKET = new Bucket("lease", null, null);

/** One counter touched by an atomic charge (counters.CounterOp). */
export interface CounterOp {
  readonly key: string;
  readonly amount: number;
  readonly cap: number;
  readonly enforce: boolean;
  readonly expireAt: number;
  readonly ref: CapRef | null;
}

/** One limit's counter for one call, and what the call does to it. */
export interface Slot {
  readonly limit: Limit;
  readonly key: string;
  readonly bucket: Bucket;
  readonly amount: number;
  readonly enforce: boolean;
  readonly expireAt: number;
  readonly ref: CapRef | null;
}

/** A signed amount charged to one counter, as the ledger records it. */
/** What a slot charges, as the ledger records it (ledger/types.ts). */
export type LedgerChargeFields = LedgerCharge;

export function opOf(s: Slot): CounterOp {
  return { key: s.key, amount: s.amount, cap: s.limit.cap, enforce: s.enforce, expireAt: s.expireAt, ref: s.ref };
}

/** The admission rule: a zero charge needs one unit of room. */
export function fits(used: number, amount: number, cap: number): boolean {
  return used + Math.max(amount, 1) <= cap;
}

/** The counter of `limit` for `ctx` at `now`; null if ctx lacks the scope. */
export function slot(
  limit: Limit,
  ctx: Context,
  now: number,
  tz: Zone,
  amount: number,
  enforce: boolean,
  policy: Policy | null = null,
): Slot | null {
  if (limit.tools.length && !limit.appliesTo(ctx.tool)) return null;
  const values = scopeValues(limit.dimensions, ctx);
  if (values === null) return null;
  const segment = scopeSegment(limit.dimensions, values);
  const ref = policy === null ? null : policy.capRef(limit, segment, values);
  if (limit.concurrent) {
    return { limit, key: leaseKey(limit.name, segment), bucket: LEASE_BUCKET, amount: 1, enforce, expireAt: 0, ref };
  }
  const bucket = bucketFor(limit.window ?? "session", now, tz, limit.anchorFor(values));
  return {
    limit,
    key: counterKey(limit.name, segment, bucket.label),
    bucket,
    amount,
    enforce,
    expireAt: bucket.expireAt(now),
    ref,
  };
}

export function withAmount(s: Slot, amount: number): Slot {
  return { ...s, amount, enforce: false };
}

export function ledgerCharges(slots: readonly Slot[]): LedgerChargeFields[] {
  return slots
    .filter((s) => s.amount !== 0 && !s.limit.concurrent)
    .map((s) => ({
      limit: s.limit.name,
      unit: s.limit.unit as LedgerUnit, // concurrency caps were filtered out above
      amount: s.amount,
      window: (s.limit.window ?? "") as LedgerWindow,
      bucket: s.bucket.label,
      key: s.key,
      expireAt: s.expireAt,
    }));
}

/** What a check does for one context within one minute: its slots and their ops. */
export interface Plan {
  readonly slots: readonly Slot[];
  readonly ops: readonly CounterOp[];
  readonly shadow: boolean;
  readonly charges: readonly LedgerChargeFields[];
  readonly leases: readonly string[];
  /** How many of the last slots charge the call's fixed price (withPrice): the cost event's. */
  readonly cost: number;
  /** The cost event's ledger charges. */
  readonly costCharges: readonly LedgerChargeFields[];
  /** The cost slots reserve a hard cap's estimates (a `reserved` event), not a price. */
  readonly holds: boolean;
  /** The one-time approval the plan's admission spends (its marker is the last op). */
  readonly spends?: { readonly limit: string; readonly once: string; readonly until: number };
}

export function planOf(slots: readonly Slot[]): Plan {
  return Object.freeze({
    slots,
    ops: slots.map(opOf),
    shadow: slots.some((s) => !s.enforce),
    charges: ledgerCharges(slots),
    leases: slots.filter((s) => s.limit.concurrent).map((s) => s.key),
    cost: 0,
    costCharges: [],
    holds: false,
  });
}

/**
 * `plan` that also charges a call's fixed price (`price`: meterSlots) in the same
 * all-or-nothing charge, as the slots of a second (cost) event (Python:
 * planning.with_price). A priced limit the check consults refuses a price that
 * does not fit, as the check would (the price replaces the check's read of it);
 * a metered-only limit is charged without refusing, as a meter would. So
 * concurrent calls never take a consulted limit past its cap. `hold`: the slots
 * are a hard cap's estimates (a `reserved` event), which every limit that
 * refuses enforces, as a reservation does.
 */
export function withPrice(plan: Plan, price: readonly Slot[], hold = false): Plan {
  if (!price.length) return plan;
  const checked = new Map(plan.slots.filter((s) => !s.limit.concurrent).map((s) => [s.key, s]));
  const priced = price.map((p) => ({ ...p, enforce: hold ? enforces(p.limit) : (checked.get(p.key)?.enforce ?? false) }));
  const read = new Set(priced.filter((p) => checked.get(p.key)?.amount === 0).map((p) => p.key));
  const kept = plan.slots.filter((s) => !read.has(s.key));
  const slots = [...kept, ...priced];
  return Object.freeze({
    slots,
    ops: slots.map(opOf),
    shadow: kept.some((s) => !s.enforce),
    charges: ledgerCharges(kept),
    leases: plan.leases,
    cost: priced.length,
    costCharges: ledgerCharges(priced),
    holds: hold,
  });
}

/** Whether `limit` refuses when exceeded (DENY, and ASK until approved). */
export function enforces(limit: Limit): boolean {
  return limit.onExceed !== OnExceed.ALERT;
}

/** Every counter a check consults: gated limits (charged) and breakers (read). */
export function checkPlan(
  policy: Policy,
  ctx: Context,
  now: number,
  calls = 1,
  approved: ReadonlySet<string> = new Set(),
): Plan {
  const out: Slot[] = [];
  for (const limit of policy.limits) {
    if (!(limit.gated || limit.breaker)) continue;
    const enforce = enforces(limit) && !approved.has(limit.name);
    const s = slot(limit, ctx, now, policy.tz, limit.checkCharge * calls, enforce, policy);
    if (s !== null) out.push(s);
  }
  return planOf(out);
}

/** The limit `name` as something a meter, reserve or settle may charge. */
export function meteredLimit(policy: Policy, name: string): Limit {
  const lim = policy.get(name);
  if (lim.concurrent) {
    throw new InvalidInputError("limit", name, "is a concurrency cap: it holds calls in progress, nothing is metered");
  }
  return lim;
}

/** The limits a meter names: one name, or several charged by the same event. */
export function namedLimits(policy: Policy, limit: string | readonly string[]): Limit[] {
  const names = typeof limit === "string" ? [limit] : [...limit];
  if (!names.length) throw new InvalidInputError("limit", limit, "name at least one limit");
  if (new Set(names).size !== names.length) throw new InvalidInputError("limit", limit, "names a limit twice");
  return names.map((n) => meteredLimit(policy, n));
}

/** The counters one metered event charges: each limit whose scope `ctx` supplies. */
export function meterSlots(charges: readonly (readonly [Limit, number])[], ctx: Context, now: number, policy: Policy): Slot[] {
  const out: Slot[] = [];
  for (const [limit, amount] of charges) {
    const s = slot(limit, ctx, now, policy.tz, amount, false, policy);
    if (s !== null) out.push(s);
  }
  return out;
}

/** The result of charging `s`, given its total before (null: no counter answered). */
export function metered(s: Slot, before: number | null, degraded = false, cap: number | null = null): MeterResult {
  if (before === null) {
    return { within: true, total: 0, crossed: false, charged: s.amount, limit: s.limit.name, degraded };
  }
  const c = cap ?? s.limit.cap;
  const total = before + s.amount;
  const within = fits(total, 0, c);
  const crossed = !within && fits(before, 0, c);
  return { within, total, crossed, charged: s.amount, limit: s.limit.name, degraded };
}

/** `budget_exceeded:user/day`: what an agent reads in a refusal. */
export function reason(limit: Limit, prefix = EXCEEDED): string {
  return `${prefix}:${limit.scopeLabel}/${limit.windowLabel}`;
}

/** Per slot, what can still be charged before its limit is exhausted. */
export function headroom(
  slots: readonly Slot[],
  used: readonly number[],
  charged: boolean,
  caps: readonly number[] = [],
): Record<string, number> {
  const out: Record<string, number> = {};
  slots.forEach((s, i) => {
    const cap = caps.length ? (caps[i] ?? 0) : s.limit.cap;
    out[s.limit.name] = Math.max(cap - (used[i] ?? 0) - (charged ? s.amount : 0), 0);
  });
  return out;
}

/** The decision when `s` refuses a call. */
export function refused(
  s: Slot,
  now: number,
  degraded = false,
  remaining: Record<string, number> = {},
): Decision {
  const status = s.limit.refusalStatus;
  const left = s.limit.concurrent ? 1 : s.bucket.secondsLeft(now);
  return new Decision({
    admitted: false,
    limit: s.limit.name,
    status,
    retryAfter: status === 402 ? null : left,
    resetsAt: s.bucket.end,
    reason: reason(s.limit),
    degraded,
    remaining,
  });
}

/** A fail-closed limit whose counters cannot be reached: 503, try again soon. */
export function unavailable(s: Slot, retryAfter: number): Decision {
  return new Decision({
    admitted: false,
    limit: s.limit.name,
    status: 503,
    retryAfter: Math.max(1, Math.ceil(retryAfter)),
    reason: reason(s.limit, UNAVAILABLE),
    degraded: true,
  });
}

/**
 * The store is up but overloaded (BackendBusyError): 503, nothing charged, no limit
 * blamed and no fail mode applied; the reason reads "budget_unavailable:<store> busy".
 */
export function busy(store: string, retryAfter: number): Decision {
  return new Decision({
    admitted: false,
    status: 503,
    retryAfter: Math.max(1, Math.ceil(retryAfter)),
    reason: `${UNAVAILABLE}:${store} busy`,
  });
}

/** The ledger cannot record new work: 503, nothing charged. */
export function ledgerFull(retryAfter: number): Decision {
  return new Decision({
    admitted: false,
    status: 503,
    retryAfter: Math.max(1, Math.ceil(retryAfter)),
    reason: LEDGER_UNAVAILABLE,
    degraded: true,
  });
}

/** The decision for an admitted call, naming shadow limits it went over, with each limit's headroom. */
export function admitted(
  slots: readonly Slot[],
  used: readonly number[],
  degraded = false,
  caps: readonly number[] = [],
): Decision {
  if (!used.length) return new Decision({ admitted: true, degraded });
  const over = slots
    .filter((s, i) => !s.enforce && !fits(used[i] ?? 0, s.amount, caps.length ? (caps[i] ?? 0) : s.limit.cap))
    .map((s) => s.limit.name);
  return new Decision({ admitted: true, over, degraded, remaining: headroom(slots, used, true, caps) });
}
