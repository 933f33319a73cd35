/**
 * The ledger entry a governor appends (Python: ledger.LedgerEntry, field for
 * field in camelCase), and the interface every ledger implements. Helper
 * ts_ledger owns the full version of this file (CloudEvents, Kafka, outbox).
 */
import type { Context } from "../context.js";
import type { Unit } from "../money.js";

export const EntryType = {
  ADMITTED: "admitted",
  REJECTED: "rejected",
  METERED: "metered",
  RESERVED: "reserved",
  SETTLED: "settled",
  RELEASED: "released",
  RECOVERED: "recovered",
} as const;
export type EntryType = (typeof EntryType)[keyof typeof EntryType];

export interface LedgerCharge {
  readonly limit: string;
  readonly unit: Unit;
  readonly amount: number;
  readonly window: string;
  readonly bucket: string;
  readonly key: string;
  readonly expireAt: number;
}

export interface TokenUsage {
  readonly model: string;
  readonly inputTokens: number;
  readonly outputTokens: number;
  readonly cacheReadTokens: number;
  readonly cacheWriteTokens: number;
  readonly priceVersion: string | null;
}

export interface LedgerEntry {
  readonly id: string;
  readonly type: EntryType;
  /** Epoch seconds. */
  readonly time: number;
  readonly context: Context;
  readonly charges: readonly LedgerCharge[];
  readonly limit: string | null;
  readonly status: number;
  readonly over: readonly string[];
  readonly usage: TokenUsage | null;
  readonly degraded: boolean;
  readonly reservation: string | null;
  readonly change: null;
  readonly approved: readonly string[];
}

export interface Ledger {
  append(entry: LedgerEntry): Promise<void>;
  close(): Promise<void>;
  /** False while the ledger cannot record new work (checks are then refused, 503). */
  readonly accepting?: boolean;
}
