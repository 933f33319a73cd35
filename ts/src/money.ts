/**
 * Money and amounts: integer USD micros, never floats (Python: money.py).
 *
 * Amounts are bounded by MAX_AMOUNT = 2**53 - 1, the largest integer Redis'
 * Lua compares and adds exactly, so a JavaScript number holds every one exactly.
 *
 * @example
 * usd("0.05");            // 50000
 * usd("0.0000001");       // 1 (a fraction of a micro rounds up, once)
 * formatUsd(usd("12.34")) // "12.340000"
 */
import { InvalidInputError } from "./errors.js";

export const MAX_AMOUNT = 2 ** 53 - 1;
export const MICROS_PER_USD = 1_000_000;

/** What a limit counts. */
export const Unit = {
  CALLS: "calls",
  TOKENS: "tokens",
  USD_MICROS: "usd_micros",
  /** Calls in progress (a concurrency cap: leases, not spend; no window). */
  CONCURRENT: "concurrent",
} as const;
export type Unit = (typeof Unit)[keyof typeof Unit];

/** An exact decimal: `digits * 10**exponent` (Python's Decimal, finite values only). */
export interface Exact {
  readonly digits: bigint;
  readonly exponent: number;
}

const DECIMAL = /^([+-]?)(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?$/;

/** Read a price or dollar figure exactly, as Python's `Decimal(str(value).strip())` does. */
export function toExact(value: unknown, field: string): Exact {
  if (typeof value === "boolean") throw new InvalidInputError(field, value, "expected a number, not a bool");
  let text: string;
  if (typeof value === "bigint") text = value.toString();
  else if (typeof value === "number") {
    if (!Number.isFinite(value)) throw new InvalidInputError(field, value, "must be finite");
    text = String(value);
  } else if (typeof value === "string") text = value.trim();
  else throw new InvalidInputError(field, value, "expected a number");
  if (/^[+-]?(inf|infinity|nan|snan)$/i.test(text)) throw new InvalidInputError(field, value, "must be finite");
  const m = DECIMAL.exec(text);
  if (m === null) throw new InvalidInputError(field, value, "not a number");
  const [whole, frac = ""] = (m[2] ?? "").split(".");
  const digits = BigInt((whole ?? "") + frac || "0") * (m[1] === "-" ? -1n : 1n);
  const exponent = Number(m[3] ?? "0") - frac.length;
  return { digits, exponent };
}

/** The smallest integer >= `x * 10**shift` (exact). */
export function ceilScaled(x: Exact, shift: number): bigint {
  const e = x.exponent + shift;
  if (e >= 0) return x.digits * 10n ** BigInt(e);
  const div = 10n ** BigInt(-e);
  const q = x.digits / div;
  return x.digits > 0n && x.digits % div !== 0n ? q + 1n : q;
}

/**
 * Convert dollars to integer USD micros, rounding a fraction of a micro up.
 *
 * @example usd(25) === 25_000_000; usd("0.05") === 50_000
 */
export function usd(dollars: number | string | bigint): number {
  const value = toExact(dollars, "usd");
  if (value.digits < 0n) throw new InvalidInputError("usd", dollars, "must not be negative");
  const micros = ceilScaled(value, 6);
  if (micros > BigInt(MAX_AMOUNT)) {
    throw new InvalidInputError("usd", dollars, `exceeds the largest amount (${MAX_AMOUNT} micros)`);
  }
  return Number(micros);
}

/** Micros as an exact dollar string: formatUsd(1_500_000) === "1.500000". */
export function formatUsd(micros: number): string {
  const sign = micros < 0 ? "-" : "";
  const abs = Math.abs(micros);
  return `${sign}${Math.floor(abs / MICROS_PER_USD)}.${String(abs % MICROS_PER_USD).padStart(6, "0")}`;
}

/** Validate an integer amount (calls, tokens or micros) and return it. */
export function checkAmount(value: unknown, field: string, allowNegative = false): number {
  if (typeof value !== "number" || !Number.isInteger(value)) {
    throw new InvalidInputError(field, value, "expected an integer");
  }
  if (value < 0 && !allowNegative) throw new InvalidInputError(field, value, "must not be negative");
  if (Math.abs(value) > MAX_AMOUNT) {
    throw new InvalidInputError(field, value, `exceeds the largest amount (${MAX_AMOUNT})`);
  }
  return value;
}
