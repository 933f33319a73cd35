/**
 * The durable local outbox: the Kafka ledger's commit point, in the same on-disk
 * format as Python's `producers/outbox.py` (`docs/outbox.md`): the record log's JSON
 * Lines segments (`recordLog.ts`), the cursor `outbox.cursor` (`{"segment": s,
 * "offset": o, "index": i}`, the position just past the last acknowledged record) and
 * the writer lock `outbox.lock`. A folder a Python governor left behind ships from a
 * TypeScript one and the other way round.
 *
 * - `append` is one `write()`: the record is in the kernel before it returns (a killed
 *   process loses nothing); the attached group commit fsyncs at most every
 *   `batchIntervalMs` (5 ms) after the previous fsync, so a crash of the machine loses
 *   at most that window plus the one fsync in progress.
 * - `peek` reads unacknowledged records from the cursor; `ack(cursor)` records them as
 *   shipped and deletes the segments it covers. Delivery is at least once: the event
 *   id is the consumers' idempotency key.
 *
 * @example
 * const box = await Outbox.open("/var/lib/mcpbg/outbox");
 * box.append(Buffer.from('{"id":"e1"}'));
 * const batch = box.peek(500);      // [[cursor, bytes], ...]
 * await box.ack(batch[batch.length - 1]![0]);
 * await box.close();
 */

import * as fs from "node:fs";
import * as path from "node:path";

import {
  DEFAULT_BATCH_INTERVAL_MS,
  RecordLog,
  comparePositions,
  seqOf,
  showPosition,
  type Position,
  type Warn,
} from "./recordLog.js";

/** A cursor is JSON of three integers, padded with spaces when rewritten in place. */
const CURSOR_BYTES = 128;

/** The outbox holds `maxBytes` of unshipped records: this record was not written. */
export class OutboxFullError extends Error {
  override name = "OutboxFullError";
  constructor(
    readonly pendingBytes: number,
    readonly incoming: number,
    readonly maxBytes: number,
  ) {
    super(
      `outbox full: ${pendingBytes} bytes not yet shipped + ${incoming} new > maxBytes=${maxBytes}; ` +
        "the record was refused, nothing was dropped",
    );
  }
}

export interface OutboxOptions {
  /** The budget of unshipped bytes (default 1 GiB). */
  maxBytes?: number;
  /** `"refuse"` (default) throws `OutboxFullError`; `"admit"` writes anyway and warns. */
  onFull?: "refuse" | "admit";
  /** `"batch"`: group commit (default); `"never"`: fsync only at close. */
  fsync?: "batch" | "never";
  /** The group-commit window: ms between fsyncs (default 5, as in Python). */
  batchIntervalMs?: number;
  /** Segment size (default a quarter of `maxBytes`, between 64 KiB and 16 MiB). */
  segmentBytes?: number;
  prefix?: string;
  lock?: "flock" | "none";
  lockWaitMs?: number;
  warn?: Warn;
  /** Called once per damaged line met by `peek` (the line still ships, to be dead-lettered). */
  onMalformed?: (file: string, position: Position, data: Buffer, reason: string) => void;
}

function parseCursor(raw: string): Position {
  const value: unknown = JSON.parse(raw);
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    throw new Error(`a position is an object, got ${raw.trim()}`);
  }
  const out: number[] = [];
  for (const name of ["segment", "offset", "index"] as const) {
    const v = (value as Record<string, unknown>)[name];
    if (typeof v !== "number" || !Number.isSafeInteger(v) || v < 0) {
      throw new Error(`${name}: a non-negative integer, got ${JSON.stringify(v)}`);
    }
    out.push(v);
  }
  return { segment: out[0]!, offset: out[1]!, index: out[2]! };
}

function cursorJson(p: Position): string {
  // Python's json.dumps of Position.to_json(): the same bytes either side writes.
  return `{"segment": ${p.segment}, "offset": ${p.offset}, "index": ${p.index}}`;
}

/** Durable, ordered spill of raw ledger records, shipped oldest first. One owner at a time. */
export class Outbox {
  readonly maxBytes: number;
  readonly onFull: "refuse" | "admit";
  readonly batchIntervalMs: number;
  malformed = 0;
  private acked: Position;
  private cursorFd = -1;
  private readonly cursorPath: string;
  private readonly reported = new Set<string>();
  private readonly warn: Warn;
  private readonly onMalformed: NonNullable<OutboxOptions["onMalformed"]>;
  private fullWarnedAt = -Infinity;
  private flushTimer: NodeJS.Timeout | null = null;
  private flushing: Promise<void> | null = null;
  private lastSync = 0;
  private syncError: Error | null = null;

  private constructor(
    readonly directory: string,
    readonly log: RecordLog,
    cursor: Position | null,
    options: OutboxOptions,
  ) {
    this.maxBytes = options.maxBytes ?? 1 << 30;
    this.onFull = options.onFull ?? "refuse";
    this.batchIntervalMs = options.batchIntervalMs ?? DEFAULT_BATCH_INTERVAL_MS;
    this.warn = options.warn ?? ((m) => console.warn(m));
    this.onMalformed =
      options.onMalformed ??
      ((file, p, data, reason) =>
        this.warn(
          `${file}: malformed record at byte ${p.offset} (record ${p.index}, sequence ${seqOf(p)}): ` +
            `${reason}; shipped as is for the consumer to dead-letter: ${JSON.stringify(data.subarray(0, 80).toString())}`,
        ));
    this.cursorPath = path.join(directory, `${log.prefix}.cursor`);
    this.acked = this.reconcile(cursor);
  }

  /** Open (or create) the outbox folder; its unacknowledged records are `peek`ed first. */
  static async open(directory: string, options: OutboxOptions = {}): Promise<Outbox> {
    const maxBytes = options.maxBytes ?? 1 << 30;
    if (!Number.isSafeInteger(maxBytes) || maxBytes < 1) {
      throw new RangeError(`maxBytes: a positive size (got ${String(maxBytes)})`);
    }
    if (options.onFull !== undefined && options.onFull !== "refuse" && options.onFull !== "admit") {
      throw new RangeError(`onFull: "refuse" or "admit" (got ${JSON.stringify(options.onFull)})`);
    }
    const interval = options.batchIntervalMs ?? DEFAULT_BATCH_INTERVAL_MS;
    if (!(interval >= 0)) throw new RangeError(`batchIntervalMs: >= 0 (got ${String(interval)})`);
    const prefix = options.prefix ?? "outbox";
    const warn = options.warn ?? ((m: string) => console.warn(m));
    fs.mkdirSync(directory, { recursive: true });
    const cursor = loadCursor(path.join(directory, `${prefix}.cursor`), warn);
    const log = await RecordLog.open(directory, {
      prefix,
      fsync: options.fsync ?? "batch",
      segmentBytes: options.segmentBytes ?? Math.min(16 << 20, Math.max(64 << 10, Math.floor(maxBytes / 4))),
      firstSeq: cursor === null ? 0 : seqOf(cursor),
      lock: options.lock ?? "flock",
      lockWaitMs: options.lockWaitMs ?? 3000,
      warn,
    });
    return new Outbox(directory, log, cursor, { ...options, warn });
  }

  /** The acknowledged position that matches what is on disk (Python's `_reconcile`). */
  private reconcile(cursor: Position | null): Position {
    const segments = this.log.segments();
    const end = this.log.end;
    if (cursor === null) return { segment: segments[0] ?? end.segment, offset: 0, index: 0 };
    if (seqOf(cursor) > seqOf(end) || (cursor.segment === end.segment && cursor.offset > end.offset)) {
      this.warn(
        `${this.cursorPath}: the acknowledged cursor ${showPosition(cursor)} is past the end of the log ` +
          `${showPosition(end)}; continuing in a new segment after it`,
      );
      this.log.roll(seqOf(cursor));
      return this.log.end;
    }
    if (!segments.includes(cursor.segment)) {
      const later = segments.filter((s) => s > cursor.segment);
      return later.length ? { segment: later[0]!, offset: 0, index: 0 } : this.log.end;
    }
    this.log.deleteBefore(cursor.segment);
    return this.normalize(cursor);
  }

  /** The end of a finished segment is the start of the next one. */
  private normalize(cursor: Position): Position {
    if (cursor.segment < this.log.end.segment && cursor.offset >= this.log.size(cursor.segment)) {
      const later = this.log.nextSegment(cursor.segment);
      if (later !== null) return { segment: later, offset: 0, index: 0 };
    }
    return cursor;
  }

  /**
   * Commit one record: written to the OS before this returns, fsync'd by the group
   * commit within `batchIntervalMs`. Returns the cursor just past it. Throws
   * `OutboxFullError` past `maxBytes` under `onFull: "refuse"` unless `force`.
   */
  append(record: Buffer, force = false): Position {
    const incoming = record.length + 1;
    const pending = this.pendingBytes;
    if (pending + incoming > this.maxBytes && !force) this.full(pending, incoming);
    const end = this.log.appendLine(record);
    this.scheduleSync();
    return end;
  }

  private full(pending: number, incoming: number): void {
    const now = Date.now();
    if (now - this.fullWarnedAt >= 10_000) {
      this.fullWarnedAt = now;
      this.warn(
        `outbox ${this.directory} is full: ${pending} bytes not shipped (maxBytes=${this.maxBytes}); ` +
          (this.onFull === "refuse" ? "refusing new records" : "admitting past the limit"),
      );
    }
    if (this.onFull === "refuse") throw new OutboxFullError(pending, incoming, this.maxBytes);
  }

  /** Group commit: one fsync for every append since the previous one, no sooner than the interval. */
  private scheduleSync(): void {
    if (this.flushTimer !== null || this.flushing !== null || this.log.fsync === "never") return;
    const delay = Math.max(0, this.lastSync + this.batchIntervalMs - Date.now());
    this.flushTimer = setTimeout(() => {
      this.flushTimer = null;
      this.flushing = this.log
        .sync()
        .catch((err: unknown) => {
          this.syncError = err as Error;
          this.warn(`outbox ${this.directory}: ${(err as Error).message}; the outbox refuses further writes`);
        })
        .finally(() => {
          this.flushing = null;
          this.lastSync = Date.now();
          if (this.log.unsyncedBytes > 0 && !this.log.isClosed) this.scheduleSync();
        });
    }, delay);
  }

  /** fsync everything appended so far (resolves once it is on disk). */
  async sync(): Promise<void> {
    if (this.syncError) throw this.syncError;
    await this.log.sync();
  }

  /** Up to `limit` unshipped records, oldest first, each with its cursor. Changes nothing. */
  peek(limit = 500): Array<[Position, Buffer]> {
    if (limit <= 0) return [];
    const out: Array<[Position, Buffer]> = [];
    for (const record of this.log.read(this.acked, limit)) {
      const reason = jsonObjectProblem(record.data);
      const where = `${record.position.segment}:${record.position.offset}`;
      if (reason !== null && !this.reported.has(where)) {
        this.reported.add(where);
        this.malformed += 1;
        this.onMalformed(this.log.path(record.position.segment), record.position, record.data, reason);
      }
      out.push([record.next, record.data]);
    }
    return out;
  }

  /**
   * Everything before `cursor` was shipped: persist that and delete the segments it
   * covers. `sync: false` (for a shipper that acknowledges only what a broker holds)
   * rewrites the cursor in place without fsync, as Python's `ack(sync=False)`.
   */
  async ack(cursor: Position, { sync = true }: { sync?: boolean } = {}): Promise<void> {
    if (comparePositions(cursor, this.acked) <= 0) return;
    const end = this.log.end;
    if (comparePositions(cursor, end) > 0 || cursor.offset > this.log.size(cursor.segment)) {
      throw new RangeError(`cursor ${showPosition(cursor)} is past the end of the outbox (${showPosition(end)})`);
    }
    if (!this.log.hasSegment(cursor.segment)) {
      throw new RangeError(`cursor ${showPosition(cursor)} names no segment of the outbox`);
    }
    const at = this.normalize(cursor);
    if (comparePositions(at, this.acked) <= 0) return;
    const durable = sync && this.log.fsync !== "never";
    if (durable) await this.log.sync(); // the records are durable before a cursor past them
    this.storeCursor(at, durable);
    this.acked = at;
    this.log.deleteBefore(at.segment);
  }

  private storeCursor(cursor: Position, sync: boolean): void {
    const data = Buffer.from(cursorJson(cursor));
    if (!sync) {
      if (this.cursorFd < 0) {
        this.cursorFd = fs.openSync(this.cursorPath, fs.constants.O_WRONLY | fs.constants.O_CREAT, 0o644);
      }
      const padded = Buffer.alloc(CURSOR_BYTES, 0x20);
      data.copy(padded);
      fs.writeSync(this.cursorFd, padded, 0, CURSOR_BYTES, 0);
      return;
    }
    if (this.cursorFd >= 0) {
      fs.closeSync(this.cursorFd); // the rename below replaces the file it writes
      this.cursorFd = -1;
    }
    const tmp = `${this.cursorPath}.tmp`;
    const fd = fs.openSync(tmp, "w", 0o644);
    try {
      fs.writeSync(fd, data);
      fs.fsyncSync(fd);
    } finally {
      fs.closeSync(fd);
    }
    fs.renameSync(tmp, this.cursorPath);
    const dir = fs.openSync(this.directory, "r");
    try {
      fs.fsyncSync(dir);
    } finally {
      fs.closeSync(dir);
    }
  }

  /** The cursor of the last acknowledgement (where `peek` starts). */
  get ackedPosition(): Position {
    return this.acked;
  }

  /** How many records are not yet acknowledged. */
  get length(): number {
    return seqOf(this.log.end) - seqOf(this.acked);
  }

  /** Bytes of records not yet acknowledged (what `maxBytes` bounds). */
  get pendingBytes(): number {
    return this.log.bytesFrom(this.acked);
  }

  get empty(): boolean {
    return this.length === 0;
  }

  /** fsync and release the folder (the writer lock). */
  async close(): Promise<void> {
    if (this.flushTimer !== null) clearTimeout(this.flushTimer);
    this.flushTimer = null;
    if (this.flushing !== null) await this.flushing;
    if (this.cursorFd >= 0) {
      if (this.log.fsync !== "never") {
        try {
          fs.fsyncSync(this.cursorFd);
        } catch {
          /* closing anyway */
        }
      }
      fs.closeSync(this.cursorFd);
      this.cursorFd = -1;
    }
    await this.log.close();
  }
}

function loadCursor(cursorPath: string, warn: Warn): Position | null {
  let raw: string;
  try {
    raw = fs.readFileSync(cursorPath, "utf8");
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "ENOENT") return null;
    warn(`${cursorPath}: ${(err as Error).message}`);
    raw = "";
  }
  try {
    return parseCursor(raw);
  } catch (err) {
    // Re-shipping is safe (event ids are idempotency keys); losing is not.
    warn(`${cursorPath}: unreadable (${(err as Error).message}); shipping again from the oldest segment`);
    return null;
  }
}

/** Why a line is not one JSON object, or null. */
function jsonObjectProblem(data: Buffer): string | null {
  if (data.length === 0) return "empty line";
  try {
    const value: unknown = JSON.parse(data.toString("utf8"));
    if (typeof value !== "object" || value === null || Array.isArray(value)) {
      return `not a JSON object but ${Array.isArray(value) ? "an array" : typeof value}`;
    }
    return null;
  } catch (err) {
    return (err as Error).message;
  }
}
