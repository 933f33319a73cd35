/**
 * The range of every number that crosses a boundary (Python: bounds.py), one table:
 * amounts, caps, grants, a change's `until`, event times and expiries. Each door
 * checks its numbers here and refuses with the same line as Python; sums are checked
 * before they are applied, so every total stays below 2**53, exact in a double.
 * conformance/vectors.json ("bounds") holds this table and its answers to Python's.
 *
 * @example
 * check("until", 1e300); // InvalidInputError: until: must be at most 253370764800 (9999-01-01T00:00:00Z)
 */
import { InvalidInputError } from "./errors.js";
import { MAX_AMOUNT } from "./money.js";

/** The latest epoch second any time may name: 9999-01-01T00:00:00Z. */
export const LATEST_TIME = 253_370_764_800;

/** The whole numbers from `low` to `high`; `note` says what `high` is. */
export interface Bound {
  readonly low: number;
  readonly high: number;
  readonly note: string;
}

const TIME_NOTE = "9999-01-01T00:00:00Z";

/** The one table (Python: bounds.BOUNDS). */
export const BOUNDS: Readonly<Record<string, Bound>> = {
  amount: { low: -MAX_AMOUNT, high: MAX_AMOUNT, note: "" },
  cap: { low: 0, high: MAX_AMOUNT, note: "" },
  grant: { low: 1, high: MAX_AMOUNT, note: "" },
  reset: { low: 0, high: MAX_AMOUNT, note: "" },
  committed: { low: 0, high: MAX_AMOUNT, note: "" },
  until: { low: 1, high: LATEST_TIME, note: TIME_NOTE },
  time: { low: 0, high: LATEST_TIME, note: TIME_NOTE },
  expire_at: { low: 1, high: LATEST_TIME, note: TIME_NOTE },
};

function bound(kind: string): Bound {
  const found = BOUNDS[kind];
  if (found === undefined) throw new Error(`no bound named ${kind}`);
  return found;
}

/** Why `value` is not a number of `kind`; null when it is. */
export function problem(kind: string, value: unknown): string | null {
  const b = bound(kind);
  if (typeof value !== "number" || !Number.isInteger(value)) return "expected a whole number";
  if (value < b.low) return `must be at least ${b.low}`;
  if (value > b.high) return `must be at most ${b.high}${b.note ? ` (${b.note})` : ""}`;
  return null;
}

/** `value` as a number of `kind`, else InvalidInputError naming `field`. */
export function check(kind: string, value: unknown, field: string = kind): number {
  const why = problem(kind, value);
  if (why !== null) throw new InvalidInputError(field, value, why);
  return value as number;
}

/** Why `total + amount` leaves the range of `kind` (null: it stays in). */
export function sumProblem(kind: string, total: number, amount: number): string | null {
  const b = bound(kind);
  // In BigInt: the sum itself may not fit a double exactly.
  const result = BigInt(total) + BigInt(amount);
  if (result > BigInt(b.high)) return `${kind}: ${total} + ${amount} would leave the exact range (at most ${b.high})`;
  const floor = Math.min(b.low, 0);
  if (result < BigInt(floor)) return `${kind}: ${total} + ${amount} would go below ${floor}`;
  return null;
}
