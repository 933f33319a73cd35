/**
 * What a governor appends to the ledger, and the interface a ledger offers: the
 * TypeScript mirror of Python's `mcp_budget_governor.ledger` (field for field, in
 * camelCase). Entries are plain data; `events.ts` turns one into the exact CloudEvent
 * the Python ledger writes, and a ledger (`KafkaLedger`, `MemoryLedger`) decides how
 * it travels.
 *
 * @example
 * const entry: LedgerEntry = {
 *   id: newId(), type: "admitted", time: Date.now() / 1000, context: { user: "u_42" },
 * };
 * await ledger.append(entry);
 */

/** The ledger topic when none is named (Python's `ledger.DEFAULT_TOPIC`). */
export const DEFAULT_TOPIC = "mcpbg.ledger";

/** Python's `ledger.EntryType`: one entry per operation, and the run-time changes. */
export type EntryType =
  | "admitted"
  | "rejected"
  | "metered"
  | "reserved"
  | "settled"
  | "released"
  | "recovered"
  | "cap_set"
  | "cap_unset"
  | "plan_assigned"
  | "granted"
  | "reset";

/** The entry types by name, as values (Python's `EntryType.ADMITTED`, ...). */
export const EntryType = {
  ADMITTED: "admitted",
  REJECTED: "rejected",
  METERED: "metered",
  RESERVED: "reserved",
  SETTLED: "settled",
  RELEASED: "released",
  RECOVERED: "recovered",
  CAP_SET: "cap_set",
  CAP_UNSET: "cap_unset",
  PLAN_ASSIGNED: "plan_assigned",
  GRANTED: "granted",
  RESET: "reset",
} as const satisfies Record<string, EntryType>;

export const ENTRY_TYPES: readonly EntryType[] = [
  "admitted",
  "rejected",
  "metered",
  "reserved",
  "settled",
  "released",
  "recovered",
  "cap_set",
  "cap_unset",
  "plan_assigned",
  "granted",
  "reset",
];

/** The kinds that carry a `change` (and only they do). */
export type ChangeKind = "cap_set" | "cap_unset" | "plan_assigned" | "granted" | "reset";

/** Python's `money.Unit` values a ledger charge may carry (leases never reach it). */
export type LedgerUnit = "calls" | "tokens" | "usd_micros";

/** Python's `windows.Window` values. */
export type LedgerWindow = "minute" | "hour" | "day" | "week" | "month" | "session";

/**
 * Integer amounts (USD micros, calls, tokens): a safe integer `number` or a `bigint`
 * (within +-(2^53 - 1), Python's `money.MAX_AMOUNT`); never a fraction.
 */
export type Amount = number | bigint;

/** Python's `context.Context`: who the operation was for; any dimension may be unknown. */
export interface LedgerContext {
  readonly user?: string | null | undefined;
  readonly tenant?: string | null | undefined;
  readonly tool?: string | null | undefined;
  readonly session?: string | null | undefined;
  readonly agent?: string | null | undefined;
  /** The session a forked `session` descends from; absent when it is its own root. */
  readonly sessionRoot?: string | null | undefined;
  /** The call's tool and arguments hashed (a loop guard's counter); absent without one. */
  readonly call?: string | null | undefined;
}

/** Python's `ledger.LedgerCharge`: a signed amount charged to one counter. */
export interface LedgerCharge {
  readonly limit: string;
  readonly unit: LedgerUnit;
  readonly amount: Amount;
  readonly window: LedgerWindow;
  readonly bucket: string;
  readonly key: string;
  /** Epoch seconds: the bucket's end plus grace. */
  readonly expireAt: number;
}

/** Python's `ledger.TokenUsage`: the tokens behind a metered cost. */
export interface TokenUsage {
  readonly model: string;
  readonly inputTokens: number;
  readonly outputTokens: number;
  readonly cacheReadTokens?: number;
  readonly cacheWriteTokens?: number;
  readonly priceVersion?: string | null;
}

/** Python's `caps.Change`: one run-time change, as applied to the counters store. */
export interface LedgerChange {
  readonly kind: ChangeKind;
  readonly limit: string;
  readonly key: string;
  readonly field?: string;
  readonly amount?: Amount;
  readonly until?: number;
  readonly plan?: string | null;
  readonly actor?: string;
  readonly reason?: string;
}

/**
 * Python's `ledger.LedgerEntry`: one ledger event. `id` (a UUIDv7, `newId()`) is the
 * idempotency key end to end; `time` is epoch seconds (a float, as in Python).
 * Omitted fields take Python's defaults: no charges, `limit` null, `status` 200, no
 * `over`, no `usage`, not `degraded`, no `reservation`, no `change`, no `approved`.
 */
export interface LedgerEntry {
  readonly id: string;
  readonly type: EntryType;
  readonly time: number;
  readonly context: LedgerContext;
  readonly charges?: readonly LedgerCharge[];
  readonly limit?: string | null;
  readonly status?: number;
  /** Shadow (`OnExceed.ALERT`) limits this call went over. */
  readonly over?: readonly string[];
  readonly usage?: TokenUsage | null;
  readonly degraded?: boolean;
  readonly reservation?: string | null;
  readonly change?: LedgerChange | null;
  /** `OnExceed.ASK` limits the user approved going over for this call. */
  readonly approved?: readonly string[];
  /** The one-time approvals the admission spent (Python: `data.decision.spent`). */
  readonly spent?: readonly { readonly limit: string; readonly once: string; readonly until: number }[];
}

/** Somewhere entries are appended, in order, never lost (Python's `ledger.Ledger`). */
export interface Ledger {
  /** Append one entry; resolves once it is committed (see each ledger's contract). */
  append(entry: LedgerEntry): Promise<void>;
  /** Flush what is buffered and release resources. */
  close(): Promise<void>;
  /** False while the ledger cannot record new work (a full outbox that refuses):
   * the governor then refuses admissions with a 503 before charging anything. */
  readonly accepting?: boolean;
}
