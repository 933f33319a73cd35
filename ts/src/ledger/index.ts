/**
 * The ledger from TypeScript: entry types, the CloudEvent encoder, the durable outbox,
 * the Kafka and memory ledgers. Re-exported by the package's `index.ts`.
 *
 * @example
 * import { KafkaLedger } from "mcp-budget-governor";
 * const ledger = KafkaLedger.fromUrl("kafka://127.0.0.1:9092");
 */
export * from "./types.js";
export * from "./events.js";
export { Outbox, OutboxFullError, type OutboxOptions } from "./outbox.js";
export { RecordLog, RecordLogError, type Position } from "./recordLog.js";
export {
  KafkaLedger,
  LedgerOptionError,
  LedgerTimeoutError,
  parseBootstrap,
  type KafkaLedgerOptions,
  type LedgerStats,
} from "./kafka.js";
export { MemoryLedger } from "./memory.js";
