/**
 * Postgres counters, driven only through the functions in the repository's `sql/`
 * (Python: projections/counters/postgres.py). Checks are coalesced into
 * `mcpbg_charge_many` calls (see charge()), charges with leases are one
 * `mcpbg_charge` call, each with exactly the arguments Python's PostgresBackend
 * passes (the conformance vectors hold the two together), so Node and Python
 * replicas on one database share every counter. The migrations are the same files, applied on first use
 * under the same advisory lock into the same `mcpbg_migrations` table, each once,
 * whichever language comes first.
 *
 * Busy is not down. A server that answers but is overloaded makes a
 * BackendBusyError, and the governor refuses with 503 ("postgres busy"), never
 * applying a fail mode: no pooled connection free within `queueTimeout`; the
 * server's own statement timeout (SQLSTATE 57014: a row or advisory lock queue, a
 * slow function); 55P03 lock_not_available; class 53 (insufficient resources: 53300
 * too_many_connections). The same classes as Python's backend. Only a store that cannot be reached makes a BackendUnavailableError, to
 * which each limit's fail mode applies: a refused or reset connection (ECONNREFUSED,
 * ECONNRESET, EPIPE, ETIMEDOUT, EHOSTUNREACH, ENOTFOUND...), a socket that died or
 * never answered (node-postgres' "Connection terminated", "Query read timeout"),
 * SQLSTATE class 08, 57P01-57P03 (the server shutting down or starting) and class
 * 28 / 3D000 (the connection itself refused). A full pool's wait that ends while
 * the server was last seen unreachable counts as unreachable too.
 *
 * `timeout` is the server round trip: Postgres cancels a statement past it
 * (statement_timeout, so the cancel is the server's, and says the server lives);
 * no answer `answerGrace` seconds after that means a dead socket.
 *
 * @example
 * const backend = PostgresBackend.fromUrl("postgresql://postgres@127.0.0.1:5432/app");
 */
import { readFileSync, readdirSync } from "node:fs";

import pg from "pg";

import { BackendBusyError, BackendUnavailableError, CounterOverflowError, GovernorError, InvalidInputError } from "../errors.js";
import { LEASE_PREFIX, PLANS_KEY } from "../keys.js";
import { MAX_AMOUNT } from "../money.js";
import type { CounterOp } from "../planning.js";
import { ADMITTED_RESULT, type Backend, type ChargeOptions, type ChargeResult } from "./types.js";

// The defaults are Python's PostgresBackend's (docs/postgres.md), so a fleet of both
// languages is sized by one rule.
/** Seconds a call may take on the server (its statement_timeout, lock waits included). */
export const DEFAULT_TIMEOUT = 2;
/**
 * Connections per process: 19 replicas fit Postgres' default max_connections (100,
 * of which 3 are reserved for superusers): (max_connections - 3) / 5.
 */
export const DEFAULT_MAX_CONNECTIONS = 5;
/** Seconds a call may wait for a pooled connection before it is refused as busy. */
export const DEFAULT_QUEUE_TIMEOUT = 5;
/** Seconds past `timeout` without any reply after which the socket counts as dead. */
export const DEFAULT_ANSWER_GRACE = 1;

/** The hot path's statement: the text of Python's, placeholders numbered (vectors "sql"). */
export const CHARGE_SQL =
  "SELECT mcpbg_charge($1, $2, $3, $4, $5::text[], $6::bigint[], $7::bigint[], $8::boolean[], $9::float8[], " +
  "$10, $11::boolean[], $12::text[], $13::text[], $14::bigint[], $15::text[], $16::text[], $17::text[], $18, $19, $20)";

/** Coalesced checks (sql/0005_charge_many.sql): Python's statement, placeholders numbered. */
export const CHARGE_MANY_SQL =
  "SELECT * FROM mcpbg_charge_many($1, $2::text[], $3::text[], $4::boolean[], $5::boolean[], $6::int[], " +
  "$7::text[], $8::bigint[], $9::bigint[], $10::boolean[], $11::float8[], $12::boolean[], $13::text[], " +
  "$14::text[], $15::bigint[], $16::text[], $17::text[], $18::text[])";
/** The most checks one coalesced call carries (Python's MAX_BATCH); the rest go in the next. */
export const MAX_BATCH = 256;

/** The advisory lock migrations take (Python's _MIGRATION_LOCK; another class than the counters'). */
const MIGRATION_LOCK = 1835233379;
/** The copied migrations: `<package>/sql/` (scripts/copy-lua.mjs), from src/ or dist/ alike. */
export const SQL_DIR = new URL("../../sql/", import.meta.url);

/** SQLSTATEs of a live server that is overloaded; class 53 (insufficient resources) too. */
const BUSY_CODES = new Set(["57014", "55P03"]);
const DOWN_CODES = new Set(["57P01", "57P02", "57P03", "3D000"]);
const DOWN_ERRNOS = new Set([
  "ECONNREFUSED",
  "ECONNRESET",
  "ECONNABORTED",
  "EPIPE",
  "ETIMEDOUT",
  "EHOSTUNREACH",
  "ENETUNREACH",
  "ENOTFOUND",
  "EAI_AGAIN",
]);
const DOWN_TEXT = /Connection terminated|Query read timeout|not queryable|Connection ended|connect ETIMEDOUT|socket hang up/i;
/** pg-pool's words when a call waited for a free connection of a full pool too long. */
const POOL_WAIT_TEXT = /timeout exceeded when trying to connect/i;

/** The arguments of one `mcpbg_charge` call (Python: postgres.charge_params). */
export function chargeParams(
  ops: readonly CounterOp[],
  options: ChargeOptions & { requireEpoch?: boolean } = {},
): unknown[] {
  const eventId = options.eventId ?? null;
  const opId = options.opId != null && eventId === null ? options.opId : null;
  const leases = ops.some((op) => op.key.startsWith(LEASE_PREFIX));
  if (leases && options.lease == null) {
    throw new InvalidInputError("lease", options.lease ?? null, "a charge taking leases needs a lease id");
  }
  const refs = ops.map((op) => op.ref);
  return [
    eventId ?? "",
    opId ?? "",
    options.wantUsed ?? true,
    options.requireEpoch ?? false,
    ops.map((op) => op.key),
    ops.map((op) => op.amount),
    ops.map((op) => op.cap),
    ops.map((op) => op.enforce),
    ops.map((op) => op.expireAt),
    refs.some((r) => r !== null),
    refs.map((r) => r !== null),
    refs.map((r) => (r === null ? PLANS_KEY : r.capsKey)),
    refs.map((r) => (r === null ? "" : r.field)),
    refs.map((r) => (r === null ? null : r.valueCap)),
    refs.map((r) => (r === null ? "" : r.planFields.join(","))),
    refs.map((r) => (r === null ? "" : r.planCaps.map(([name, cap]) => `${name} ${cap}`).join(" "))),
    refs.map((r) => (r === null ? "" : (r.filePlan ?? ""))),
    leases ? (options.lease ?? "") : "",
    Math.max(1, Math.round((options.leaseTtl ?? 0) * 1000)),
    leases ? (options.ticket ?? "") : "",
  ];
}

/** One check of a coalesced call: what mcpbg_charge_many takes for it. */
export interface BatchedCheck {
  readonly ops: readonly CounterOp[];
  readonly eventId: string | null;
  readonly opId: string | null;
  readonly wantUsed: boolean;
}

/** The arguments of one `mcpbg_charge_many` call (Python: PostgresBackend.charge_many). */
export function chargeManyParams(checks: readonly BatchedCheck[], requireEpoch: boolean): unknown[] {
  const ops = checks.flatMap((c) => c.ops);
  const refs = ops.map((op) => op.ref);
  return [
    requireEpoch,
    checks.map((c) => c.eventId ?? ""),
    checks.map((c) => (c.eventId === null ? (c.opId ?? "") : "")),
    checks.map((c) => c.wantUsed),
    checks.map((c) => c.ops.some((op) => op.ref !== null)),
    checks.map((c) => c.ops.length),
    ops.map((op) => op.key),
    ops.map((op) => op.amount),
    ops.map((op) => op.cap),
    ops.map((op) => op.enforce),
    ops.map((op) => op.expireAt),
    refs.map((r) => r !== null),
    refs.map((r) => (r === null ? PLANS_KEY : r.capsKey)),
    refs.map((r) => (r === null ? "" : r.field)),
    refs.map((r) => (r === null ? null : r.valueCap)),
    refs.map((r) => (r === null ? "" : r.planFields.join(","))),
    refs.map((r) => (r === null ? "" : r.planCaps.map(([name, cap]) => `${name} ${cap}`).join(" "))),
    refs.map((r) => (r === null ? "" : (r.filePlan ?? ""))),
  ];
}

/** A check waiting for the next coalesced call. */
interface Waiting extends BatchedCheck {
  readonly since: number;
  readonly resolve: (reply: number[]) => void;
  readonly reject: (err: unknown) => void;
}

/** `url` without its credentials (Python: urls.redact). */
export function redact(url: string): string {
  const at = url.indexOf("://");
  if (at < 0) return url;
  let rest = url.slice(at + 3);
  const slash = rest.search(/[/?]/);
  const authority = slash < 0 ? rest : rest.slice(0, slash);
  if (authority.includes("@")) rest = "***@" + rest.slice(authority.lastIndexOf("@") + 1);
  return url.slice(0, at + 3) + rest.replace(/([?&]password=)[^&]*/i, "$1***");
}

/** How a failed call reads: busy (overload), down (unreachable), or neither (a bug: rethrown). */
export function classify(err: unknown, serverSeen: boolean): "busy" | "down" | null {
  if (!(err instanceof Error)) return null;
  const code = (err as { code?: unknown }).code;
  if (typeof code === "string") {
    if (BUSY_CODES.has(code) || code.startsWith("53")) return "busy";
    if (DOWN_CODES.has(code) || code.startsWith("08") || code.startsWith("28") || DOWN_ERRNOS.has(code)) return "down";
  }
  if (POOL_WAIT_TEXT.test(err.message)) return serverSeen ? "busy" : "down";
  if (DOWN_TEXT.test(err.message)) return "down";
  return null;
}

function firstLine(err: Error): string {
  return (err.message.trim().split("\n")[0] ?? "") || err.name;
}

/** A charge's reply (mcpbg_charge's, or one check's of mcpbg_charge_many) as a ChargeResult. */
function decode(ops: readonly CounterOp[], reply: readonly number[]): ChargeResult {
  const head = reply[0] ?? 0;
  if (head === 0 && reply.length === 1) return ADMITTED_RESULT;
  if (head === -2) {
    const op = ops[(reply[1] ?? 0) - 1];
    const limit = op?.key.split(":")[2] ?? "";
    throw new CounterOverflowError(limit, op?.amount ?? 0, op?.key ?? "", MAX_AMOUNT);
  }
  if (head < 0) throw new BackendUnavailableError("postgres counters not complete (no epoch): rebuilding");
  const n = ops.length;
  const values = reply.slice(1);
  if (values.length === 2 * n && ops.some((op) => op.ref !== null)) {
    return { refused: head - 1, used: values.slice(0, n), caps: values.slice(n) };
  }
  return { refused: head - 1, used: values, caps: [] };
}

/** The migrations `sql/` ships, oldest first (Python: mcp_budget_governor.sql.migrations). */
export function migrations(dir: URL = SQL_DIR): { version: number; name: string; text: string }[] {
  let files: string[];
  try {
    files = readdirSync(dir);
  } catch {
    throw new GovernorError(`sql/ is missing: run "npm run build" (it copies ../sql into the package)`);
  }
  const found = files
    .map((f) => /^(\d{4})_([a-z0-9_]+)\.sql$/.exec(f))
    .filter((m): m is RegExpExecArray => m !== null)
    .map((m) => ({ version: Number(m[1]), name: m[2] ?? "", text: readFileSync(new URL(m[0], dir), "utf8") }))
    .sort((a, b) => a.version - b.version);
  if (found.some((m, i) => m.version !== i + 1)) {
    throw new GovernorError(`sql/: migrations must be numbered 1..n without gaps: ${found.map((m) => m.version).join(",")}`);
  }
  return found;
}

export interface PostgresBackendOptions {
  /** Seconds a call may take on the server (statement_timeout); default 2. */
  timeout?: number;
  /** Pooled connections of this process; default 5 (see DEFAULT_MAX_CONNECTIONS). */
  maxConnections?: number;
  /** Seconds a call waits for a free pooled connection, then is refused as busy; default 5. */
  queueTimeout?: number;
  /** Seconds past `timeout` without any answer after which the socket counts as dead; default 1. */
  answerGrace?: number;
  /** Until the stream worker declares the counters complete, every charge counts as unreachable. */
  requireEpoch?: boolean;
  /** false: commit without waiting for the WAL flush (synchronous_commit=off; docs/postgres.md). */
  durable?: boolean;
  /** More node-postgres pool settings (they win over the ones derived above). */
  pool?: pg.PoolConfig;
}

export class PostgresBackend implements Backend {
  /** One charge may admit a call and charge its fixed price under two event ids (withCost; sql/0010_priced_admission.sql). */
  readonly pricesAtAdmission = true;
  readonly requireEpoch: boolean;
  readonly timeout: number;
  readonly durable: boolean;
  private migrated: Promise<void> | null = null;
  /** Whether the server answered last time it was asked (a full pool's wait is then busy). */
  private serverSeen = true;
  /** Calls in flight at most (the pool's size) and how long a check may wait for one. */
  readonly maxConnections: number;
  readonly queueTimeout: number;
  // The coalescer (Python: postgres._Coalescer): checks arriving while calls are in
  // flight wait here, in order, and go together in the next call.
  private readonly waiting: Waiting[] = [];
  private inFlight = 0;
  private scheduled = false;
  private watch: NodeJS.Timeout | null = null;

  constructor(
    readonly pool: pg.Pool,
    readonly url: string,
    options: PostgresBackendOptions = {},
  ) {
    this.requireEpoch = options.requireEpoch ?? false;
    this.timeout = options.timeout ?? DEFAULT_TIMEOUT;
    this.durable = options.durable ?? true;
    this.maxConnections = pool.options.max ?? options.maxConnections ?? DEFAULT_MAX_CONNECTIONS;
    this.queueTimeout = options.queueTimeout ?? DEFAULT_QUEUE_TIMEOUT;
    // An idle connection the server dropped: the pool discards it; the next call reports.
    pool.on("error", () => undefined);
    // A connection that dies while checked out fails its query (reported by the call);
    // without a listener its 'error' event would also end the process.
    pool.on("connect", (client) => client.on("error", () => undefined));
  }

  /** Connect lazily to `url` (postgres:// or postgresql://); see PostgresBackendOptions. */
  static fromUrl(url: string, options: PostgresBackendOptions = {}): PostgresBackend {
    if (typeof url !== "string" || !/^postgres(ql)?:\/\/./i.test(url)) {
      throw new InvalidInputError("url", typeof url === "string" ? redact(url) : url, "expected postgresql://user@host:port/database");
    }
    const positive = (field: string, value: number | undefined, fallback: number): number => {
      const v = value ?? fallback;
      if (typeof v !== "number" || !Number.isFinite(v) || v <= 0) throw new InvalidInputError(field, v, "must be a positive number");
      return v;
    };
    const timeout = positive("timeout", options.timeout, DEFAULT_TIMEOUT);
    const max = positive("maxConnections", options.maxConnections, DEFAULT_MAX_CONNECTIONS);
    if (!Number.isInteger(max)) throw new InvalidInputError("maxConnections", max, "must be a whole number");
    const queue = positive("queueTimeout", options.queueTimeout, DEFAULT_QUEUE_TIMEOUT);
    const grace = positive("answerGrace", options.answerGrace, DEFAULT_ANSWER_GRACE);
    const durable = options.durable ?? true;
    const pool = new pg.Pool({
      connectionString: url,
      max,
      // A new connection's handshake and a full pool's queue share this bound
      // (node-postgres has one); the error words tell them apart (classify()).
      connectionTimeoutMillis: Math.round(queue * 1000),
      statement_timeout: Math.round(timeout * 1000),
      query_timeout: Math.round((timeout + grace) * 1000),
      idleTimeoutMillis: 30_000,
      application_name: "mcpbg",
      ...(durable ? {} : { options: "-c synchronous_commit=off" }),
      ...options.pool,
    });
    return new PostgresBackend(pool, url, { ...options, timeout, durable });
  }

  private fail(err: unknown): unknown {
    const kind = classify(err, this.serverSeen);
    if (kind === null) {
      // P0001: a function refused its input (Python: ValueError).
      if (err instanceof pg.DatabaseError && err.code === "P0001") return new GovernorError(firstLine(err));
      return err;
    }
    const text = firstLine(err as Error);
    if (kind === "busy") {
      this.serverSeen = true;
      return new BackendBusyError("postgres", text);
    }
    this.serverSeen = false;
    return new BackendUnavailableError(`postgres ${redact(this.url)} unreachable: ${text}`);
  }

  /** One statement on a pooled connection; a connection that failed is discarded, not reused. */
  private async query(text: string, values: unknown[], name?: string): Promise<pg.QueryResult> {
    if (this.migrated === null) this.migrated = this.migrateOnce();
    try {
      await this.migrated;
    } catch (err) {
      this.migrated = null;
      throw err;
    }
    let client: pg.PoolClient;
    try {
      client = await this.pool.connect();
    } catch (err) {
      throw this.fail(err);
    }
    try {
      const result = await client.query(name === undefined ? { text, values } : { name, text, values });
      this.serverSeen = true;
      client.release();
      return result;
    } catch (err) {
      const failure = this.fail(err);
      client.release(failure instanceof BackendUnavailableError ? (err as Error) : undefined);
      throw failure;
    }
  }

  private async value(text: string, values: unknown[], name?: string): Promise<unknown> {
    const row = (await this.query(text, values, name)).rows[0] as Record<string, unknown> | undefined;
    return row === undefined ? null : Object.values(row)[0];
  }

  /** Apply every pending migration now (else the first call does); the schema version after. */
  async migrate(): Promise<number> {
    if (this.migrated === null) this.migrated = this.migrateOnce();
    try {
      await this.migrated;
    } catch (err) {
      this.migrated = null;
      throw err;
    }
    return migrations().length;
  }

  /** Python's migrate_connection: one transaction, under the migration lock, each file once. */
  private async migrateOnce(): Promise<void> {
    const all = migrations();
    let client: pg.PoolClient;
    try {
      client = await this.pool.connect();
    } catch (err) {
      throw this.fail(err);
    }
    try {
      await client.query("BEGIN");
      // Replicas starting together wait here for each other, past the hot path's timeout.
      await client.query("SET LOCAL statement_timeout = '60s'");
      await client.query("SELECT pg_advisory_xact_lock($1)", [MIGRATION_LOCK]);
      await client.query(
        "CREATE TABLE IF NOT EXISTS mcpbg_migrations (version integer PRIMARY KEY, " +
          "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
      );
      const rows = (await client.query("SELECT version FROM mcpbg_migrations")).rows as { version: number }[];
      const have = new Set(rows.map((r) => Number(r.version)));
      for (const m of all) {
        if (have.has(m.version)) continue;
        await client.query(m.text);
        await client.query("INSERT INTO mcpbg_migrations (version, name) VALUES ($1, $2)", [m.version, m.name]);
      }
      await client.query("COMMIT");
    } catch (err) {
      await client.query("ROLLBACK").catch(() => undefined);
      const failure = this.fail(err);
      client.release(failure instanceof BackendUnavailableError ? (err as Error) : undefined);
      throw failure;
    }
    this.serverSeen = true;
    client.release();
  }

  /**
   * A charge with leases (concurrency caps, wait tickets) is one mcpbg_charge call of
   * its own; every other goes through the coalescer: alone when nothing is in flight,
   * else with the checks that arrived meanwhile, in one mcpbg_charge_many call (one
   * transaction; each decided in arrival order, seeing the ones before it).
   */
  async charge(ops: readonly CounterOp[], options: ChargeOptions = {}): Promise<ChargeResult> {
    let reply: number[];
    if (ops.some((op) => op.key.startsWith(LEASE_PREFIX))) {
      const params = chargeParams(ops, { ...options, requireEpoch: this.requireEpoch });
      // Named: parsed and planned once per connection.
      reply = ((await this.value(CHARGE_SQL, params, "mcpbg_charge")) as (string | number)[]).map(Number);
    } else {
      reply = await this.coalesced({ ops, eventId: options.eventId ?? null, opId: options.opId ?? null, wantUsed: options.wantUsed ?? true });
    }
    return decode(ops, reply);
  }

  /** One mcpbg_charge_many call: each check's reply, in order. */
  async chargeMany(checks: readonly BatchedCheck[]): Promise<number[][]> {
    const result = await this.query(CHARGE_MANY_SQL, chargeManyParams(checks, this.requireEpoch), "mcpbg_charge_many");
    return result.rows.map((row: Record<string, unknown>) => (Object.values(row)[0] as (string | number)[]).map(Number));
  }

  private coalesced(check: BatchedCheck): Promise<number[]> {
    if (!this.inFlight && !this.waiting.length) {
      this.inFlight++; // alone: sent at once
      return this.chargeMany([check])
        .then((replies) => replies[0] ?? [])
        .finally(() => {
          this.inFlight--;
          this.kick();
        });
    }
    return new Promise<number[]>((resolve, reject) => {
      this.waiting.push({ ...check, since: performance.now(), resolve, reject });
      this.kick();
    });
  }

  private kick(): void {
    if (!this.waiting.length) return;
    if (!this.scheduled && this.inFlight < this.maxConnections) {
      this.scheduled = true;
      setImmediate(() => this.flush()); // after this turn: its checks go together
    } else this.expireLater();
  }

  private flush(): void {
    this.scheduled = false;
    while (this.waiting.length && this.inFlight < this.maxConnections) {
      this.inFlight++;
      void this.send(this.waiting.splice(0, MAX_BATCH));
    }
    this.expireLater();
  }

  private async send(batch: Waiting[]): Promise<void> {
    try {
      const replies = await this.chargeMany(batch);
      batch.forEach((c, i) => c.resolve(replies[i] ?? []));
    } catch (err) {
      for (const c of batch) c.reject(err);
    } finally {
      this.inFlight--;
      this.kick();
    }
  }

  private expireLater(): void {
    if (this.waiting.length && this.watch === null) {
      this.watch = setTimeout(() => this.expire(), 100);
      this.watch.unref();
    }
  }

  /** Refuse as busy the checks that waited past queueTimeout (never sent: nothing charged). */
  private expire(): void {
    this.watch = null;
    const end = performance.now() - this.queueTimeout * 1000;
    while ((this.waiting[0]?.since ?? Infinity) <= end) {
      const c = this.waiting.shift();
      c?.reject(new BackendBusyError("postgres", `${this.maxConnections} calls in flight for ${this.queueTimeout}s; this check was not sent`));
    }
    this.expireLater();
  }

  async usage(keys: readonly string[]): Promise<number[]> {
    if (!keys.length) return [];
    const out = (await this.value("SELECT mcpbg_usage($1::text[])", [[...keys]], "mcpbg_usage")) as (string | number)[];
    return out.map(Number);
  }

  private async leases(mode: "r" | "n" | "c", keys: readonly string[], lease: string, ttlMs: number): Promise<number[]> {
    if (!keys.length) return [];
    const sql = "SELECT mcpbg_leases($1, $2::text[], $3, $4)";
    return ((await this.value(sql, [mode, [...keys], lease, ttlMs], "mcpbg_leases")) as (string | number)[]).map(Number);
  }

  async release(keys: readonly string[], lease: string): Promise<number> {
    return (await this.leases("r", keys, lease, 0)).reduce((a, b) => a + b, 0);
  }

  async renew(keys: readonly string[], lease: string, ttl: number): Promise<number> {
    return (await this.leases("n", keys, lease, Math.max(1, Math.round(ttl * 1000)))).reduce((a, b) => a + b, 0);
  }

  async inProgress(keys: readonly string[]): Promise<number[]> {
    return this.leases("c", keys, "", 0);
  }

  async leave(keys: readonly string[], ticket: string): Promise<number> {
    if (!keys.length) return 0;
    return Number(await this.value("SELECT mcpbg_leave($1::text[], $2)", [[...keys], ticket], "mcpbg_leave"));
  }

  /** Whether the counters are declared complete (the stream worker's epoch marker). */
  async hasEpoch(): Promise<boolean> {
    return Boolean(await this.value("SELECT mcpbg_epoch_ok()", []));
  }

  async close(): Promise<void> {
    if (!this.pool.ended) await this.pool.end();
  }
}
