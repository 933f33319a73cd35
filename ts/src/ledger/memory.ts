/** A ledger that keeps its entries in a list (tests; helper ts_ledger owns the full one). */
import type { Ledger, LedgerEntry } from "./types.js";

export class MemoryLedger implements Ledger {
  readonly entries: LedgerEntry[] = [];
  async append(entry: LedgerEntry): Promise<void> {
    this.entries.push(entry);
  }
  async close(): Promise<void> {}
}
