/**
 * An in-memory ledger: entries kept in an array, in order (Python's
 * `producers/memory_ledger.py`). For tests and single-process experiments; it is lost
 * with the process.
 *
 * @example
 * const ledger = new MemoryLedger();
 * await ledger.append({ id: newId(), type: "admitted", time: Date.now() / 1000, context: { user: "u" } });
 * ledger.entries.length; // 1
 */

import { encode } from "./events.js";
import type { Ledger, LedgerEntry } from "./types.js";

export class MemoryLedger implements Ledger {
  readonly entries: LedgerEntry[] = [];
  private closed = false;

  append(entry: LedgerEntry): Promise<void> {
    if (this.closed) return Promise.reject(new Error("ledger: append after close()"));
    this.entries.push(entry);
    return Promise.resolve();
  }

  /** The entries as the CloudEvent lines a Kafka ledger would write. */
  events(source = "/mcpbg/memory"): string[] {
    return this.entries.map((e) => encode(e, source));
  }

  close(): Promise<void> {
    this.closed = true;
    return Promise.resolve();
  }
}
