/**
 * The answer to a check, and how a refusal reads (Python: decision.py, integrations/flow.py).
 *
 * @example
 * const d = await governor.check(context({ user: "u_42" }));
 * d.raiseForStatus();  // throws LimitExceeded (status 429, Retry-After) when refused
 */
import type { Slot } from "./planning.js";
import { BudgetExceeded, BudgetUnavailable, LimitExceeded } from "./errors.js";
import { isRepeat } from "./repeats.js";

/** Reason prefixes: a limit's counter refused, or could not be read (fail-closed). */
export const EXCEEDED = "budget_exceeded";
export const UNAVAILABLE = "budget_unavailable";
export const LEDGER_UNAVAILABLE = "ledger_unavailable";

/** The slots an admitted call holds on concurrency caps. */
export interface Lease {
  readonly id: string;
  readonly keys: readonly string[];
}

export interface DecisionFields {
  admitted: boolean;
  limit?: string | null;
  status?: number;
  retryAfter?: number | null;
  /** Epoch seconds. */
  resetsAt?: number | null;
  reason?: string;
  over?: readonly string[];
  degraded?: boolean;
  remaining?: Readonly<Record<string, number>>;
  lease?: Lease | null;
  held?: Held | null;
}

/**
 * What an admission reserved with it (Governor.admitted's `hold`): the `reserved`
 * event's id (null without a ledger) and its slots, for Reservations.taken to settle.
 */
export interface Held {
  readonly id: string | null;
  readonly slots: readonly Slot[];
}

/** Admit or refuse, and why (fields as in Python's Decision, camelCase). */
export class Decision {
  readonly admitted: boolean;
  readonly limit: string | null;
  readonly status: number;
  readonly retryAfter: number | null;
  /** When the refusing limit's window ends, epoch seconds (null: no end). */
  readonly resetsAt: number | null;
  readonly reason: string;
  readonly over: readonly string[];
  readonly degraded: boolean;
  readonly remaining: Readonly<Record<string, number>>;
  readonly lease: Lease | null;
  readonly held: Held | null;

  constructor(f: DecisionFields) {
    this.admitted = f.admitted;
    this.limit = f.limit ?? null;
    this.status = f.status ?? 200;
    this.retryAfter = f.retryAfter ?? null;
    this.resetsAt = f.resetsAt ?? null;
    this.reason = f.reason ?? "ok";
    this.over = f.over ?? [];
    this.degraded = f.degraded ?? false;
    this.remaining = f.remaining ?? {};
    this.lease = f.lease ?? null;
    this.held = f.held ?? null;
    Object.freeze(this);
  }

  with(f: Partial<DecisionFields>): Decision {
    return new Decision({ ...this, ...f });
  }

  /** The error class a refusal with this decision raises. */
  refusalType(): typeof LimitExceeded {
    if (this.reason.startsWith(EXCEEDED)) return this.status === 503 ? BudgetExceeded : LimitExceeded;
    if (this.reason.startsWith(UNAVAILABLE) || this.reason === LEDGER_UNAVAILABLE) return BudgetUnavailable;
    return LimitExceeded;
  }

  /** Throw the refusal (a LimitExceeded; BudgetExceeded for a breaker) if refused; return this otherwise. */
  raiseForStatus(): this {
    if (!this.admitted) {
      const Type = this.refusalType();
      throw new Type(this);
    }
    return this;
  }

  /** HTTP headers a refusal should carry (Retry-After where it helps). */
  get headers(): Record<string, string> {
    return this.retryAfter !== null && !this.admitted ? { "Retry-After": String(this.retryAfter) } : {};
  }
}

export const ADMITTED = new Decision({ admitted: true });

/** What a meter() did to the first named limit that applies to the context. */
export interface MeterResult {
  readonly within: boolean;
  readonly total: number;
  readonly crossed: boolean;
  readonly charged: number;
  readonly limit: string | null;
  readonly degraded: boolean;
}

export const NOTHING_METERED: MeterResult = Object.freeze({
  within: true,
  total: 0,
  crossed: false,
  charged: 0,
  limit: null,
  degraded: false,
});

/** `resetsAt` as Python's `%Y-%m-%dT%H:%M:%SZ`. */
export function isoSeconds(epoch: number | null): string | null {
  if (epoch === null) return null;
  return new Date(Math.floor(epoch) * 1000).toISOString().replace(/\.\d{3}Z$/, "Z");
}

function quoted(name: string): string {
  const quote = name.includes("'") && !name.includes('"') ? '"' : "'";
  return quote + name + quote;
}

function advice(d: Decision, resets: string | null): string {
  const what = d.limit !== null ? `limit ${quoted(d.limit)}` : "the budget governor";
  if (isRepeat(d.reason)) {
    const until = resets !== null ? ` until ${resets}` : "";
    return (
      "You are repeating yourself: this exact call (the same tool with the same arguments) was already " +
      `made as many times as ${what} allows${until}. Calling it again will not give a different answer; ` +
      "change your approach (other arguments, another tool) or report to the user."
    );
  }
  if (d.status === 403) {
    return (
      `Refused: ${what} counts per user and this caller could not be identified. ` +
      "Retrying will not help; the server must identify its callers."
    );
  }
  if (d.retryAfter !== null) {
    const when = resets !== null ? ` (at ${resets})` : "";
    return `${opener(d, what)}. Do not call again for ${d.retryAfter} seconds${when}; calls before then are refused too.`;
  }
  if (resets !== null) {
    return `Refused by ${what}: this budget is spent until ${resets}. Do not retry before then; report this to the user instead.`;
  }
  return `Refused by ${what}. Do not retry; report this to the user instead.`;
}

/** A refusal that passes with time, named as mcp-budget-governor 0.1.0's tool errors named it. */
function opener(d: Decision, what: string): string {
  const kind = d.refusalType();
  if (kind === BudgetExceeded) return `Budget exceeded: ${what} refuses every caller`;
  if (kind === LimitExceeded && d.status === 429) return `Rate limited by ${what}`;
  return `Refused by ${what}`;
}

/** A refusal an agent can act on: the reason, the limit, and when (if ever) to retry. */
export function refusalText(d: Decision): string {
  const facts = [d.reason];
  if (d.limit !== null) facts.push(`limit=${d.limit}`);
  facts.push(`status=${d.status}`);
  if (d.retryAfter !== null) facts.push(`retry_after=${d.retryAfter}s`);
  const resets = isoSeconds(d.resetsAt);
  if (resets !== null) facts.push(`resets_at=${resets}`);
  return `${facts.join(" ")}. ${advice(d, resets)}`;
}

/** The key of a refused tool result's `_meta` that holds refusalMeta (Python: REFUSAL_META_KEY). */
export const REFUSAL_META_KEY = "dev.mcpbg/refusal";

/** The JSON-RPC error code of MCP's rate-limit proposal (SEP-3304, a draft: opt-in). */
export const RATE_LIMITED = -32023;

/**
 * A refusal as data a program reads beside the text (Python: refusal_meta):
 * status, error, reason, the limit with its scope and window (null when the
 * refusal names none), retry_after (seconds; null: waiting will not help) and
 * resets_at (ISO 8601 UTC, or null).
 */
export function refusalMeta(d: Decision): Record<string, unknown> {
  const colon = d.reason.indexOf(":");
  const error = colon < 0 ? d.reason : d.reason.slice(0, colon);
  const where = colon < 0 ? "" : d.reason.slice(colon + 1);
  const slash = where.indexOf("/");
  const scope = slash < 0 ? where : where.slice(0, slash);
  const window = slash < 0 ? "" : where.slice(slash + 1);
  return {
    status: d.status,
    error,
    reason: d.reason,
    limit: d.limit,
    scope: scope === "" ? null : scope,
    window: window === "" ? null : window,
    retry_after: d.retryAfter,
    resets_at: isoSeconds(d.resetsAt),
  };
}

/**
 * The JSON-RPC error MCP's rate-limit proposal defines for a refusal that waiting
 * fixes (status 429 with retry_after), for servers that opt in; null for any
 * other refusal (Python: rate_limited_error).
 */
export function rateLimitedError(d: Decision): { code: number; message: string; data: Record<string, unknown> } | null {
  if (d.status !== 429 || d.retryAfter === null) return null;
  return {
    code: RATE_LIMITED,
    message: refusalText(d),
    data: { retryAfterMs: d.retryAfter * 1000, [REFUSAL_META_KEY]: refusalMeta(d) },
  };
}

/** A refusal as JSON-ready fields (the `mcpbg` structured content of an error result). */
export function refusalBody(d: Decision): Record<string, unknown> {
  return {
    error: d.reason.split(":", 1)[0],
    reason: d.reason,
    limit: d.limit,
    status: d.status,
    retry_after: d.retryAfter,
    resets_at: isoSeconds(d.resetsAt),
    message: refusalText(d),
  };
}
