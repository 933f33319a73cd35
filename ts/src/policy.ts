/**
 * Limits and policies (Python: limits.py, policy.py, caps.py's Plan and cap references).
 *
 * @example
 * const policy = Policy.of(
 *   new Limit("burst", { cap: 30, window: Window.MINUTE, scope: Scope.USER }),
 *   new Limit("spend", { cap: usd("5"), window: Window.DAY, scope: Scope.USER, unit: Unit.USD_MICROS }),
 * );
 * policy.get("burst").cap  // 30
 */
import { LimitExceeded, PolicyError } from "./errors.js";
import { ANONYMOUS_USER, normalizeScope, type Context, type ScopeName } from "./context.js";
import { capsKey, escape, scopeSegment } from "./keys.js";
import { MAX_AMOUNT, Unit } from "./money.js";
import { Window, checkAnchor, zone, type Zone } from "./windows.js";
import { Decision } from "./decision.js";

/** What a limit does when the shared counters cannot be reached. */
export const FailMode = { OPEN: "open", CLOSED: "closed" } as const;
export type FailMode = (typeof FailMode)[keyof typeof FailMode];

/** What happens when a limit is exceeded: refuse, admit and report, or ask the user. */
export const OnExceed = { DENY: "deny", ALERT: "alert", ASK: "ask" } as const;
export type OnExceed = (typeof OnExceed)[keyof typeof OnExceed];

/** What integrations do with a caller they cannot identify. */
export const Anonymous = { REFUSE: "refuse", SHARED: "shared" } as const;
export type Anonymous = (typeof Anonymous)[keyof typeof Anonymous];

/** A limit name: 1-64 characters from A-Z a-z 0-9 _ . -, starting with a letter or digit. */
export const NAME_PATTERN = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$/;

function enumValue<T extends string>(values: Record<string, T>, value: unknown, field: string, kind: string): T {
  if (typeof value === "string") {
    for (const [name, member] of Object.entries(values)) {
      if (value.toLowerCase() === member || value.toLowerCase() === name.toLowerCase()) return member;
    }
  }
  throw new PolicyError(field, value, `unknown ${kind} (one of ${Object.keys(values).join(", ")})`);
}

/** A cap: a whole number from 0 to MAX_AMOUNT (micros for USD limits). */
export function checkCap(value: unknown, where: string): number {
  if (typeof value !== "number" || !Number.isInteger(value)) {
    throw new PolicyError(where, value, "expected a whole number (use usd() for dollars)");
  }
  if (value < 0) throw new PolicyError(where, value, "must not be negative");
  if (value > MAX_AMOUNT) throw new PolicyError(where, value, `exceeds the largest amount (${MAX_AMOUNT})`);
  return value;
}

/** The scope segment a caps or anchors entry names ("acme", or "user=u_42,tool=search"). */
export function scopeField(dims: readonly ScopeName[], entry: unknown, where: string): string {
  if (typeof entry !== "string" || entry === "") {
    throw new PolicyError(where, entry, "expected a scope value (a non-empty string)");
  }
  if (dims.length === 0) throw new PolicyError(where, entry, "a global limit has no scope values to cap");
  const label = dims.join("+");
  const form = dims.map((d) => `${d}=..`).join(",");
  const parts = new Map<ScopeName, string>();
  const all: readonly string[] = ["tenant", "user", "agent", "session", "tool"];
  if (dims.length === 1 && !all.some((d) => entry.startsWith(`${d}=`))) {
    parts.set(dims[0] as ScopeName, entry);
  } else {
    for (const item of entry.split(",")) {
      const at = item.indexOf("=");
      const name = at < 0 ? item : item.slice(0, at);
      const value = at < 0 ? "" : item.slice(at + 1);
      if (at < 0 || !all.includes(name) || !value) throw new PolicyError(where, entry, `expected ${form}`);
      const dim = name as ScopeName;
      if (!dims.includes(dim)) throw new PolicyError(where, entry, `the limit's scope (${label}) has no ${name}`);
      if (parts.has(dim)) throw new PolicyError(where, entry, `names ${name} twice`);
      parts.set(dim, value);
    }
  }
  if (parts.size !== dims.length) {
    const named = dims.filter((d) => parts.has(d)).join("+");
    throw new PolicyError(where, entry, `names ${named}; the scope is ${label}: name every part, as ${form}`);
  }
  return scopeSegment(dims, dims.map((d) => parts.get(d) ?? ""));
}

export interface LimitOptions {
  cap: number;
  /** Omitted only for a concurrency cap (`unit: Unit.CONCURRENT`). */
  window?: Window | null;
  scope?: ScopeName | readonly ScopeName[] | null;
  unit?: Unit;
  breaker?: boolean;
  gated?: boolean;
  failMode?: FailMode;
  localFallback?: boolean;
  status?: number | null;
  onExceed?: OnExceed;
  alertAt?: readonly number[];
  anchorDay?: number | null;
  anchors?: Readonly<Record<string, number>>;
  caps?: Readonly<Record<string, number>> | null;
  /** The tools it applies to, by name or glob (`["brave_*"]`); empty: all. */
  tools?: string | readonly string[];
}

/** One ceiling: `cap` units per `window` per `scope`; bad values are refused here. */
export class Limit {
  readonly name: string;
  readonly cap: number;
  readonly window: Window | null;
  readonly dimensions: readonly ScopeName[];
  readonly unit: Unit;
  readonly breaker: boolean;
  readonly gated: boolean;
  readonly failMode: FailMode;
  readonly localFallback: boolean;
  readonly status: number | null;
  readonly onExceed: OnExceed;
  readonly alertAt: readonly number[];
  readonly anchorDay: number | null;
  /** Billing days by scope segment. */
  readonly anchors: ReadonlyMap<string, number>;
  /** Value caps by scope segment (`tenant=acme`). */
  readonly caps: ReadonlyMap<string, number>;
  /** The tools it applies to, by name or glob; empty: every tool. */
  readonly tools: readonly string[];

  constructor(name: string, options: LimitOptions) {
    if (typeof name !== "string" || !NAME_PATTERN.test(name)) {
      throw new PolicyError(
        "Limit.name",
        name,
        "expected 1-64 characters from A-Z a-z 0-9 _ . -, starting with a letter or digit",
      );
    }
    const where = `Limit('${name}')`;
    this.name = name;
    const cap: unknown = options.cap;
    if (typeof cap !== "number" || !Number.isInteger(cap)) {
      throw new PolicyError(`${where}.cap`, cap, "expected an integer (use usd() for dollars)");
    }
    if (cap < 0) throw new PolicyError(`${where}.cap`, cap, "must be non-negative");
    if (cap > MAX_AMOUNT) throw new PolicyError(`${where}.cap`, cap, `exceeds the largest amount (${MAX_AMOUNT})`);
    this.cap = cap;
    this.unit = enumValue(Unit, options.unit ?? Unit.CALLS, `${where}.unit`, "Unit");
    this.breaker = options.breaker ?? false;
    this.gated = options.gated ?? true;
    const window = options.window ?? null;
    if (this.unit === Unit.CONCURRENT) {
      if (window !== null) {
        throw new PolicyError(
          `${where}.window`,
          window,
          "a concurrency cap counts calls in progress and has no window: omit it",
        );
      }
      if (this.breaker || !this.gated) {
        throw new PolicyError(`${where}.unit`, this.unit, "a concurrency cap is gated, never a breaker");
      }
      if ((options.anchorDay ?? null) !== null || Object.keys(options.anchors ?? {}).length) {
        throw new PolicyError(`${where}.anchor_day`, options.anchorDay ?? null, "no window, no billing day");
      }
      this.window = null;
    } else {
      this.window = enumValue(Window, window, `${where}.window`, "Window");
    }
    this.failMode = enumValue(FailMode, options.failMode ?? FailMode.OPEN, `${where}.fail_mode`, "FailMode");
    this.onExceed = enumValue(OnExceed, options.onExceed ?? OnExceed.DENY, `${where}.on_exceed`, "OnExceed");
    let dims = normalizeScope(options.scope ?? null, `${where}.scope`);
    if (this.window === Window.SESSION && !dims.includes("session")) {
      dims = normalizeScope([...dims, "session"], `${where}.scope`);
    }
    this.dimensions = Object.freeze(dims);
    this.localFallback = options.localFallback ?? true;
    for (const flag of ["breaker", "gated", "localFallback"] as const) {
      if (typeof this[flag] !== "boolean") {
        const py = flag === "localFallback" ? "local_fallback" : flag;
        throw new PolicyError(`${where}.${py}`, this[flag], "expected True or False");
      }
    }
    const status = options.status ?? null;
    if (status !== null && (!Number.isInteger(status) || status < 400 || status > 599)) {
      throw new PolicyError(`${where}.status`, status, "expected an HTTP status from 400 to 599");
    }
    this.status = status;
    const levels = options.alertAt ?? [];
    if (!Array.isArray(levels)) throw new PolicyError(`${where}.alert_at`, levels, "expected a list of percentages");
    for (const level of levels) {
      if (!Number.isInteger(level) || level < 1 || level > 1000) {
        throw new PolicyError(`${where}.alert_at`, level, "expected whole percentages from 1 to 1000");
      }
    }
    this.alertAt = Object.freeze([...new Set(levels)].sort((a, b) => a - b));
    this.anchorDay = options.anchorDay ?? null;
    const anchors = new Map<string, number>();
    const given = options.anchors ?? {};
    if (this.anchorDay !== null || Object.keys(given).length) {
      const field = this.anchorDay !== null ? `${where}.anchor_day` : `${where}.anchors`;
      if (this.window !== Window.MONTH) {
        throw new PolicyError(
          field,
          this.anchorDay ?? given,
          `billing days apply to month windows, not ${this.window ?? "concurrent"}`,
        );
      }
      if (this.anchorDay !== null) checkAnchor(this.anchorDay, `${where}.anchor_day`);
      if (Object.keys(given).length && dims.length === 0) {
        throw new PolicyError(`${where}.anchors`, given, "a global limit has no scope values");
      }
      for (const [value, day] of Object.entries(given)) {
        anchors.set(scopeField(dims, value, `${where}.anchors`), checkAnchor(day, `${where}.anchors.${value}`));
      }
    }
    this.anchors = anchors;
    const caps = new Map<string, number>();
    for (const [entry, value] of Object.entries(options.caps ?? {})) {
      const at = `${where}.caps['${entry}']`;
      const seg = scopeField(dims, entry, at);
      if (caps.has(seg)) throw new PolicyError(at, entry, "names the same scope value twice");
      caps.set(seg, checkCap(value, at));
    }
    this.caps = new Map([...caps.entries()].sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)));
    const tools: unknown = typeof options.tools === "string" ? [options.tools] : (options.tools ?? []);
    if (!Array.isArray(tools) || !tools.every((t) => typeof t === "string" && t !== "")) {
      throw new PolicyError(`${where}.tools`, options.tools, 'expected tool names or globs: ["a_*"]');
    }
    this.tools = Object.freeze([...(tools as string[])]);
    if (this.breaker && this.onExceed === OnExceed.ASK) {
      throw new PolicyError(`${where}.on_exceed`, this.onExceed, "a breaker cannot ask for approval");
    }
    Object.freeze(this);
  }

  /** Whether this limit counts a call to `tool` (its `tools`, by name or glob). */
  appliesTo(tool: string | null | undefined): boolean {
    if (this.tools.length === 0) return true;
    return tool != null && this.tools.some((t) => globMatch(t, tool));
  }

  /** The billing day of the counter for scope `values`. */
  anchorFor(values: readonly string[]): number {
    if (this.anchors.size) {
      const found = this.anchors.get(scopeSegment(this.dimensions, values));
      if (found !== undefined) return found;
    }
    return this.anchorDay ?? 1;
  }

  /** `user`, `tenant+tool` or `global`: how refusals name the scope. */
  get scopeLabel(): string {
    return this.dimensions.join("+") || "global";
  }

  /** `day`, `minute`... or `concurrent`. */
  get windowLabel(): string {
    return this.window ?? Unit.CONCURRENT;
  }

  get concurrent(): boolean {
    return this.unit === Unit.CONCURRENT;
  }

  /** The HTTP status a refusal by this limit carries. */
  get refusalStatus(): number {
    if (this.status !== null) return this.status;
    if (this.breaker) return 503;
    if (this.unit === Unit.USD_MICROS) return 402;
    return 429;
  }

  /** What one admitted check charges to this limit: a call, or nothing. */
  get checkCharge(): number {
    return this.gated && this.unit === Unit.CALLS ? 1 : 0;
  }
}

/** A named set of caps, by limit name; tenants or users assigned to it get them. */
export class Plan {
  readonly caps: ReadonlyMap<string, number>;
  constructor(
    readonly name: string,
    caps: Readonly<Record<string, number>> = {},
  ) {
    if (typeof name !== "string" || !NAME_PATTERN.test(name)) {
      throw new PolicyError(
        "Plan.name",
        name,
        "expected 1-64 characters from A-Z a-z 0-9 _ . -, starting with a letter or digit",
      );
    }
    const out = new Map<string, number>();
    for (const [k, v] of Object.entries(caps)) out.set(k, checkCap(v, `Plan('${name}').caps['${k}']`));
    this.caps = out;
    Object.freeze(this);
  }
}

/** The assignment field of a tenant or user: "acme" is a tenant, "user=u_42" a user. */
export function assignmentField(entry: unknown, where: string): string {
  if (typeof entry !== "string" || entry === "") throw new PolicyError(where, entry, "expected a tenant, or user=<id>");
  for (const dim of ["user", "tenant"]) {
    const prefix = `${dim}=`;
    if (entry.startsWith(prefix)) {
      const value = entry.slice(prefix.length);
      if (!value) throw new PolicyError(where, entry, `expected ${prefix}<value>`);
      return prefix + escape(value);
    }
  }
  return `tenant=${escape(entry)}`;
}

/** Where a counter's effective cap comes from (caps.CapRef): lua/charge.lua resolves it. */
export interface CapRef {
  readonly capsKey: string;
  readonly field: string;
  readonly valueCap: number | null;
  readonly planFields: readonly string[];
  readonly filePlan: string | null;
  readonly planCaps: readonly (readonly [string, number])[];
}

export interface PolicyOptions {
  timezone?: string | null;
  anonymous?: Anonymous;
  plans?: readonly Plan[];
  /** Tenants (`"acme"`) or users (`"user=u_42"`) -> plan name. */
  assignments?: Readonly<Record<string, string>>;
}

/** An ordered, validated set of limits with unique names. */
export class Policy implements Iterable<Limit> {
  readonly limits: readonly Limit[];
  readonly timezone: string | null;
  readonly tz: Zone;
  readonly anonymous: Anonymous;
  readonly plans: readonly Plan[];
  /** Assignment field (`tenant=acme`) -> plan. */
  readonly assignments: ReadonlyMap<string, string>;
  private readonly byName: ReadonlyMap<string, Limit>;
  private readonly perUser: readonly Limit[];

  constructor(limits: readonly Limit[], options: PolicyOptions = {}) {
    const byName = new Map<string, Limit>();
    limits.forEach((limit, i) => {
      if (!(limit instanceof Limit)) throw new PolicyError(`Policy.limits[${i}]`, limit, "expected a Limit");
      if (byName.has(limit.name)) {
        throw new PolicyError(`Policy.limits[${i}].name`, limit.name, "duplicate limit name");
      }
      byName.set(limit.name, limit);
    });
    this.limits = Object.freeze([...limits]);
    this.byName = byName;
    this.timezone = options.timezone ?? null;
    this.tz = zone(this.timezone);
    this.anonymous = enumValue(Anonymous, options.anonymous ?? Anonymous.REFUSE, "Policy.anonymous", "Anonymous");
    this.perUser = this.limits.filter((l) => l.dimensions.includes("user"));
    const names = new Set<string>();
    (options.plans ?? []).forEach((plan, i) => {
      if (names.has(plan.name)) throw new PolicyError(`Policy.plans[${i}].name`, plan.name, "duplicate plan name");
      names.add(plan.name);
      for (const limit of plan.caps.keys()) {
        const lim = byName.get(limit);
        if (lim === undefined) {
          throw new PolicyError(`Plan('${plan.name}').caps`, limit, `no such limit (known: ${[...byName.keys()].join(", ")})`);
        }
        if (!lim.dimensions.length) {
          throw new PolicyError(`Plan('${plan.name}').caps`, limit, "a global limit has no tenant or user");
        }
      }
    });
    this.plans = Object.freeze([...(options.plans ?? [])]);
    const assignments = new Map<string, string>();
    for (const [who, plan] of Object.entries(options.assignments ?? {})) {
      const where = `Policy.assignments['${who}']`;
      const field = assignmentField(who, where);
      if (!names.has(plan)) {
        throw new PolicyError(where, plan, `no such plan (known: ${[...names].sort().join(", ") || "none"})`);
      }
      assignments.set(field, plan);
    }
    this.assignments = assignments;
    Object.freeze(this);
  }

  /** Build a policy from limits given as arguments (the last may be options). */
  static of(...items: (Limit | PolicyOptions)[]): Policy {
    const limits = items.filter((i): i is Limit => i instanceof Limit);
    const options = items.find((i): i is PolicyOptions => !(i instanceof Limit)) ?? {};
    return new Policy(limits, options);
  }

  /** The limit called `name`; PolicyError naming the known ones otherwise. */
  get(name: string): Limit {
    const lim = this.byName.get(name);
    if (lim === undefined) {
      throw new PolicyError("limit", name, `no such limit (known: ${[...this.byName.keys()].join(", ")})`);
    }
    return lim;
  }

  has(name: string): boolean {
    return this.byName.has(name);
  }

  [Symbol.iterator](): Iterator<Limit> {
    return this.limits[Symbol.iterator]();
  }

  /** Each plan's cap for `limit`, sorted by plan name as Python keeps them (definition order). */
  planCaps(limit: string): [string, number][] {
    const out: [string, number][] = [];
    for (const p of this.plans) {
      const cap = p.caps.get(limit);
      if (cap !== undefined) out.push([p.name, cap]);
    }
    return out;
  }

  /** Where a counter's effective cap comes from (planning.cap_ref). */
  capRef(limit: Limit, segment: string, values: readonly string[]): CapRef {
    if (!limit.dimensions.length) {
      return { capsKey: capsKey(limit.name), field: "", valueCap: null, planFields: [], filePlan: null, planCaps: [] };
    }
    const planCaps = this.planCaps(limit.name);
    let fields: string[] = [];
    let filePlan: string | null = null;
    if (planCaps.length) {
      const byDim = new Map(limit.dimensions.map((d, i) => [d, values[i] ?? ""]));
      fields = (["user", "tenant"] as const).filter((d) => byDim.has(d)).map((d) => `${d}=${escape(byDim.get(d) ?? "")}`);
      filePlan = fields.map((f) => this.assignments.get(f)).find((p) => p !== undefined) ?? null;
    }
    return {
      capsKey: capsKey(limit.name),
      field: segment,
      valueCap: limit.caps.get(segment) ?? null,
      planFields: fields,
      filePlan,
      planCaps,
    };
  }

  /** The context to govern a caller with, applying `anonymous` to an unnamed one. */
  identified(ctx: Context): Context {
    if (ctx.user || !this.perUser.length) return ctx;
    if (this.anonymous === Anonymous.SHARED) {
      return ctx.user === ANONYMOUS_USER ? ctx : Object.freeze({ ...ctx, user: ANONYMOUS_USER });
    }
    throw new LimitExceeded(
      new Decision({ admitted: false, limit: this.perUser[0]?.name ?? null, status: 403, reason: "caller_unidentified" }),
    );
  }
}

/** Python's `fnmatch.fnmatchcase`: `*`, `?`, `[seq]`, `[!seq]`, anything else literal. */
export function globMatch(pattern: string, name: string): boolean {
  let re = "";
  for (let i = 0; i < pattern.length; i++) {
    const c = pattern[i] as string;
    if (c === "*") re += "[\\s\\S]*";
    else if (c === "?") re += "[\\s\\S]";
    else if (c === "[") {
      const end = pattern.indexOf("]", i + 2);
      if (end === -1) {
        re += "\\[";
        continue;
      }
      let body = pattern.slice(i + 1, end).replaceAll("\\", "\\\\");
      if (body.startsWith("!")) body = "^" + body.slice(1);
      else if (body.startsWith("^")) body = "\\" + body;
      re += `[${body}]`;
      i = end;
    } else re += c.replace(/[.*+?^${}()|[\]\\/]/g, "\\$&");
  }
  return new RegExp(`^${re}$`, "u").test(name);
}
