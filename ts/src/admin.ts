/**
 * Run-time changes (Python: admin.py and Governor.set_cap ... reset): caps per scope
 * value, plan assignments, grants and resets, validated whole, then appended to the
 * ledger (projected like a charge by `mcpbg worker`) or, with no ledger, written to
 * Redis through lua/change.lua. Free functions, so the governor's hot path is untouched.
 *
 * @example
 * await setCap(governor, "burst", 60, { user: "u_42" }, { reason: "trial" });
 */
import { RedisBackend } from "./backends/redis.js";
import { problem } from "./bounds.js";
import { context, type Context, type ScopeName } from "./context.js";
import { GovernorError, InvalidInputError, PolicyError } from "./errors.js";
import type { Governor } from "./governor.js";
import { capsKey, PLANS_KEY, scopeSegment } from "./keys.js";
import { newId } from "./ledger/events.js";
import type { ChangeKind, LedgerChange } from "./ledger/types.js";
import * as planning from "./planning.js";
import { assignmentField, checkCap, type Limit, type Policy } from "./policy.js";
import { script } from "./scripts.js";

/** One run-time change (caps.Change), every field present. */
export interface Change extends LedgerChange {
  readonly kind: ChangeKind;
  readonly field: string;
  readonly amount: number;
  readonly until: number;
  readonly plan: string | null;
  readonly actor: string;
  readonly reason: string;
}

export interface Why {
  reason?: string;
  actor?: string;
}

function text(value: unknown, name: string, limit: number): string {
  if (typeof value !== "string" || [...value].length > limit) {
    throw new InvalidInputError(name, value, `expected text of at most ${limit} characters`);
  }
  return value;
}

function scopeOf(limit: Limit, scope: Readonly<Record<string, unknown>>): [string[], Context] {
  const dims = limit.dimensions;
  const label = limit.scopeLabel;
  for (const [name, value] of Object.entries(scope)) {
    if (!dims.includes(name as ScopeName)) {
      throw new InvalidInputError("scope", scope, `limit '${limit.name}' counts per ${label}, not per ${name}`);
    }
    if (typeof value !== "string" || !value) throw new InvalidInputError(name, value, "expected a non-empty scope value");
  }
  const missing = dims.filter((d) => !(d in scope));
  if (missing.length) {
    throw new InvalidInputError("scope", scope, `limit '${limit.name}' counts per ${label}: name ${missing.join("+")}`);
  }
  const values = dims.map((d) => String(scope[d]));
  return [values, context(Object.fromEntries(dims.map((d, i) => [d, values[i]])))];
}

function untilOf(until: unknown, now: number): number {
  if (until === null || until === undefined) return 0;
  let moment: number;
  if (until instanceof Date) moment = until.getTime() / 1000;
  else if (typeof until === "number") moment = until;
  else throw new InvalidInputError("until", until, "expected a Date or epoch seconds");
  if (!Number.isFinite(moment) || moment <= now) throw new InvalidInputError("until", until, "must be in the future");
  // A time every zone, language and store can still show (bounds.ts).
  const why = problem("until", Math.ceil(moment));
  if (why !== null) throw new InvalidInputError("until", until, why);
  return Math.ceil(moment);
}

function change(kind: ChangeKind, limit: string, key: string, fields: Partial<Change>, why: Why): Change {
  return {
    kind,
    limit,
    key,
    field: fields.field ?? "",
    amount: fields.amount ?? 0,
    until: fields.until ?? 0,
    plan: fields.plan ?? null,
    actor: text(why.actor ?? "", "actor", 256),
    reason: text(why.reason ?? "", "reason", 1024),
  };
}

/** admin.cap_change: a run-time cap for one scope value, until `until` (null: for good). */
export function capChange(policy: Policy, limit: string, scope: Record<string, unknown>, cap: unknown, until: unknown, now: number, why: Why = {}): [Change, Context] {
  const lim = policy.get(limit);
  const [values, ctx] = scopeOf(lim, scope);
  const amount = checkCap(cap, "cap");
  const field = scopeSegment(lim.dimensions, values);
  return [change("cap_set", lim.name, capsKey(lim.name), { field, amount, until: untilOf(until, now) }, why), ctx];
}

/** admin.uncap_change. */
export function uncapChange(policy: Policy, limit: string, scope: Record<string, unknown>, why: Why = {}): [Change, Context] {
  const lim = policy.get(limit);
  const [values, ctx] = scopeOf(lim, scope);
  return [change("cap_unset", lim.name, capsKey(lim.name), { field: scopeSegment(lim.dimensions, values) }, why), ctx];
}

/** admin.plan_change: a tenant or a user (exactly one) to `plan` (null: the policy's again). */
export function planChange(policy: Policy, plan: string | null, who: { tenant?: string | null; user?: string | null }, why: Why = {}): [Change, Context] {
  const tenant = who.tenant ?? null;
  const user = who.user ?? null;
  if ((tenant === null) === (user === null)) {
    throw new InvalidInputError("tenant/user", [tenant, user], "name a tenant or a user, not both");
  }
  const found = plan === null ? undefined : policy.plans.find((p) => p.name === plan);
  if (plan !== null && found === undefined) {
    throw new PolicyError("plan", plan, `no such plan (known: ${policy.plans.map((p) => p.name).join(", ") || "none"})`);
  }
  const [dim, value] = tenant !== null ? (["tenant", tenant] as const) : (["user", user] as const);
  if (typeof value !== "string" || !value) throw new InvalidInputError(dim, value, "expected a non-empty value");
  const field = assignmentField(`${dim}=${value}`, dim);
  const name = found !== undefined && found.caps.size ? ([...found.caps.keys()].sort()[0] ?? "") : (policy.limits[0]?.name ?? "");
  return [change("plan_assigned", name, PLANS_KEY, { field, plan }, why), context({ [dim]: value })];
}

/** admin.grant_change: `amount` more room this period; with `used` (amount null), a reset. */
export function grantChange(policy: Policy, limit: string, scope: Record<string, unknown>, amount: unknown, now: number, used: number | null = null, why: Why = {}): [Change, Context] {
  const lim = policy.get(limit);
  const [, ctx] = scopeOf(lim, scope);
  const s = planning.slot(lim, ctx, now, policy.tz, 0, false);
  if (s === null) throw new PolicyError("scope", scope, "incomplete");
  let kind: ChangeKind;
  let value: number;
  if (used === null) {
    if (typeof amount !== "number" || !Number.isInteger(amount) || amount <= 0) {
      throw new InvalidInputError("amount", amount, "expected a positive whole number");
    }
    checkCap(amount, "amount");
    [kind, value] = ["granted", amount];
  } else [kind, value] = ["reset", Math.max(used, 0)];
  return [change(kind, lim.name, s.key, { amount: value, until: s.expireAt }, why), ctx];
}

/** caps.why_token: who and why as one space-free token (Python's quote(..., safe="")). */
export function whyToken(actor: string, reason: string): string {
  if (!actor && !reason) return "-";
  return encodeURIComponent(`${actor}\n${reason}`).replace(/[!'()*]/g, (c) => "%" + c.charCodeAt(0).toString(16).toUpperCase());
}

/** The change.lua command (without the EVALSHA word's connection): Python's change_tokens. */
export function changeCommand(changes: readonly Change[], nowMs: number): string[] {
  const keys: string[] = [];
  const tokens = changes.map((c) => {
    let pos = keys.indexOf(c.key) + 1;
    if (pos === 0) pos = keys.push(c.key);
    return `${c.kind} ${pos} ${c.field || "-"} ${c.amount} ${c.until} ${c.plan ?? "-"} ${whyToken(c.actor, c.reason)}`;
  });
  return ["EVALSHA", script("change").sha, String(keys.length), ...keys, tokens.join(" "), String(Math.floor(nowMs))];
}

async function apply(gov: Governor, ch: Change, ctx: Context): Promise<Change> {
  if (gov.ledger !== null) {
    await gov.ledger.append({ id: newId(), type: ch.kind, time: gov.now(), context: ctx, charges: [], change: ch });
    return ch;
  }
  const backend = gov.backend;
  if (!(backend instanceof RedisBackend)) {
    throw new GovernorError(`${backend.constructor.name} stores no run-time changes; use a RedisBackend or a ledger`);
  }
  const [, sha, ...args] = changeCommand([ch], backend.clock() * 1000);
  try {
    await backend.client.call("EVALSHA", sha ?? "", ...args);
  } catch (err) {
    if (!(err instanceof Error && err.message.startsWith("NOSCRIPT"))) throw err;
    await backend.client.call("SCRIPT", "LOAD", script("change").source);
    await backend.client.call("EVALSHA", sha ?? "", ...args);
  }
  gov.replacePolicy(gov.policy); // drop cached plans
  return ch;
}

/** Governor.set_cap: one scope value's own cap (micros for USD limits), until `until`. */
export async function setCap(gov: Governor, limit: string, cap: number, scope: Record<string, string>, options: Why & { until?: Date | number | null } = {}): Promise<Change> {
  return apply(gov, ...capChange(gov.policy, limit, scope, cap, options.until, gov.now(), options));
}

/** Governor.unset_cap: the policy's value cap, plan or default applies again. */
export async function unsetCap(gov: Governor, limit: string, scope: Record<string, string>, options: Why = {}): Promise<Change> {
  return apply(gov, ...uncapChange(gov.policy, limit, scope, options));
}

/** Governor.assign_plan: a tenant or a user to `plan` (null: back to the policy's). */
export async function assignPlan(gov: Governor, plan: string | null, who: { tenant?: string; user?: string }, options: Why = {}): Promise<Change> {
  return apply(gov, ...planChange(gov.policy, plan, who, options));
}

/** Governor.grant: extra room on the current period's counter; spend unchanged. */
export async function grant(gov: Governor, limit: string, amount: number, scope: Record<string, string>, options: Why = {}): Promise<Change> {
  return apply(gov, ...grantChange(gov.policy, limit, scope, amount, gov.now(), null, options));
}

/** Governor.reset: the period's room back to the cap, the spend kept (grant = spent now). */
export async function reset(gov: Governor, limit: string, scope: Record<string, string>, options: Why = {}): Promise<Change> {
  const now = gov.now();
  const [probe] = grantChange(gov.policy, limit, scope, 1, now);
  const used = (await gov.backend.usage([probe.key]))[0] ?? 0;
  return apply(gov, ...grantChange(gov.policy, limit, scope, null, now, used, options));
}
