/**
 * Redis counters, driven only through the repository's scripts in `lua/`
 * (Python: projections/counters/redis.py). Every call is one EVALSHA with
 * exactly the KEYS and ARGV the Python RedisBackend sends (the conformance
 * vectors hold the two together), so a Node server and a Python worker on one
 * Redis share every counter. The hot path writes each charge as RESP text
 * framed once per plan but for what varies per call (operation or event id,
 * lease, clock): the conformance suite holds that text to Python's command too.
 *
 * @example
 * const backend = RedisBackend.fromUrl("redis://127.0.0.1:6379/0");
 */
import { randomBytes } from "node:crypto";

import { Command, Redis, type RedisOptions } from "ioredis";

import { BackendUnavailableError, CounterOverflowError, GovernorError, InvalidInputError } from "../errors.js";
import { APPROVAL_KEY, EPOCH_KEY, LEASE_PREFIX, PLANS_KEY, opKey, queueKey, slides } from "../keys.js";
import { MAX_AMOUNT } from "../money.js";
import type { CounterOp } from "../planning.js";
import { script, type Script } from "../scripts.js";
import { ADMITTED_RESULT, type Backend, type ChargeOptions, type ChargeResult } from "./types.js";

export const DEFAULT_TIMEOUT = 0.25;

/** The argument by which lua/charge.lua resolves an op's effective cap. */
export function refArg(op: CounterOp): string {
  const ref = op.ref;
  if (ref === null) return "";
  if (ref.valueCap === null && !ref.planCaps.length) return ref.field;
  const parts = [
    ref.field,
    ref.valueCap === null ? "-" : String(ref.valueCap),
    ref.filePlan ?? "-",
    ref.planFields.join(","),
    ref.planCaps.map(([name, cap]) => `${name} ${cap}`).join(" "),
  ];
  return parts.join(" ").trimEnd();
}

interface Prepared {
  head: (string | number)[];
  counters: string[];
  tail: string[];
  /** How many lease sets (concurrency caps) the charge takes; their queues close KEYS. */
  leases: number;
  /** The same parts as RESP bulk strings (flags apart: the lease's arguments follow them). */
  headText: string;
  countersText: string;
  flagsText: string;
  restText: string;
}

/** One RESP bulk string. */
function bulk(arg: string | number): string {
  const s = String(arg);
  return `$${Buffer.byteLength(s)}\r\n${s}\r\n`;
}

/**
 * The EVALSHA command (without the word) for a charge: what RedisBackend sends.
 * Exported so the conformance suite compares it with Python's, argument for argument.
 */
export function chargeCommand(
  sha: string,
  ops: readonly CounterOp[],
  options: ChargeOptions & { requireEpoch?: boolean; nowMs?: number } = {},
): string[] {
  const p = prepare(sha, ops, options.wantUsed ?? true, options.opId != null && options.eventId == null, options.requireEpoch ?? false);
  return assemble(p, options, options.nowMs ?? Date.now()).map(String);
}

/**
 * The same command as the RESP text RedisBackend writes to the socket (the
 * conformance suite checks it against Python's command, encoded on its own).
 */
export function chargeFrame(
  sha: string,
  ops: readonly CounterOp[],
  options: ChargeOptions & { requireEpoch?: boolean; nowMs?: number } = {},
): string {
  const p = prepare(sha, ops, options.wantUsed ?? true, options.opId != null && options.eventId == null, options.requireEpoch ?? false);
  return frame(p, options, options.nowMs ?? Date.now());
}

function prepare(sha: string, ops: readonly CounterOp[], wantUsed: boolean, withOp: boolean, requireEpoch: boolean): Prepared {
  const keys: string[] = requireEpoch ? [EPOCH_KEY] : [];
  let counters: string[] = [];
  const tail: string[] = [];
  const resolve = ops.some((op) => op.ref !== null);
  const capsKeys: string[] = [];
  for (const op of ops) {
    counters.push(op.key);
    tail.push(String(op.amount), String(op.cap), op.enforce ? "1" : "0", String(op.expireAt));
    if (resolve) {
      tail.push(refArg(op));
      capsKeys.push(op.ref === null ? PLANS_KEY : op.ref.capsKey);
    }
  }
  if (resolve) counters.push(...capsKeys, PLANS_KEY);
  // Every lease set's queue comes last (lua/charge.lua 'l'): waiting calls go first.
  const queues = ops.filter((op) => op.key.startsWith(LEASE_PREFIX)).map((op) => queueKey(op.key));
  counters.push(...queues);
  const leases = queues.length;
  const flags =
    (leases ? "l" : "") + (requireEpoch ? "e" : "") + (wantUsed ? "u" : "") + (withOp ? "o" : "") + (resolve ? "c" : "") +
    (ops.some((op) => slides(op.key)) ? "s" : "");
  const numkeys = keys.length + counters.length + (withOp ? 1 : 0);
  let head: (string | number)[];
  if (withOp) head = [sha, numkeys, ...keys];
  else {
    head = [sha, numkeys, ...keys, ...counters];
    counters = [];
  }
  tail.unshift(flags || "-");
  const text = (xs: readonly (string | number)[]): string => xs.map(bulk).join("");
  return {
    head,
    counters,
    tail,
    leases,
    headText: text(head),
    countersText: text(counters),
    flagsText: bulk(tail[0] ?? "-"),
    restText: text(tail.slice(1)),
  };
}

/** A charge taking leases: the lease id, its time to live (ms), the ticket and how many sets. */
function leaseArgs(p: Prepared, options: ChargeOptions): string[] {
  if (options.lease == null) throw new InvalidInputError("lease", options.lease ?? null, "a charge taking leases needs a lease id");
  const ttl = String(Math.max(1, Math.round((options.leaseTtl ?? 0) * 1000)));
  return [options.lease, ttl, options.ticket ?? "-", String(p.leases)];
}

/** The charge's arguments around what varies per call; the caller's clock (epoch ms)
 * goes last (lua/lib.lua caller_ms: no script reads Redis' TIME). */
function assemble(p: Prepared, options: ChargeOptions, nowMs: number): (string | number)[] {
  const withOp = options.opId != null && options.eventId == null;
  const args = withOp
    ? [...p.head, opKey(options.opId ?? ""), ...p.counters, options.opId ?? "", ...p.tail]
    : [...p.head, options.eventId ?? "", ...p.tail];
  if (p.leases) args.splice(args.length - p.tail.length + 1, 0, ...leaseArgs(p, options));
  args.push(String(Math.floor(nowMs)));
  return args;
}

/**
 * assemble() as the RESP text of `EVALSHA <args>`: the parts fixed for a plan
 * were framed by prepare(), so a call frames only its ids and clock (ioredis
 * would count the bytes of every argument again on every call).
 */
function frame(p: Prepared, options: ChargeOptions, nowMs: number): string {
  const withOp = options.opId != null && options.eventId == null;
  let argc = p.head.length + 1 + p.tail.length + 1;
  let text = p.headText;
  if (withOp) {
    const id = options.opId ?? "";
    text += bulk(opKey(id)) + p.countersText + bulk(id);
    argc += 1 + p.counters.length;
  } else text += bulk(options.eventId ?? "");
  text += p.flagsText;
  if (p.leases) {
    text += leaseArgs(p, options).map(bulk).join("");
    argc += 4;
  }
  return `*${argc + 1}\r\n$7\r\nEVALSHA\r\n${text}${p.restText}${bulk(Math.floor(nowMs))}`;
}

/**
 * An EVALSHA written as prepared RESP text (ioredis' Command, but for how it
 * is framed). Its arguments stay out of ioredis' hands: key prefixes (which
 * would move the keys away from Python's) make RedisBackend use client.call.
 */
class FramedCommand extends Command {
  constructor(private readonly text: string) {
    super("evalsha", [], { replyEncoding: "utf8" });
  }

  override toWritable(): string {
    return this.text;
  }
}

function isUnavailable(err: unknown): boolean {
  if (!(err instanceof Error)) return false;
  const code = (err as { code?: string }).code ?? "";
  return (
    ["ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "EPIPE", "ENOTFOUND", "EHOSTUNREACH"].includes(code) ||
    /Command timed out|Connection is closed|connect ETIMEDOUT|Stream isn't writeable|max retries|LOADING|enableOfflineQueue/i.test(
      err.message,
    )
  );
}

export interface RedisBackendOptions {
  requireEpoch?: boolean;
  /** Epoch seconds: the clock the scripts are given (default the system clock). */
  clock?: () => number;
}

export class RedisBackend implements Backend {
  /** One charge may admit a call and charge its fixed price under two event ids (withCost, lua/charge.lua). */
  readonly pricesAtAdmission = true;
  readonly requireEpoch: boolean;
  readonly clock: () => number;
  private readonly scripts: Record<"charge" | "usage" | "lease", Script>;
  private readonly preparedByOps = new WeakMap<readonly CounterOp[], Prepared[]>();
  /** Whether charges go out as framed RESP text (not when ioredis prefixes keys). */
  private readonly framed: boolean;

  constructor(
    readonly client: Redis,
    options: RedisBackendOptions = {},
  ) {
    this.requireEpoch = options.requireEpoch ?? false;
    this.clock = options.clock ?? (() => Date.now() / 1000);
    this.scripts = { charge: script("charge"), usage: script("usage"), lease: script("lease") };
    this.framed = typeof client.sendCommand === "function" && !(client.options?.keyPrefix ?? "");
  }

  /**
   * Connect lazily to `url`; `timeout` (seconds) bounds every call, after which
   * the governor applies each limit's fail mode.
   */
  static fromUrl(
    url: string,
    options: RedisBackendOptions & { timeout?: number; redis?: RedisOptions } = {},
  ): RedisBackend {
    if (typeof url !== "string" || !/^rediss?:\/\//.test(url)) {
      throw new InvalidInputError("url", url, "expected a redis:// or rediss:// URL");
    }
    const ms = Math.round((options.timeout ?? DEFAULT_TIMEOUT) * 1000);
    const client = new Redis(url, {
      lazyConnect: true,
      commandTimeout: ms,
      connectTimeout: Math.max(ms, 1000),
      maxRetriesPerRequest: 1,
      retryStrategy: (times) => Math.min(times * 50, 1000),
      ...options.redis,
    });
    client.on("error", () => {
      /* reported per call as BackendUnavailableError */
    });
    return new RedisBackend(client, options);
  }

  private async evalsha(s: Script, args: (string | number)[]): Promise<unknown> {
    try {
      try {
        return await this.client.call("EVALSHA", ...args);
      } catch (err) {
        if (err instanceof Error && err.message.startsWith("NOSCRIPT")) {
          await this.client.call("SCRIPT", "LOAD", s.source);
          return await this.client.call("EVALSHA", ...args);
        }
        throw err;
      }
    } catch (err) {
      if (isUnavailable(err)) throw BackendUnavailableError.redis(err);
      throw err;
    }
  }

  /** evalsha() of a framed command: one promise, no further await unless Redis lost the script. */
  private sendFramed(s: Script, text: string): Promise<unknown> {
    const send = (): Promise<unknown> => {
      const command = new FramedCommand(text);
      void this.client.sendCommand(command);
      return command.promise;
    };
    return send().catch(async (err: unknown) => {
      try {
        if (!(err instanceof Error && err.message.startsWith("NOSCRIPT"))) throw err;
        await this.client.call("SCRIPT", "LOAD", s.source);
        return await send();
      } catch (e) {
        if (isUnavailable(e)) throw BackendUnavailableError.redis(e);
        throw e;
      }
    });
  }

  private prepared(ops: readonly CounterOp[], wantUsed: boolean, withOp: boolean): Prepared {
    const variant = (wantUsed ? 1 : 0) + (withOp ? 2 : 0);
    let byVariant = this.preparedByOps.get(ops);
    if (byVariant === undefined) {
      byVariant = [];
      this.preparedByOps.set(ops, byVariant);
    }
    let p = byVariant[variant];
    if (p === undefined) {
      p = prepare(this.scripts.charge.sha, ops, wantUsed, withOp, this.requireEpoch);
      byVariant[variant] = p;
    }
    return p;
  }

  async charge(ops: readonly CounterOp[], options: ChargeOptions = {}): Promise<ChargeResult> {
    const p = this.prepared(ops, options.wantUsed ?? true, options.opId != null && options.eventId == null);
    const nowMs = this.clock() * 1000;
    const reply = (await (this.framed
      ? this.sendFramed(this.scripts.charge, frame(p, options, nowMs))
      : this.evalsha(this.scripts.charge, assemble(p, options, nowMs)))) as number[];
    const head = Number(reply[0]);
    if (head === 0 && reply.length === 1) return ADMITTED_RESULT;
    if (head === -2) {
      const op = ops[Number(reply[1]) - 1];
      const limit = op?.key.split(":")[2] ?? "";
      throw new CounterOverflowError(limit, op?.amount ?? 0, op?.key ?? "", MAX_AMOUNT);
    }
    if (head < 0) throw new BackendUnavailableError("redis lost its state (epoch marker missing): rebuilding");
    const n = ops.length;
    const values = reply.length - 1;
    if (values === 2 * n && ops.some((op) => op.ref !== null)) {
      const used = new Array<number>(n);
      const caps = new Array<number>(n);
      for (let i = 0; i < n; i++) {
        used[i] = Number(reply[i + 1]);
        caps[i] = Number(reply[n + i + 1]);
      }
      return { refused: head - 1, used, caps };
    }
    const used = new Array<number>(values);
    for (let i = 0; i < values; i++) used[i] = Number(reply[i + 1]);
    return { refused: head - 1, used, caps: [] };
  }

  chargeSent(ops: readonly CounterOp[], options: ChargeOptions): Promise<ChargeResult> | null {
    // Framed and connected, charge() writes its command before its first await:
    // ioredis writes a ready connection's commands at once, in order.
    if (!this.framed || this.client.status !== "ready") return null;
    return this.charge(ops, options);
  }

  async usage(keys: readonly string[]): Promise<number[]> {
    if (!keys.length) return [];
    const s = this.scripts.usage;
    const reply = (await this.evalsha(s, [s.sha, keys.length, ...keys])) as string[];
    const out: number[] = [];
    for (let i = 0; i < reply.length; i += 2) out.push(Number(reply[i]) + Number(reply[i + 1]));
    return out;
  }

  private async leases(keys: readonly string[], ...args: string[]): Promise<number[]> {
    if (!keys.length) return [];
    const s = this.scripts.lease;
    const nowMs = String(Math.floor(this.clock() * 1000));
    return ((await this.evalsha(s, [s.sha, keys.length, ...keys, ...args, nowMs])) as number[]).map(Number);
  }

  async release(keys: readonly string[], lease: string): Promise<number> {
    return (await this.leases(keys, "r", lease)).reduce((a, b) => a + b, 0);
  }

  async renew(keys: readonly string[], lease: string, ttl: number): Promise<number> {
    return (await this.leases(keys, "n", lease, String(Math.max(1, Math.round(ttl * 1000))))).reduce((a, b) => a + b, 0);
  }

  async leave(keys: readonly string[], ticket: string): Promise<number> {
    return (await this.leases(keys.map(queueKey), "q", ticket)).reduce((a, b) => a + b, 0);
  }

  async inProgress(keys: readonly string[]): Promise<number[]> {
    return this.leases(keys, "c");
  }

  /**
   * The approval seal's key in APPROVAL_KEY: the first replica to need it sets 32
   * random bytes (as hex) with SET NX, and every replica reads the one that won.
   */
  async approvalKey(): Promise<Uint8Array> {
    try {
      let value = (await this.client.call("GET", APPROVAL_KEY)) as string | null;
      if (value === null) {
        await this.client.call("SET", APPROVAL_KEY, randomBytes(32).toString("hex"), "NX");
        value = (await this.client.call("GET", APPROVAL_KEY)) as string | null;
      }
      const key = Buffer.from(value ?? "", "hex");
      if (key.length !== 32 || key.toString("hex") !== value) {
        throw new GovernorError(`${APPROVAL_KEY} holds no approval key (expected 64 hex digits)`);
      }
      return key;
    } catch (err) {
      if (isUnavailable(err)) throw BackendUnavailableError.redis(err);
      throw err;
    }
  }

  async close(): Promise<void> {
    try {
      await this.client.quit();
    } catch {
      this.client.disconnect();
    }
  }
}
