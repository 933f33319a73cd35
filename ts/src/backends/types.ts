/** The counter store contract every backend implements (Python: counters.Backend). */
import type { CounterOp } from "../planning.js";

/** `refused` is the index of the first refusing op, or -1; `used` the totals read; `caps`
 * each op's effective cap plus its grant (what `used` was compared with), when resolved. */
export interface ChargeResult {
  readonly refused: number;
  readonly used: readonly number[];
  readonly caps: readonly number[];
}

export interface ChargeOptions {
  /** null commits inline (no ledger); else in-flight under this event id. */
  eventId?: string | null;
  wantUsed?: boolean;
  /** Inline charges: the operation id that makes a replay change nothing. */
  opId?: string | null;
  /** The lease id concurrency caps take. */
  lease?: string | null;
  /** Seconds a lease lives unless renewed. */
  leaseTtl?: number;
  /** A call waiting for a slot: its place in the queues ("<id>/<wait ms>"). */
  ticket?: string | null;
}

export interface Backend {
  /** All or nothing, one atomic step. */
  charge(ops: readonly CounterOp[], options?: ChargeOptions): Promise<ChargeResult>;
  /** committed + in-flight of each key (0 for a missing key). */
  usage(keys: readonly string[]): Promise<number[]>;
  /** Give a lease back on every set; how many held it. */
  release(keys: readonly string[], lease: string): Promise<number>;
  /** Extend a live lease by `ttl` seconds; how many were renewed. */
  renew(keys: readonly string[], lease: string, ttl: number): Promise<number>;
  /** Take a waiting call's ticket out of the queues of lease sets `keys`; how many held it. */
  leave(keys: readonly string[], ticket: string): Promise<number>;
  /** Live leases per set. */
  inProgress(keys: readonly string[]): Promise<number[]>;
  close(): Promise<void>;
  /**
   * The key every server on this backend seals approvals with (the SDK
   * middleware's default approvalSeal), created on first use; absent: the
   * backend is one process's own, and so is the key.
   */
  approvalKey?(): Promise<Uint8Array>;
  /**
   * Whether one charge may admit a call and charge its fixed price under two
   * event ids (withCost): Governor.admitted's `price` then takes one round trip.
   */
  readonly pricesAtAdmission?: boolean;
  /**
   * charge(), written on the shared connection before this returns (so a later
   * call of this process reaches the store after it), its reply not awaited by
   * the caller; null when it cannot be written at once (then charge() it).
   * Python: RedisBackend.charge_sent.
   */
  chargeSent?(ops: readonly CounterOp[], options: ChargeOptions): Promise<ChargeResult> | null;
}

/**
 * The event id of a charge that admits a call and charges its fixed price in one
 * round trip (Python: counters.with_cost): ops from index `first` on hold
 * in-flight amounts of the cost event `costId`, those before of the admission
 * `eventId` (lua/charge.lua reads "<admission id> <cost id> <j>", j counted
 * from 1; event ids hold no space).
 */
export function withCost(eventId: string, costId: string, first: number): string {
  return `${eventId} ${costId} ${first + 1}`;
}

/** withCost read back: [admission id, cost id, index of the first cost op]. */
export function splitCost(argument: string): [string, string, number] {
  const [eventId = "", costId = "", j = "1"] = argument.split(" ");
  return [eventId, costId, Number(j) - 1];
}

export const ADMITTED_RESULT: ChargeResult = Object.freeze({ refused: -1, used: [], caps: [] });
