// The KafkaLedger of the cross-language driver processes (ledgerDriver.ts kafka,
// cross/governed.ts): a real broker, three partitions, an outbox in the given folder,
// a short linger, and the shipper's warnings on stderr.
import { KafkaLedger } from "../src/ledger/kafka.js";

export function driverLedger(bootstrap: string, topic: string, outboxDir: string, batchSize: number): KafkaLedger {
  return KafkaLedger.fromUrl(`kafka://${bootstrap}`, {
    topic,
    outboxDir,
    partitions: 3,
    batchSize,
    lingerMs: 5,
    warn: (m) => process.stderr.write(m + "\n"),
  });
}
