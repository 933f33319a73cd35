/**
 * Who is calling, and which part of it a limit counts per (Python: context.py, scopes.py).
 *
 * @example
 * const ctx = context({ user: "u_42", tool: "search" });
 * scopeValues([Scope.USER, Scope.TOOL], ctx)  // ["u_42", "search"]
 */
import { InvalidInputError, PolicyError } from "./errors.js";

/** A dimension of the caller's context. A limit with no scope is global. */
export const Scope = {
  TENANT: "tenant",
  USER: "user",
  AGENT: "agent",
  SESSION: "session",
  TOOL: "tool",
  /** The call itself, its tool and arguments hashed (repeats.ts): a loop guard. */
  CALL: "call",
} as const;
export type ScopeName = (typeof Scope)[keyof typeof Scope];

/** The canonical order of dimensions in a key (Python's Scope enum order). */
export const SCOPE_ORDER: readonly ScopeName[] = ["tenant", "user", "agent", "session", "tool", "call"];

/** The caller's identity along every scope dimension; any may be unknown. */
export interface Context {
  readonly user?: string | null;
  readonly tenant?: string | null;
  readonly tool?: string | null;
  readonly session?: string | null;
  readonly agent?: string | null;
  /** The session a forked `session` descends from: session budgets count on the root. */
  readonly sessionRoot?: string | null;
  /** The call's tool and arguments hashed (`callHash`), set only when a limit counts per call. */
  readonly call?: string | null;
}

const FIELDS = ["user", "tenant", "tool", "session", "agent", "sessionRoot", "call"] as const;
const PY_NAMES: Record<(typeof FIELDS)[number], string> = {
  user: "user",
  tenant: "tenant",
  tool: "tool",
  session: "session",
  agent: "agent",
  sessionRoot: "session_root",
  call: "call",
};

/** The caller nobody named. */
export const EMPTY: Context = Object.freeze({});
/** The user id of the anonymous bucket: names nobody. */
export const ANONYMOUS_USER = "";

function hasLoneSurrogate(value: string): boolean {
  return /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/.test(value);
}

/** A validated, frozen context: strings or null, valid Unicode, a session root only with a session. */
export function context(fields: Context = {}): Context {
  const out: Record<string, string | null> = {};
  for (const f of FIELDS) {
    const value: unknown = fields[f];
    if (value === undefined || value === null) continue;
    if (typeof value !== "string") {
      throw new InvalidInputError(`Context.${PY_NAMES[f]}`, value, "expected a string or None");
    }
    if (hasLoneSurrogate(value)) {
      throw new InvalidInputError(`Context.${PY_NAMES[f]}`, value, "not valid Unicode (lone surrogate)");
    }
    out[f] = value;
  }
  if (out["sessionRoot"] !== undefined && out["session"] === undefined) {
    throw new InvalidInputError("Context.session_root", out["sessionRoot"], "needs a session (the fork it roots)");
  }
  return Object.freeze(out) as Context;
}

/** The session whose budget this caller spends: its root, else the session itself. */
export function sessionKey(ctx: Context): string | null {
  return ctx.sessionRoot ?? ctx.session ?? null;
}

/** The context's values for `dims`, or null when the context lacks one. */
export function scopeValues(dims: readonly ScopeName[], ctx: Context): string[] | null {
  const values: string[] = [];
  for (const dim of dims) {
    const value = dim === "session" ? sessionKey(ctx) : ctx[dim];
    if (value === undefined || value === null) return null;
    values.push(value);
  }
  return values;
}

/** Accept null, a Scope, or a list of Scopes; return them in canonical order. */
export function normalizeScope(scope: unknown, field: string): ScopeName[] {
  if (scope === null || scope === undefined) return [];
  const items: unknown[] = typeof scope === "string" ? [scope] : Array.isArray(scope) ? scope : [Symbol()];
  if (!Array.isArray(scope) && typeof scope !== "string") {
    throw new PolicyError(field, scope, "expected a Scope or a tuple of Scopes");
  }
  const dims: ScopeName[] = [];
  for (const item of items) {
    const name = item;
    if (typeof name !== "string" || !SCOPE_ORDER.includes(name as ScopeName)) {
      throw new PolicyError(field, item, "not a Scope (one of TENANT, USER, AGENT, SESSION, TOOL, CALL)");
    }
    dims.push(name as ScopeName);
  }
  if (new Set(dims).size !== dims.length) throw new PolicyError(field, scope, "a dimension appears twice");
  return dims.sort((a, b) => SCOPE_ORDER.indexOf(a) - SCOPE_ORDER.indexOf(b));
}

/** Whether caches may keep `ctx` (its values total at most 512 characters). */
export function cacheable(ctx: Context): boolean {
  let total = 0;
  for (const f of FIELDS) total += ctx[f]?.length ?? 0;
  return total <= 512;
}

/** A cache key of a context (its fields, unambiguously). */
export function contextKey(ctx: Context): string {
  // \u0000 never ends a field and \u0001 marks a missing one: distinct contexts, distinct keys.
  const f = (v: string | null | undefined): string => (v == null ? "\u0001" : v.replaceAll("\u0000", "\u0000\u0000")) + "\u0000|";
  return f(ctx.user) + f(ctx.tenant) + f(ctx.tool) + f(ctx.session) + f(ctx.agent) + f(ctx.sessionRoot) + f(ctx.call);
}
