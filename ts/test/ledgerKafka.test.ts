// The Kafka ledger. Without a broker: append is the commit point (it resolves with Kafka
// down), "acked" durability times out with the event kept, close keeps what it could not
// ship. With the broker the Python fixtures use (MCPBG_TEST_KAFKA_BOOTSTRAP, set by
// tests/test_typescript.py; skipped with a message when it is not set): everything is
// acknowledged, leftovers of a previous process ship first, and the topic holds Python's
// bytes under Python's keys and partitions (tests/test_typescript_ledger.py has the
// Python worker project them).
import { strict as assert } from "node:assert";
import * as fs from "node:fs";
import { tmpdir } from "node:os";
import * as path from "node:path";
import { test } from "node:test";

import { Kafka, logLevel } from "kafkajs";

import { encode, newId, partitionKey, partitionOf } from "../src/ledger/events.js";
import { KafkaLedger, LedgerOptionError, LedgerTimeoutError, parseBootstrap } from "../src/ledger/kafka.js";
import { Outbox } from "../src/ledger/outbox.js";
import type { LedgerEntry } from "../src/ledger/types.js";
import { KAFKA_BOOTSTRAP as BOOTSTRAP, freePort } from "./services.js";

const NO_BROKER = BOOTSTRAP
  ? false
  : "no broker: set MCPBG_TEST_KAFKA_BOOTSTRAP=host:port (pytest tests/test_typescript.py does)";

const vectors = (
  JSON.parse(fs.readFileSync(new URL("../../conformance/events.json", import.meta.url), "utf8")) as {
    vectors: Array<{ entry: LedgerEntry }>;
  }
).vectors;

function entries(n: number): LedgerEntry[] {
  return Array.from({ length: n }, (_, i) => ({ ...vectors[i % vectors.length]!.entry, id: newId() }));
}

function folder(): string {
  return fs.mkdtempSync(path.join(tmpdir(), "mcpbg-ts-kafka-"));
}

const quiet = { warn: () => undefined, requestTimeoutMs: 300, retryIntervalMs: 100 };

test("bootstrap URLs parse as Python's, and bad ones name the value", () => {
  assert.deepEqual(parseBootstrap("kafka://k1:9092, k2:9092"), ["k1:9092", "k2:9092"]);
  assert.deepEqual(parseBootstrap("127.0.0.1:9092"), ["127.0.0.1:9092"]);
  assert.throws(() => parseBootstrap("http://k1:9092"), /bootstrap: expected kafka:\/\/host:port/);
  assert.throws(() => parseBootstrap("kafka://k1"), /"k1" is not host:port/);
  assert.throws(() => new KafkaLedger("k:1", { durability: "sync" as "acked" }), LedgerOptionError);
  assert.throws(() => new KafkaLedger("k:1", { batchSize: 0 }), /batchSize: expected a positive integer \(got 0\)/);
});

test("with Kafka down append still commits; acked times out; close keeps the events", async () => {
  const dir = folder();
  const port = await freePort();
  const ledger = KafkaLedger.fromUrl(`kafka://127.0.0.1:${port}`, { ...quiet, topic: "t", outboxDir: dir });
  const made = entries(5);
  for (const e of made) await ledger.append(e); // resolves: the outbox is the commit point
  assert.equal(ledger.unshipped, 5);
  const acked = KafkaLedger.fromUrl(`127.0.0.1:${port}`, {
    ...quiet,
    topic: "t",
    outboxDir: folder(),
    durability: "acked",
    ackTimeoutMs: 300,
  });
  await assert.rejects(acked.append(made[0]!), LedgerTimeoutError);
  assert.equal(acked.unshipped, 1);
  await acked.close(100);
  await ledger.close(100);
  const box = await Outbox.open(dir);
  assert.deepEqual(
    box.peek(10).map(([, raw]) => raw.toString()),
    made.map((e) => encode(e, ledger.source)),
  );
  await box.close();
});

test("events reach the topic under Python's keys and partitions", { skip: NO_BROKER }, async () => {
  const topic = `ts-ledger-${newId().slice(0, 8)}`;
  const dir = folder();
  // A previous process's leftovers (written while the broker was unreachable) ship first.
  const down = KafkaLedger.fromUrl(`127.0.0.1:${await freePort()}`, { ...quiet, topic, outboxDir: dir });
  const early = entries(3);
  for (const e of early) await down.append(e);
  await down.close(50);

  const ledger = KafkaLedger.fromUrl(`kafka://${BOOTSTRAP}`, { topic, outboxDir: dir, partitions: 3, durability: "acked" });
  const later = entries(40);
  for (const e of later.slice(0, 5)) await ledger.append(e); // acked: the broker has it
  assert.equal(ledger.unshipped, 0);
  await Promise.all(later.slice(5).map((e) => ledger.append(e)));
  assert.equal(await ledger.flush(30_000), true);
  await ledger.close();

  const kafka = new Kafka({ clientId: "ts-ledger-test", brokers: [BOOTSTRAP!], logLevel: logLevel.NOTHING });
  const consumer = kafka.consumer({ groupId: `g-${topic}`, sessionTimeout: 6000, heartbeatInterval: 500 });
  await consumer.connect();
  await consumer.subscribe({ topic, fromBeginning: true });
  const seen: Array<{ partition: number; key: string; value: string }> = [];
  const want = early.length + later.length;
  await new Promise<void>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`only ${seen.length} of ${want} records`)), 60_000);
    void consumer.run({
      eachMessage: ({ partition, message }) => {
        seen.push({ partition, key: message.key!.toString(), value: message.value!.toString() });
        if (new Set(seen.map((s) => s.value)).size >= want) {
          clearTimeout(timer);
          resolve();
        }
        return Promise.resolve();
      },
    });
  });
  await consumer.disconnect();
  const byValue = new Map(seen.map((s) => [s.value, s]));
  for (const e of [...early, ...later]) {
    const raw = encode(e, ledger.source);
    const record = byValue.get(raw);
    assert.ok(record, `event ${e.id} is on the topic as Python's bytes`);
    const key = partitionKey(e.context);
    assert.equal(record.key, key.toString());
    assert.equal(record.partition, partitionOf(key, 3));
  }
  // The leftovers first: on each partition, the early events come before the later ones.
  for (const p of [0, 1, 2]) {
    const order = seen.filter((s) => s.partition === p).map((s) => s.value);
    const early_ = early.map((e) => encode(e, ledger.source)).filter((v) => order.includes(v));
    assert.deepEqual(order.slice(0, early_.length), early_);
  }
});
