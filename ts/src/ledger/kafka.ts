/**
 * The Kafka ledger from TypeScript: every event to the same append-only topic as the
 * Python `KafkaLedger` (`producers/kafka_ledger.py`, `docs/kafka-ledger.md`), through
 * the same durable local outbox, so the Python `mcpbg worker` projects a TypeScript
 * server's events exactly as its own.
 *
 * - `append()` encodes the entry (`events.ts`: Python's bytes) and writes it to the
 *   outbox with one `write()` before it resolves: a process killed at any instant after
 *   `check()`/`meter()` returned loses nothing; its events ship at the next start on the
 *   same `outboxDir`. The group commit fsyncs at most every `batchIntervalMs` (5 ms):
 *   a crash of the machine loses at most that window plus one fsync in progress.
 * - A shipper ships the outbox in batches keyed as Python keys them (the tenant, else
 *   the user, else `-`; the partition is CRC-32 of the key over the sorted partition
 *   ids; no headers), `acks: -1`, then records the cursor (at least once: a crash
 *   between the broker's acknowledgement and the cursor re-sends that batch once,
 *   which consumers deduplicate on the event id).
 * - `durability: "acked"` also waits for the broker's acknowledgement (at most
 *   `ackTimeoutMs`); the event is kept in the outbox whatever the outcome.
 *
 * @example
 * const ledger = KafkaLedger.fromUrl("kafka://127.0.0.1:9092", { topic: "mcpbg.ledger" });
 * await ledger.append(entry);
 * await ledger.close(); // ships what it can within 10 s, keeps the rest in the outbox
 */

import { hostname, tmpdir } from "node:os";
import * as path from "node:path";

import { Kafka, Partitioners, logLevel, type Admin, type KafkaConfig, type Producer } from "kafkajs";

import { encode, partitionKey, partitionOf } from "./events.js";
import { Outbox } from "./outbox.js";
import { seqOf, type Position } from "./recordLog.js";
import { DEFAULT_TOPIC, type Ledger, type LedgerEntry } from "./types.js";

/** A bad option; names the option and the value (Python's `InvalidInputError`). */
export class LedgerOptionError extends RangeError {
  override name = "LedgerOptionError";
  constructor(
    readonly field: string,
    readonly value: unknown,
    reason: string,
  ) {
    super(`${field}: ${reason} (got ${JSON.stringify(value)})`);
  }
}

/** `durability: "acked"`: the broker did not acknowledge in time (the event is kept). */
export class LedgerTimeoutError extends Error {
  override name = "LedgerTimeoutError";
}

/** `kafka://h1:9092,h2:9092` or `h1:9092,h2:9092` -> `["h1:9092", "h2:9092"]` (Python's `parse_bootstrap`). */
export function parseBootstrap(url: string): string[] {
  let text = url.trim();
  const at = text.indexOf("://");
  if (at >= 0) {
    if (text.slice(0, at) !== "kafka") {
      throw new LedgerOptionError("bootstrap", url, "expected kafka://host:port[,host:port]");
    }
    text = text.slice(at + 3);
  }
  const hosts = text
    .replace(/\/+$/, "")
    .split(",")
    .map((h) => h.trim())
    .filter((h) => h);
  if (hosts.length === 0) throw new LedgerOptionError("bootstrap", url, "expected host:port[,host:port]");
  for (const host of hosts) {
    const i = host.lastIndexOf(":");
    const port = host.slice(i + 1);
    if (i <= 0 || !/^\d+$/.test(port) || !(Number(port) > 0 && Number(port) < 65536)) {
      throw new LedgerOptionError("bootstrap", url, `${JSON.stringify(host)} is not host:port`);
    }
  }
  return hosts;
}

export interface KafkaLedgerOptions {
  topic?: string;
  /** The CloudEvents `source` (default `/mcpbg/<hostname>`, as Python). */
  source?: string;
  /** The commit point (default: a folder per topic under the temp dir; give a persistent volume). */
  outboxDir?: string;
  outboxMaxBytes?: number;
  onFull?: "refuse" | "admit";
  /** The group-commit window (ms between fsyncs). */
  batchIntervalMs?: number;
  /** Partitions (and replication) of the topic when it is created. */
  partitions?: number;
  replicationFactor?: number;
  /** Appended events kept in memory for shipping; past it the shipper reads the files. */
  queueSize?: number;
  batchSize?: number;
  lingerMs?: number;
  durability?: "async" | "acked";
  ackTimeoutMs?: number;
  requestTimeoutMs?: number;
  retryIntervalMs?: number;
  createTopic?: boolean;
  /** Passed to kafkajs (`ssl`, `sasl`, ...). */
  client?: Partial<KafkaConfig>;
  /** Where warnings go (default `console.warn`). */
  warn?: (message: string) => void;
}

/** Counts since start, for logs and health checks (Python's `LedgerStats`). */
export interface LedgerStats {
  appended: number;
  shipped: number;
  spilled: number;
  sendFailures: number;
  droppedRefusals: number;
  kafkaUp: boolean;
  lastError: string | null;
}

interface Queued {
  raw: Buffer;
  key: Buffer;
  end: Position;
}

/** Ledgers not closed yet: at exit, any with unshipped events says so (Python warns in __del__). */
const open = new Set<KafkaLedger>();
let exitHook = false;

function warnUnclosedAtExit(): void {
  for (const ledger of open) {
    const left = ledger.unshipped;
    if (left > 0) {
      ledger.warnUnclosed(
        `KafkaLedger(topic=${JSON.stringify(ledger.topic)}) was not closed and has ${left} events not yet ` +
          `shipped; they are kept in the outbox ${ledger.outboxDir} and ship at the next start on that folder ` +
          "(close it: await ledger.close())",
      );
    }
  }
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

function positive(field: string, value: number | undefined, fallback: number): number {
  const v = value ?? fallback;
  if (!Number.isSafeInteger(v) || v < 1) throw new LedgerOptionError(field, v, "expected a positive integer");
  return v;
}

/** Appends ledger events to a durable local outbox and ships them to a Kafka topic. */
export class KafkaLedger implements Ledger {
  readonly bootstrap: string[];
  readonly topic: string;
  readonly source: string;
  readonly outboxDir: string;
  readonly durability: "async" | "acked";
  readonly stats: LedgerStats = {
    appended: 0,
    shipped: 0,
    spilled: 0,
    sendFailures: 0,
    droppedRefusals: 0,
    kafkaUp: false,
    lastError: null,
  };
  private readonly options: KafkaLedgerOptions;
  private readonly partitions: number;
  private readonly queueSize: number;
  private readonly batchSize: number;
  private readonly kafka: Kafka;
  private readonly warn: (message: string) => void;
  private outbox: Outbox | null = null;
  private readonly opening: Promise<Outbox>;
  private queue: Queued[] = [];
  private fromDisk = true; // until the outbox is open and known empty
  private pendingBytes = 0;
  private waiters: Array<{ seq: number; resolve: () => void }> = [];
  private producer: Producer | null = null;
  private partitionIds: number[] | null = null;
  private shipper: Promise<void> | null = null;
  private wake: (() => void) | null = null;
  private closing = false;
  private closed = false;
  private droppedLoggedAt = -Infinity;

  constructor(bootstrap: string, options: KafkaLedgerOptions = {}) {
    this.bootstrap = parseBootstrap(bootstrap);
    const durability = options.durability ?? "async";
    if (durability !== "async" && durability !== "acked") {
      throw new LedgerOptionError("durability", durability, "expected 'async' or 'acked'");
    }
    const onFull = options.onFull ?? "refuse";
    if (onFull !== "refuse" && onFull !== "admit") {
      throw new LedgerOptionError("onFull", onFull, "expected 'refuse' or 'admit'");
    }
    this.durability = durability;
    this.options = options;
    this.partitions = positive("partitions", options.partitions, 6);
    this.queueSize = positive("queueSize", options.queueSize, 10_000);
    this.batchSize = positive("batchSize", options.batchSize, 500);
    positive("outboxMaxBytes", options.outboxMaxBytes, 1 << 30);
    this.topic = options.topic ?? DEFAULT_TOPIC;
    this.source = options.source ?? `/mcpbg/${hostname()}`;
    this.outboxDir = options.outboxDir ?? path.join(tmpdir(), `mcpbg-outbox-${this.topic}`);
    this.warn = options.warn ?? ((m) => console.warn(m));
    const requestTimeout = options.requestTimeoutMs ?? 5000;
    this.kafka = new Kafka({
      clientId: "mcpbg-ts",
      brokers: this.bootstrap,
      logLevel: logLevel.NOTHING, // outages are reported once, by this class
      requestTimeout,
      connectionTimeout: requestTimeout,
      retry: { retries: 2, initialRetryTime: 100, maxRetryTime: 1000 },
      ...options.client,
    });
    this.opening = Outbox.open(this.outboxDir, {
      maxBytes: options.outboxMaxBytes ?? 1 << 30,
      onFull,
      batchIntervalMs: options.batchIntervalMs ?? 5,
      warn: this.warn,
    }).then((box) => {
      this.outbox = box;
      this.pendingBytes = box.pendingBytes;
      this.fromDisk = !box.empty; // a previous process's leftovers ship first, from the files
      return box;
    });
    this.opening.catch(() => undefined); // reported by the first append, start() or close()
    open.add(this);
    if (!exitHook) {
      exitHook = true;
      process.once("exit", warnUnclosedAtExit);
    }
  }

  /** @internal the exit hook's voice. */
  warnUnclosed(message: string): void {
    this.warn(message);
  }

  /** `KafkaLedger.fromUrl("kafka://host:9092", { topic })`; see the options. */
  static fromUrl(url: string, options: KafkaLedgerOptions = {}): KafkaLedger {
    return new KafkaLedger(url, options);
  }

  /** False while a full outbox refuses new admissions (the governor answers 503). */
  get accepting(): boolean {
    const box = this.outbox;
    return box === null || this.pendingBytes < box.maxBytes || box.onFull !== "refuse";
  }

  /** Events in the outbox that the broker has not acknowledged yet. */
  get unshipped(): number {
    return this.outbox?.length ?? 0;
  }

  /**
   * Commit one event to the outbox (written to the OS before this resolves) for
   * shipping; waits on the broker only with `durability: "acked"`.
   */
  async append(entry: LedgerEntry): Promise<void> {
    if (this.closing) throw new Error("ledger: append after close()");
    const box = this.outbox ?? (await this.opening);
    const raw = Buffer.from(encode(entry, this.source), "utf8");
    const size = raw.length + 1;
    let end: Position;
    if (this.pendingBytes + size <= box.maxBytes) {
      end = box.append(raw);
    } else if (entry.type === "rejected" && !(entry.charges?.length ?? 0)) {
      this.dropRefusal(box);
      return;
    } else {
      // Admissions were refused through `accepting` before anything was charged; an
      // event that gets here was charged and must be kept (or onFull is "admit").
      end = box.append(raw, true);
    }
    this.pendingBytes += size;
    this.stats.appended += 1;
    if (!this.fromDisk && this.queue.length < this.queueSize) {
      this.queue.push({ raw, key: partitionKey(entry.context), end });
    } else {
      if (!this.fromDisk) this.fallBackToDisk();
      this.stats.spilled += 1;
    }
    this.kick();
    if (this.durability === "acked") {
      const seq = seqOf(end) - 1;
      let timer: NodeJS.Timeout | undefined;
      try {
        await Promise.race([
          new Promise<void>((resolve) => this.waiters.push({ seq, resolve })),
          new Promise<never>((_, reject) => {
            timer = setTimeout(
              () =>
                reject(
                  new LedgerTimeoutError(
                    `ledger: no broker acknowledgement within ${this.options.ackTimeoutMs ?? 10_000} ms; ` +
                      `event ${entry.id} is kept in the outbox and will be shipped`,
                  ),
                ),
              this.options.ackTimeoutMs ?? 10_000,
            );
          }),
        ]);
      } finally {
        clearTimeout(timer);
      }
    }
  }

  private dropRefusal(box: Outbox): void {
    this.stats.droppedRefusals += 1;
    const now = Date.now();
    if (now - this.droppedLoggedAt >= 10_000) {
      this.droppedLoggedAt = now;
      this.warn(
        `ledger: outbox ${box.directory} is full (${this.pendingBytes} bytes not shipped): dropped ` +
          `${this.stats.droppedRefusals} refusal event(s) in all (refusals charge nothing)`,
      );
    }
  }

  private fallBackToDisk(): void {
    this.fromDisk = true;
    this.queue = [];
  }

  /** Start shipping now (otherwise the first append starts it), leftovers first. */
  async start(): Promise<void> {
    await this.opening;
    this.kick();
  }

  private kick(): void {
    if (this.shipper === null) {
      this.shipper = this.shipForever().finally(() => {
        this.shipper = null;
      });
    }
    const wake = this.wake;
    this.wake = null;
    wake?.();
  }

  private async shipForever(): Promise<void> {
    for (;;) {
      if (this.queue.length === 0 && !this.fromDisk) {
        if (this.closing) return;
        await new Promise<void>((resolve) => {
          this.wake = resolve;
        });
        // Linger so a batch can form: a trickle of calls would send batches of one.
        if (this.queue.length < this.batchSize && !this.closing) await sleep(this.options.lingerMs ?? 20);
        continue;
      }
      try {
        await this.shipOnce();
      } catch (err) {
        this.down(err as Error);
        if (this.closing) return;
        await sleep(this.options.retryIntervalMs ?? 1000);
      }
    }
  }

  private async shipOnce(): Promise<void> {
    const box = this.outbox ?? (await this.opening);
    let batch: Array<{ raw: Buffer; key: Buffer }>;
    let cursor: Position;
    if (this.fromDisk) {
      const records = box.peek(this.batchSize);
      if (records.length === 0) {
        this.fromDisk = false;
        return;
      }
      batch = records.map(([, raw]) => ({ raw, key: keyOf(raw) }));
      cursor = records[records.length - 1]![0];
    } else {
      const taken = this.queue.splice(0, this.batchSize);
      batch = taken;
      cursor = taken[taken.length - 1]!.end;
    }
    try {
      await this.send(batch);
    } catch (err) {
      if (!this.fromDisk) this.fallBackToDisk(); // the failed batch is re-read from the cursor
      throw err;
    }
    // The shipped position (no fsync: the broker has these records; a cursor behind
    // the disk only re-ships). A crash before this sends the batch again.
    await box.ack(cursor, { sync: false });
    this.pendingBytes = box.pendingBytes;
    this.stats.shipped += batch.length;
    if (!this.stats.kafkaUp) this.stats.kafkaUp = true;
    const done = seqOf(cursor);
    while (this.waiters.length && this.waiters[0]!.seq < done) this.waiters.shift()!.resolve();
    if (this.fromDisk && box.empty) this.fromDisk = false;
  }

  private async connect(): Promise<Producer> {
    if (this.producer !== null) return this.producer;
    const producer = this.kafka.producer({
      createPartitioner: Partitioners.DefaultPartitioner, // unused: partitions are explicit
      allowAutoTopicCreation: false,
      idempotent: false, // the test broker and many managed ones have none: the cursor dedupes
    });
    await producer.connect();
    try {
      if (this.options.createTopic ?? true) await this.ensureTopic();
    } catch (err) {
      await producer.disconnect().catch(() => undefined);
      throw err;
    }
    this.producer = producer;
    return producer;
  }

  private async withAdmin<T>(work: (admin: Admin) => Promise<T>): Promise<T> {
    const admin = this.kafka.admin();
    await admin.connect();
    try {
      return await work(admin);
    } finally {
      await admin.disconnect().catch(() => undefined);
    }
  }

  private async ensureTopic(): Promise<void> {
    await this.withAdmin(async (admin) => {
      const existing = await admin.listTopics();
      if (!existing.includes(this.topic)) {
        await admin
          .createTopics({
            topics: [
              {
                topic: this.topic,
                numPartitions: this.partitions,
                replicationFactor: this.options.replicationFactor ?? 1,
              },
            ],
            waitForLeaders: true,
          })
          .catch((err: Error) => {
            if (!/already exists/i.test(err.message)) throw err;
          });
      }
    });
  }

  private async partitionsOfTopic(): Promise<number[]> {
    if (this.partitionIds !== null) return this.partitionIds;
    const meta = await this.withAdmin((admin) => admin.fetchTopicMetadata({ topics: [this.topic] }));
    const ids = (meta.topics[0]?.partitions ?? []).map((p) => p.partitionId).sort((a, b) => a - b);
    if (ids.length === 0) throw new Error(`ledger: topic ${this.topic} has no partitions`);
    this.partitionIds = ids;
    return ids;
  }

  /** Send a batch and wait for the broker's acknowledgement of all of it. */
  private async send(batch: Array<{ raw: Buffer; key: Buffer }>): Promise<void> {
    const producer = await this.connect();
    const ids = await this.partitionsOfTopic();
    const messages = batch.map(({ raw, key }) => ({
      key,
      value: raw,
      partition: ids[partitionOf(key, ids.length)]!,
    }));
    const timeoutMs = 2 * (this.options.requestTimeoutMs ?? 5000);
    let timer: NodeJS.Timeout | undefined;
    try {
      await Promise.race([
        producer.send({ topic: this.topic, messages, acks: -1, timeout: timeoutMs }),
        new Promise<never>((_, reject) => {
          timer = setTimeout(() => reject(new Error(`no acknowledgement within ${timeoutMs} ms`)), timeoutMs);
        }),
      ]);
    } finally {
      clearTimeout(timer);
    }
  }

  private down(err: Error): void {
    this.stats.sendFailures += 1;
    this.stats.lastError = `${err.name}: ${err.message}`;
    if (this.stats.kafkaUp || this.stats.sendFailures === 1) {
      this.warn(`ledger: Kafka unreachable (${err.message}); events wait in the outbox ${this.outboxDir}`);
    }
    this.stats.kafkaUp = false;
    this.partitionIds = null;
    const producer = this.producer;
    this.producer = null;
    void producer?.disconnect().catch(() => undefined);
  }

  /** Wait until everything appended so far is acknowledged; false after `withinMs`. */
  async flush(withinMs = 30_000): Promise<boolean> {
    const box = await this.opening;
    const deadline = Date.now() + withinMs;
    while (!box.empty) {
      if (Date.now() > deadline) return false;
      this.kick();
      await sleep(10);
    }
    return true;
  }

  /**
   * Ship what can be shipped within `withinMs`; keep the rest in the outbox (fsync'd),
   * to ship first at the next start on the same folder.
   */
  async close(withinMs = 10_000): Promise<void> {
    if (this.closing) return;
    let box: Outbox;
    open.delete(this);
    try {
      box = await this.opening;
    } catch {
      this.closing = this.closed = true;
      return;
    }
    const drained = await this.flush(withinMs);
    this.closing = true;
    this.kick();
    await this.shipper;
    if (!drained) {
      this.warn(
        `ledger: closing with ${box.length} events kept in the outbox ${box.directory} ` +
          "(they ship at the next start on that folder)",
      );
    }
    try {
      await box.close();
    } finally {
      this.closed = true;
      const producer = this.producer;
      this.producer = null;
      await producer?.disconnect().catch(() => undefined);
    }
  }

  get isClosed(): boolean {
    return this.closed;
  }
}

/** Records read back from the outbox are plain CloudEvents: the key comes from the context. */
function keyOf(raw: Buffer): Buffer {
  try {
    const event = JSON.parse(raw.toString("utf8")) as { data?: { context?: { tenant?: string; user?: string } } };
    const ctx = event.data?.context ?? {};
    return partitionKey({ tenant: ctx.tenant ?? null, user: ctx.user ?? null });
  } catch {
    return Buffer.from("-"); // a damaged record still ships, for the dead-letter path to report
  }
}
