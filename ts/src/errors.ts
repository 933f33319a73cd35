/**
 * Exceptions raised by the governor, worded as the Python package words them:
 * every input error names the field and the offending value.
 *
 * @example
 * new InvalidInputError("usd", "-1", "must not be negative").message
 * // "usd: must not be negative (got '-1')"
 */
import type { Decision } from "./decision.js";

/** Python's repr() of the values errors show (strings quoted the way Python quotes them). */
export function pyRepr(value: unknown): string {
  if (value === null || value === undefined) return "None";
  if (typeof value === "boolean") return value ? "True" : "False";
  if (typeof value === "number" || typeof value === "bigint") return String(value);
  if (typeof value === "string") {
    const quote = value.includes("'") && !value.includes('"') ? '"' : "'";
    let out = "";
    for (const ch of value) {
      const code = ch.codePointAt(0) ?? 0;
      if (ch === "\\") out += "\\\\";
      else if (ch === quote) out += "\\" + ch;
      else if (ch === "\n") out += "\\n";
      else if (ch === "\r") out += "\\r";
      else if (ch === "\t") out += "\\t";
      else if (code < 0x20 || code === 0x7f) out += "\\x" + code.toString(16).padStart(2, "0");
      else out += ch;
    }
    return quote + out + quote;
  }
  if (Array.isArray(value)) return "[" + value.map(pyRepr).join(", ") + "]";
  if (typeof value === "object") {
    return "{" + Object.entries(value).map(([k, v]) => `${pyRepr(k)}: ${pyRepr(v)}`).join(", ") + "}";
  }
  return String(value);
}

function show(value: unknown): string {
  const text = pyRepr(value);
  return text.length <= 80 ? text : text.slice(0, 77) + "...";
}

/** Base class of every error this package raises on purpose. */
export class GovernorError extends Error {
  override name = "GovernorError";
}

/** A value given to the governor is not acceptable: `field` names what, `value` what was given. */
export class InvalidInputError extends GovernorError {
  override name = "InvalidInputError";
  constructor(
    readonly field: string,
    readonly value: unknown,
    readonly problem: string,
  ) {
    super(`${field}: ${problem} (got ${show(value)})`);
  }
}

/** A policy or limit definition is invalid. */
export class PolicyError extends InvalidInputError {
  override name = "PolicyError";
}

/** A policy file is invalid; the message starts with `<file>:<line>:` (or `<file>:`). */
export class PolicyFileError extends PolicyError {
  override name = "PolicyFileError";
  constructor(
    readonly file: string,
    readonly line: number | null,
    field: string,
    value: unknown,
    problem: string,
  ) {
    super(field, value, problem);
    this.message = `${line === null ? file : `${file}:${line}`}: ${this.message}`;
  }
}

/** No price is known for a model: pricing it at zero would disable the budget. */
export class UnknownModelError extends GovernorError {
  override name = "UnknownModelError";
  constructor(
    readonly model: string,
    known = 0,
  ) {
    const hint = known ? ` (${known} models known)` : " (the price table is empty)";
    super(
      `model: no price for ${show(model)}${hint}; add one with ` +
        `PriceTable.with_price(${pyRepr(model)}, input_per_mtok, output_per_mtok)`,
    );
  }
}

/** The shared counter store could not be reached within the timeout. */
export class BackendUnavailableError extends GovernorError {
  override name = "BackendUnavailableError";
  static redis(cause: unknown): BackendUnavailableError {
    if (cause instanceof BackendUnavailableError) return cause;
    const text = cause instanceof Error ? cause.message : String(cause);
    return new BackendUnavailableError(`redis unreachable: ${text}`);
  }
}

/**
 * The shared counter store is up but overloaded (Postgres: no pooled connection
 * free within the queue bound, a lock or statement that outlasted the timeout, too
 * many connections): the governor refuses with 503 and this reason, and never
 * applies a limit's fail mode, which is for a store that cannot be reached.
 */
export class BackendBusyError extends GovernorError {
  override name = "BackendBusyError";
  constructor(
    /** Which store: the refusal's reason reads "<store> busy". */
    readonly store: string,
    detail: string,
  ) {
    super(`${store} busy: ${detail}`);
  }
}

/** A charge would leave the range a counter is counted exactly in: refused, nothing written. */
export class CounterOverflowError extends GovernorError {
  override name = "CounterOverflowError";
  constructor(
    readonly limit: string,
    readonly amount: number,
    readonly key: string,
    readonly bound: number,
  ) {
    super(
      `limit ${pyRepr(limit)}: charging ${amount} would take counter ${show(key)} past ` +
        `+-${bound}, the largest total counted exactly; nothing was charged`,
    );
  }
}

/**
 * A refused call: `decision` holds why (status, limit, retry hint). Every refusal is
 * one (`catch (e) { if (e instanceof LimitExceeded) ... }` catches them all), as in the
 * Python package and mcp-budget-governor 0.1.0; a quota (429), spend cap (402) or
 * unnamed caller (403) is this class itself.
 */
export class LimitExceeded extends GovernorError {
  override name = "LimitExceeded";
  constructor(readonly decision: Decision) {
    super(decision.reason);
  }
}

/** A tripped breaker sheds every caller (503): only these are BudgetExceeded. */
export class BudgetExceeded extends LimitExceeded {
  override name = "BudgetExceeded";
}

/** Fail-closed counters or the ledger could not be reached: try again soon. */
export class BudgetUnavailable extends LimitExceeded {
  override name = "BudgetUnavailable";
}
