/**
 * The on-disk record format of the outbox, the same as Python's
 * `producers/record_log.py` (`docs/record-log.md`): JSON Lines segments
 * `<prefix>-<first sequence number, 20 digits>.jsonl`, one writer per folder under an
 * advisory `flock` on `<prefix>.lock`, a torn tail truncated by the writer that opens
 * the log. Either language can therefore open, append to and drain the other's
 * folder (never both at once: the lock is the same kernel lock).
 *
 * @example
 * const log = await RecordLog.open("/tmp/box", { prefix: "outbox" });
 * log.appendLine(Buffer.from('{"id":"a"}'));
 * await log.sync();
 * await log.close();
 */

import { spawn, type ChildProcess } from "node:child_process";
import * as fs from "node:fs";
import * as path from "node:path";

export const SUFFIX = ".jsonl";
export const SEQ_DIGITS = 20;
export const DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024;
/** The group-commit window, as Python's `record_log.DEFAULT_BATCH_INTERVAL` (5 ms). */
export const DEFAULT_BATCH_INTERVAL_MS = 5;
const CHUNK = 256 * 1024;
const PREFIX = /^[A-Za-z0-9_.]+$/;

/** Where a record starts: segment (its first sequence number), byte offset, index. */
export interface Position {
  readonly segment: number;
  readonly offset: number;
  readonly index: number;
}

export function seqOf(p: Position): number {
  return p.segment + p.index;
}

/** Positions compare as Python's ordered dataclass: segment, then offset, then index. */
export function comparePositions(a: Position, b: Position): number {
  return a.segment - b.segment || a.offset - b.offset || a.index - b.index;
}

export function showPosition(p: Position): string {
  return `Position(segment=${p.segment}, offset=${p.offset}, index=${p.index})`;
}

/** `outbox-00000000000000000042.jsonl` for `("outbox", 42)`. */
export function segmentName(prefix: string, segment: number): string {
  return `${prefix}-${String(segment).padStart(SEQ_DIGITS, "0")}${SUFFIX}`;
}

/** The log cannot take writes: closed, locked by another writer, or a failed fsync. */
export class RecordLogError extends Error {
  override name = "RecordLogError";
}

/** One complete line: where it starts, its bytes (without `\n`), the position after it. */
export interface LogRecord {
  readonly position: Position;
  readonly data: Buffer;
  readonly next: Position;
}

export type Warn = (message: string) => void;

function fsyncDirSync(directory: string): void {
  const fd = fs.openSync(directory, "r");
  try {
    fs.fsyncSync(fd);
  } finally {
    fs.closeSync(fd);
  }
}

/**
 * The writer lock: the same `flock(2)` on `<prefix>.lock` as Python's `RecordLog`.
 * Node has no `flock`, so a `flock(1)` child (util-linux) takes it and holds it until
 * its standard input closes: on `release()`, or when this process dies (even by
 * SIGKILL), the kernel closes the pipe, the child exits and the lock is dropped.
 */
class WriterLock {
  private constructor(private readonly child: ChildProcess) {}

  static async acquire(lockPath: string, waitMs: number): Promise<WriterLock> {
    const deadline = Date.now() + waitMs;
    for (;;) {
      const got = await WriterLock.tryOnce(lockPath);
      if (got instanceof WriterLock) return got;
      if (Date.now() >= deadline) {
        throw new RecordLogError(
          `${lockPath}: another process is writing this log (one writer per directory)`,
        );
      }
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
  }

  private static tryOnce(lockPath: string): Promise<WriterLock | "busy"> {
    return new Promise((resolve, reject) => {
      const child = spawn(
        "flock",
        ["--nonblock", "--exclusive", lockPath, "-c", "echo locked; exec cat >/dev/null"],
        { stdio: ["pipe", "pipe", "ignore"] },
      );
      let settled = false;
      child.once("error", (err: NodeJS.ErrnoException) => {
        if (settled) return;
        settled = true;
        reject(
          new RecordLogError(
            err.code === "ENOENT"
              ? `${lockPath}: the flock command (util-linux) is needed to lock the outbox; ` +
                  `install it, or pass lock: "none" if no other process can open this folder`
              : `${lockPath}: cannot start flock: ${err.message}`,
          ),
        );
      });
      child.stdout.once("data", () => {
        if (settled) return;
        settled = true;
        child.stdout.destroy();
        // Held in the background: the lock alone keeps no process alive.
        child.unref();
        (child.stdin as unknown as { unref(): void }).unref();
        resolve(new WriterLock(child));
      });
      child.once("exit", () => {
        if (settled) return;
        settled = true;
        resolve("busy"); // flock --nonblock exits 1 when the lock is held
      });
    });
  }

  async release(): Promise<void> {
    if (this.child.exitCode !== null || this.child.signalCode !== null) return;
    const exited = new Promise<void>((resolve) => this.child.once("exit", () => resolve()));
    this.child.ref(); // wait for the lock to be dropped before close() resolves
    (this.child.stdin as unknown as { ref(): void }).ref();
    this.child.stdin!.end();
    await exited;
  }
}

export interface RecordLogOptions {
  prefix?: string;
  /** `"batch"` (group commit through `sync()`, the default) or `"never"`. */
  fsync?: "batch" | "never";
  segmentBytes?: number;
  firstSeq?: number;
  /** `"flock"` (default: the lock Python takes too) or `"none"`. */
  lock?: "flock" | "none";
  /** How long to wait for a lock a just-killed writer is still dropping (ms). */
  lockWaitMs?: number;
  warn?: Warn;
}

/** An append-only log of byte records in JSON Lines segment files (one writer). */
export class RecordLog {
  readonly prefix: string;
  readonly fsync: "batch" | "never";
  readonly segmentBytes: number;
  private readonly pattern: RegExp;
  private readonly warn: Warn;
  private fd = -1;
  private at: [number, number, number] = [0, 0, 0];
  private readonly sizes = new Map<number, number>();
  private written = 0;
  private synced = 0;
  private failed: Error | null = null;
  private closed = false;
  private syncing: Promise<void> | null = null;
  private readonly retired: number[] = []; // descriptors an fsync in flight still uses
  private readonly warned = new Set<string>();

  private constructor(
    readonly directory: string,
    options: RecordLogOptions,
    private lock: WriterLock | null,
  ) {
    this.prefix = options.prefix ?? "log";
    this.fsync = options.fsync ?? "batch";
    this.segmentBytes = options.segmentBytes ?? DEFAULT_SEGMENT_BYTES;
    this.warn = options.warn ?? ((m) => console.warn(m));
    this.pattern = new RegExp(`^${this.prefix.replaceAll(".", "\\.")}-(\\d{${SEQ_DIGITS}})\\.jsonl$`);
  }

  /** Open (creating the folder) for writing; takes the writer lock. */
  static async open(directory: string, options: RecordLogOptions = {}): Promise<RecordLog> {
    const prefix = options.prefix ?? "log";
    if (!PREFIX.test(prefix)) {
      throw new RangeError(`prefix: use letters, digits, '_' and '.' only (got ${JSON.stringify(prefix)})`);
    }
    const fsyncPolicy = options.fsync ?? "batch";
    if (fsyncPolicy !== "batch" && fsyncPolicy !== "never") {
      throw new RangeError(`fsync: "batch" or "never" (got ${JSON.stringify(fsyncPolicy)})`);
    }
    const segmentBytes = options.segmentBytes ?? DEFAULT_SEGMENT_BYTES;
    if (!Number.isInteger(segmentBytes) || segmentBytes < 1) {
      throw new RangeError(`segmentBytes: a positive size (got ${String(segmentBytes)})`);
    }
    fs.mkdirSync(directory, { recursive: true });
    const lockPath = path.join(directory, `${prefix}.lock`);
    fs.closeSync(fs.openSync(lockPath, fs.constants.O_RDWR | fs.constants.O_CREAT, 0o644));
    const lock = options.lock === "none" ? null : await WriterLock.acquire(lockPath, options.lockWaitMs ?? 3000);
    const log = new RecordLog(directory, options, lock);
    try {
      log.openSegments(options.firstSeq ?? 0);
    } catch (err) {
      await lock?.release();
      throw err;
    }
    return log;
  }

  private openSegments(firstSeq: number): void {
    const segments = this.segments();
    for (const seg of segments) this.sizes.set(seg, fs.statSync(this.path(seg)).size);
    if (segments.length === 0) {
      this.createSegment(firstSeq);
      return;
    }
    const last = segments[segments.length - 1]!;
    const file = this.path(last);
    this.fd = fs.openSync(file, fs.constants.O_WRONLY | fs.constants.O_APPEND);
    const [end, count] = scanLines(file);
    const size = this.sizes.get(last)!;
    if (end < size) {
      this.warn(
        `${file}: torn tail at byte ${end} (${size - end} bytes without a newline, a crash mid-write): truncated`,
      );
      fs.ftruncateSync(this.fd, end);
      if (this.fsync !== "never") fs.fsyncSync(this.fd);
      this.sizes.set(last, end);
    }
    this.at = [last, end, count];
  }

  private createSegment(seq: number): void {
    const c = fs.constants;
    this.fd = fs.openSync(this.path(seq), c.O_WRONLY | c.O_APPEND | c.O_CREAT | c.O_EXCL, 0o644);
    if (this.fsync !== "never") fsyncDirSync(this.directory);
    this.sizes.set(seq, 0);
    this.at = [seq, 0, 0];
  }

  path(segment: number): string {
    return path.join(this.directory, segmentName(this.prefix, segment));
  }

  /** The segments on disk now, oldest first. */
  segments(): number[] {
    let names: string[];
    try {
      names = fs.readdirSync(this.directory);
    } catch {
      return [];
    }
    const found: number[] = [];
    for (const name of names) {
      const m = this.pattern.exec(name);
      if (m) found.push(Number(m[1]));
    }
    return found.sort((a, b) => a - b);
  }

  /** Where the next appended record goes. */
  get end(): Position {
    const [segment, offset, index] = this.at;
    return { segment, offset, index };
  }

  size(segment: number): number {
    return this.sizes.get(segment) ?? 0;
  }

  hasSegment(segment: number): boolean {
    return this.sizes.has(segment);
  }

  nextSegment(segment: number): number | null {
    let best: number | null = null;
    for (const s of this.sizes.keys()) if (s > segment && (best === null || s < best)) best = s;
    return best;
  }

  /** Bytes from `position` to the end of the log. */
  bytesFrom(position: Position): number {
    let tail = 0;
    for (const [seg, size] of this.sizes) if (seg >= position.segment) tail += size;
    return this.sizes.has(position.segment) ? tail - position.offset : tail;
  }

  get totalBytes(): number {
    let total = 0;
    for (const size of this.sizes.values()) total += size;
    return total;
  }

  get unsyncedBytes(): number {
    return this.written - this.synced;
  }

  private checkOpen(): void {
    if (this.closed) throw new RecordLogError(`${this.directory}: the log is closed`);
    if (this.failed !== null) {
      throw new RecordLogError(
        `${this.directory}: an earlier fsync failed (${this.failed.message}); reopen the log to know what is on disk`,
      );
    }
  }

  /**
   * Write one record (one line, no `\n` inside) with one `write()`: in the kernel when
   * this returns. Returns the position just past it (its cursor). Never fsyncs: the
   * owner's group commit (`sync()`) does.
   */
  appendLine(record: Buffer): Position {
    if (record.length === 0 || record.includes(10)) {
      throw new RangeError(
        `a record is one non-empty line: no newline inside (got ${JSON.stringify(record.subarray(0, 60).toString())}...)`,
      );
    }
    this.checkOpen();
    const buf = Buffer.concat([record, NEWLINE]);
    let [segment, offset, index] = this.at;
    if (offset && offset + buf.length > this.segmentBytes) {
      this.rotate(segment + index);
      [segment, offset, index] = this.at;
    }
    let done = 0;
    try {
      while (done < buf.length) done += fs.writeSync(this.fd, buf, done, buf.length - done);
    } catch (err) {
      try {
        fs.ftruncateSync(this.fd, offset); // no half record for the next one to extend
      } catch {
        /* the write's error is the one to report */
      }
      throw err;
    }
    this.at = [segment, offset + buf.length, index + 1];
    this.sizes.set(segment, (this.sizes.get(segment) ?? 0) + buf.length);
    this.written += buf.length;
    return { segment, offset: offset + buf.length, index: index + 1 };
  }

  private rotate(seq: number): void {
    if (this.fsync !== "never" && this.written > this.synced) {
      try {
        fs.fsyncSync(this.fd); // the old segment is closed for good: durable now
      } catch (err) {
        this.failed = err as Error;
        throw new RecordLogError(`fsync of ${this.path(this.at[0])}: ${(err as Error).message}`);
      }
      this.synced = this.written;
    }
    const [oldSegment, oldOffset] = this.at;
    if (this.syncing !== null) this.retired.push(this.fd); // closed once that fsync is done
    else fs.closeSync(this.fd);
    this.fd = -1;
    if (oldOffset === 0 && oldSegment !== seq) {
      fs.unlinkSync(this.path(oldSegment)); // an empty segment named for an unused number
      this.sizes.delete(oldSegment);
    }
    this.createSegment(seq);
  }

  /** Continue in a new segment numbered at least `minSeq`. */
  roll(minSeq: number): void {
    this.checkOpen();
    const [segment, offset, index] = this.at;
    const seq = Math.max(minSeq, segment + index);
    if (offset === 0 && segment === seq) return;
    this.rotate(seq);
  }

  /** fsync everything appended so far (off the event loop, in libuv's thread pool). */
  async sync(): Promise<void> {
    while (this.syncing !== null) await this.syncing;
    this.checkOpen();
    const mark = this.written;
    if (mark <= this.synced || this.fsync === "never") return;
    const fd = this.fd;
    this.syncing = new Promise<void>((resolve, reject) => {
      fs.fsync(fd, (err) => {
        if (err) {
          this.failed = err;
          reject(new RecordLogError(`fsync of ${this.path(this.at[0])}: ${err.message}`));
        } else {
          this.synced = Math.max(this.synced, mark);
          resolve();
        }
      });
    }).finally(() => {
      this.syncing = null;
      for (const old of this.retired.splice(0)) fs.closeSync(old);
    });
    await this.syncing;
  }

  /** Delete whole segments older than `segment` (never the one being written). */
  deleteBefore(segment: number): number {
    let freed = 0;
    let deleted = false;
    if (![...this.sizes.keys()].some((s) => s < segment)) return 0;
    for (const seg of this.segments()) {
      if (seg >= segment || seg >= this.at[0]) break;
      try {
        fs.unlinkSync(this.path(seg));
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== "ENOENT") {
          this.warn(`${this.path(seg)}: not deleted (${(err as Error).message}); will retry`);
          continue;
        }
      }
      freed += this.sizes.get(seg) ?? 0;
      this.sizes.delete(seg);
      deleted = true;
    }
    if (deleted && this.fsync !== "never") fsyncDirSync(this.directory);
    return freed;
  }

  /** fsync and release the file and the writer lock. */
  async close(): Promise<void> {
    if (this.closed) return;
    try {
      if (this.failed === null && this.written > this.synced && this.fsync !== "never") await this.sync();
      else if (this.failed === null && this.fsync === "never" && this.fd >= 0) fs.fsyncSync(this.fd);
    } finally {
      this.closed = true;
      while (this.syncing !== null) await this.syncing.catch(() => undefined);
      if (this.fd >= 0) fs.closeSync(this.fd);
      this.fd = -1;
      const lock = this.lock;
      this.lock = null;
      await lock?.release();
    }
  }

  get isClosed(): boolean {
    return this.closed;
  }

  /**
   * Complete records from `start`, in order across segments, at most `limit`. A torn
   * tail is skipped with a warning; in the newest segment reading stops before it.
   */
  read(start: Position, limit: number): LogRecord[] {
    const out: LogRecord[] = [];
    const segments = this.segments();
    for (let i = 0; i < segments.length && out.length < limit; i++) {
      const seg = segments[i]!;
      if (seg < start.segment) continue;
      let [offset, index] = seg === start.segment ? [start.offset, start.index] : [0, 0];
      const newest = i === segments.length - 1;
      const file = this.path(seg);
      let fd: number;
      try {
        fd = fs.openSync(file, "r");
      } catch {
        continue; // deleted (shipped) while we listed
      }
      try {
        let pending = Buffer.alloc(0);
        let eof = false;
        let torn = false;
        while (out.length < limit && !eof) {
          const chunk = Buffer.allocUnsafe(CHUNK);
          const n = fs.readSync(fd, chunk, 0, CHUNK, offset + pending.length);
          if (n === 0) {
            eof = true;
            torn = pending.length > 0;
            break;
          }
          pending = pending.length ? Buffer.concat([pending, chunk.subarray(0, n)]) : chunk.subarray(0, n);
          let from = 0;
          for (;;) {
            if (out.length >= limit) break;
            const nl = pending.indexOf(10, from);
            if (nl < 0) break;
            const data = Buffer.from(pending.subarray(from, nl));
            const position = { segment: seg, offset, index };
            offset += nl - from + 1;
            index += 1;
            out.push({ position, data, next: { segment: seg, offset, index } });
            from = nl + 1;
          }
          pending = pending.subarray(from);
        }
        if (torn) {
          const key = `${seg}:${offset}`;
          if (newest) return out; // a live writer may be finishing that line
          if (!this.warned.has(key)) {
            this.warned.add(key);
            this.warn(`${file}: torn tail at byte ${offset} (${pending.length} bytes without a newline): skipped`);
          }
        }
      } finally {
        fs.closeSync(fd);
      }
    }
    return out;
  }
}

const NEWLINE = Buffer.from("\n");

/** The byte length of the complete lines of a file, and how many there are. */
function scanLines(file: string): [number, number] {
  const fd = fs.openSync(file, "r");
  let end = 0;
  let count = 0;
  let pos = 0;
  const chunk = Buffer.allocUnsafe(1024 * 1024);
  try {
    for (;;) {
      const n = fs.readSync(fd, chunk, 0, chunk.length, pos);
      if (n === 0) break;
      const view = chunk.subarray(0, n);
      let at = view.indexOf(10);
      while (at >= 0) {
        count += 1;
        end = pos + at + 1;
        at = view.indexOf(10, at + 1);
      }
      pos += n;
    }
  } finally {
    fs.closeSync(fd);
  }
  return [end, count];
}
