// PostgresBackend on a real Postgres (test/services.ts postgresUrl: the database pytest
// passes, else one of this suite's own on the local server): exact admission under
// concurrency with every setting at its default, leases, and the two ways a store
// fails: busy (a full pool, a held counter lock: 503 "postgres busy", never the fail
// mode) and unreachable (a refused connection: each limit's fail mode). The Python
// backend on the same database: tests/test_typescript_postgres.py.
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import pg from "pg";

import {
  BackendUnavailableError,
  EntryType,
  FailMode,
  Governor,
  InvalidInputError,
  Limit,
  MemoryLedger,
  Policy,
  PostgresBackend,
  Scope,
  Unit,
  Window,
  context,
  usd,
  type Backend,
  type ChargeOptions,
  type ChargeResult,
} from "../src/index.js";
import { classify, migrations } from "../src/backends/postgres.js";
import { governedCall } from "../src/integrations/common.js";
import { checkPlan, type CounterOp } from "../src/planning.js";
import { freePort, fresh, postgresUrl } from "./services.js";

const day = (name: string, cap: number, failMode: FailMode = FailMode.OPEN): Limit =>
  new Limit(name, { cap, window: Window.DAY, scope: Scope.USER, failMode });

describe("PostgresBackend", () => {
  let url: string;
  let backend: PostgresBackend;
  let admin: pg.Client;

  before(async () => {
    url = await postgresUrl();
    backend = PostgresBackend.fromUrl(url); // every setting at its default
    admin = new pg.Client({ connectionString: url });
    await admin.connect();
  });

  after(async () => {
    await backend.close();
    await admin.end();
  });

  it("migrates the database with the sql/ files, as Python's backend records them", async () => {
    assert.equal(await backend.migrate(), migrations().length);
    const rows = (await admin.query("SELECT version, name FROM mcpbg_migrations ORDER BY version")).rows as { version: number; name: string }[];
    assert.deepEqual(
      rows.map((r) => [r.version, r.name]),
      migrations().map((m) => [m.version, m.name]),
    );
  });

  it("admits exactly the cap out of concurrent checks, and reads what it counted", async () => {
    const gov = new Governor(Policy.of(day("burst", 7), day("spend", 50)), backend);
    const ctx = context({ user: fresh("pg") });
    const ds = await Promise.all(Array.from({ length: 40 }, () => gov.check(ctx)));
    assert.equal(ds.filter((d) => d.admitted).length, 7);
    assert.deepEqual(new Set(ds.map((d) => d.status)), new Set([200, 429]));
    assert.ok(ds.every((d) => !d.degraded), "every check decided by Postgres");
    assert.equal(await gov.usage("burst", ctx), 7);
    assert.equal(await gov.usage("spend", ctx), 7);
    assert.deepEqual(await backend.usage([]), []);
  });

  it("charges a fixed price with its admission, in one call, each event's in-flight amounts under its own id", async () => {
    assert.equal(backend.pricesAtAdmission, true);
    const ledger = new MemoryLedger();
    const policy = Policy.of(
      day("calls", 100),
      new Limit("spend", { cap: usd("0.02"), window: Window.DAY, scope: Scope.USER, unit: Unit.USD_MICROS }),
    );
    const gov = new Governor(policy, backend, { ledger });
    const ctx = context({ user: fresh("priced") });
    const price = { spend: usd("0.01") };
    let charges = 0;
    const real = backend.charge.bind(backend);
    backend.charge = (...args: Parameters<Backend["charge"]>) => {
      charges += 1;
      return real(...args);
    };
    try {
      for (let i = 0; i < 2; i++) assert.equal(await governedCall(gov, ctx, async () => "ok", price, null), "ok");
      assert.equal(charges, 2, "one mcpbg_charge_many call a governed call: nothing charged after the tool");
      await assert.rejects(governedCall(gov, ctx, async () => "ok", price, null), /budget_exceeded/); // the price does not fit
    } finally {
      backend.charge = real;
    }
    assert.deepEqual(ledger.entries.map((e) => e.type), [EntryType.ADMITTED, EntryType.METERED, EntryType.ADMITTED, EntryType.METERED, EntryType.REJECTED]);
    const pending = async (limit: string): Promise<[string, number][]> => {
      const key = ledger.entries.flatMap((e) => e.charges).find((c) => c?.limit === limit)?.key ?? "";
      const rows = (await admin.query("SELECT event_id, amount FROM mcpbg_pending WHERE key = $1 ORDER BY event_id", [key])).rows as { event_id: string; amount: string }[];
      return rows.map((r) => [r.event_id, Number(r.amount)]);
    };
    const ids = (type: EntryType): string[] => ledger.entries.filter((e) => e.type === type).map((e) => e.id).sort();
    assert.deepEqual(await pending("calls"), ids(EntryType.ADMITTED).map((id) => [id, 1]));
    assert.deepEqual(await pending("spend"), ids(EntryType.METERED).map((id) => [id, Number(usd("0.01"))]));
  });

  it("decides a burst of 125 concurrent checks on one counter in Postgres, exactly, with the defaults", async () => {
    const gov = new Governor(Policy.of(day("burst", 50)), backend);
    const ctx = context({ user: fresh("burst") });
    const ds = await Promise.all(Array.from({ length: 125 }, () => gov.check(ctx)));
    const count = (status: number): number => ds.filter((d) => d.status === status).length;
    assert.deepEqual([count(200), count(429), count(503)], [50, 75, 0], "5 connections queue 125 checks, none refused as busy");
    assert.ok(ds.every((d) => !d.degraded), "none decided by the fail mode");
    assert.equal(await gov.usage("burst", ctx), 50);
  });

  it("counts a store whose counters are not declared complete (requireEpoch) as unreachable", async () => {
    const strict = PostgresBackend.fromUrl(url, { requireEpoch: true });
    try {
      assert.equal(await strict.hasEpoch(), false); // no stream worker marked this database
      const gov = new Governor(Policy.of(day("open", 5, FailMode.OPEN), day("closed", 5, FailMode.CLOSED)), strict);
      const d = await gov.check(context({ user: fresh("epoch") }));
      assert.deepEqual([d.status, d.reason, d.degraded], [503, "budget_unavailable:user/day", true]);
    } finally {
      await strict.close();
    }
  });

  it("holds, counts and gives back concurrency leases", async () => {
    const gov = new Governor(Policy.of(new Limit("parallel", { cap: 2, unit: Unit.CONCURRENT, scope: Scope.USER })), backend);
    const ctx = context({ user: fresh("lease") });
    const a = await gov.check(ctx);
    const b = await gov.check(ctx);
    const c = await gov.check(ctx);
    assert.deepEqual([a.admitted, b.admitted, c.admitted], [true, true, false]);
    assert.equal(await gov.usage("parallel", ctx), 2);
    assert.equal(await gov.renew(a), true);
    await gov.release(a);
    assert.equal(await gov.usage("parallel", ctx), 1);
    assert.equal((await gov.check(ctx)).admitted, true);
    // A waiting call that gives up leaves the queue (mcpbg_leave): the next caller gets the slot.
    const waited = await gov.check(ctx, { wait: 0.05 });
    assert.deepEqual([waited.admitted, waited.status], [false, 429]);
    await gov.release(b);
    assert.equal((await gov.check(ctx)).admitted, true);
  });

  it("refuses a check as busy while another transaction holds its counter's lock", async () => {
    const gov = new Governor(Policy.of(day("closed", 5, FailMode.CLOSED), day("open", 5, FailMode.OPEN)), backend);
    const ctx = context({ user: fresh("locked") });
    assert.equal((await gov.check(ctx)).admitted, true);
    const key = checkPlan(gov.policy, ctx, Date.now() / 1000).slots[0]?.key ?? "";
    await admin.query("BEGIN");
    await admin.query("SELECT mcpbg_lock($1::text[])", [[key]]); // the lock mcpbg_charge queues on
    try {
      const d = await gov.check(ctx); // waits past the default 2 s: Postgres cancels it
      assert.deepEqual([d.admitted, d.status, d.reason, d.degraded, d.limit], [false, 503, "budget_unavailable:postgres busy", false, null]);
    } finally {
      await admin.query("ROLLBACK");
    }
    assert.equal((await gov.check(ctx)).admitted, true);
    assert.equal(await gov.usage("open", ctx), 2, "the busy check charged nothing, locally or in Postgres");
  });

  it("refuses as busy, not by the fail mode, when no pooled connection frees in time", async () => {
    // One connection and a short queue bound, so that holding the one connection fills the pool.
    const small = PostgresBackend.fromUrl(url, { maxConnections: 1, queueTimeout: 0.2 });
    const gov = new Governor(Policy.of(day("open", 5, FailMode.OPEN)), small);
    const ctx = context({ user: fresh("full") });
    try {
      assert.equal((await gov.check(ctx)).admitted, true);
      const held = await small.pool.connect();
      let d;
      try {
        d = await gov.check(ctx);
      } finally {
        held.release();
      }
      assert.deepEqual([d.admitted, d.status, d.reason, d.degraded], [false, 503, "budget_unavailable:postgres busy", false]);
      assert.equal((await gov.check(ctx)).admitted, true);
      assert.equal(await gov.usage("open", ctx), 2);
    } finally {
      await small.close();
    }
  });

  it("refuses as busy, unsent, a check that waits past queueTimeout behind the calls in flight", async () => {
    // One call in flight at most and a short queue bound: the second check waits in the coalescer.
    const small = PostgresBackend.fromUrl(url, { maxConnections: 1, queueTimeout: 0.2 });
    const gov = new Governor(Policy.of(day("open", 5, FailMode.OPEN)), small);
    const ctx = context({ user: fresh("queued") });
    try {
      assert.equal((await gov.check(ctx)).admitted, true);
      const key = checkPlan(gov.policy, ctx, Date.now() / 1000).slots[0]?.key ?? "";
      await admin.query("BEGIN");
      await admin.query("SELECT mcpbg_lock($1::text[])", [[key]]);
      let first;
      let second;
      try {
        const inFlight = gov.check(ctx); // sent, queued on the lock
        second = await gov.check(ctx); // waits for the one call: refused after 0.2 s
        await admin.query("ROLLBACK");
        first = await inFlight;
      } finally {
        await admin.query("ROLLBACK").catch(() => undefined);
      }
      assert.deepEqual([second.status, second.reason, second.degraded], [503, "budget_unavailable:postgres busy", false]);
      assert.deepEqual([first.admitted, first.degraded], [true, false], "the lock freed in time: Postgres decided it");
      assert.equal(await gov.usage("open", ctx), 2, "the refused check was never sent");
    } finally {
      await small.close();
    }
  });

  it("applies each limit's fail mode when the server refuses the connection", async () => {
    const down = PostgresBackend.fromUrl(`postgresql://postgres@127.0.0.1:${await freePort()}/nowhere`);
    try {
      const ctx = context({ user: fresh("down") });
      const open = new Governor(Policy.of(day("open", 2, FailMode.OPEN)), down);
      const ds = [await open.check(ctx), await open.check(ctx), await open.check(ctx)];
      assert.deepEqual(
        ds.map((d) => [d.status, d.degraded]),
        [
          [200, true],
          [200, true],
          [429, true],
        ],
        "the per-process fallback counts against the cap",
      );
      const closed = new Governor(Policy.of(day("closed", 2, FailMode.CLOSED)), down);
      const d = await closed.check(ctx);
      assert.deepEqual([d.status, d.reason, d.degraded], [503, "budget_unavailable:user/day", true]);
      await assert.rejects(down.usage(["k"]), (err: unknown) => err instanceof BackendUnavailableError && /unreachable/.test(err.message));
    } finally {
      await down.close();
    }
  });

  it("picks up new connections after the server ended its sessions", async () => {
    const mine = PostgresBackend.fromUrl(url, { pool: { application_name: "mcpbg_ts_restart" } }); // to find its sessions
    const gov = new Governor(Policy.of(day("burst", 10)), mine);
    const ctx = context({ user: fresh("restart") });
    try {
      await Promise.all(Array.from({ length: 4 }, () => gov.check(ctx)));
      await admin.query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'mcpbg_ts_restart'");
      await new Promise((r) => setTimeout(r, 100)); // the pool hears of it and drops them
      const ds = [];
      for (let i = 0; i < 4; i++) ds.push(await gov.check(ctx));
      assert.deepEqual(
        ds.map((d) => [d.status, d.degraded]),
        Array.from({ length: 4 }, () => [200, false]),
      );
      assert.equal(await gov.usage("burst", ctx), 8);
    } finally {
      await mine.close();
    }
  });

  it("reads a connection that dies under a check as unreachable, and carries on", async () => {
    const mine = PostgresBackend.fromUrl(url, { pool: { application_name: "mcpbg_ts_dies" } }); // to find its sessions
    const gov = new Governor(Policy.of(day("open", 5, FailMode.OPEN)), mine);
    const ctx = context({ user: fresh("dies") });
    try {
      assert.equal((await gov.check(ctx)).admitted, true);
      const key = checkPlan(gov.policy, ctx, Date.now() / 1000).slots[0]?.key ?? "";
      await admin.query("BEGIN");
      await admin.query("SELECT mcpbg_lock($1::text[])", [[key]]);
      let d;
      try {
        const pending = gov.check(ctx); // queued on the lock
        await new Promise((r) => setTimeout(r, 200));
        await admin.query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'mcpbg_ts_dies'");
        d = await pending;
      } finally {
        await admin.query("ROLLBACK");
      }
      assert.deepEqual([d.admitted, d.degraded], [true, true], "the fail mode (OPEN) decided it");
      await new Promise((r) => setTimeout(r, 1100)); // the governor retries the store after 1 s
      const next = await gov.check(ctx);
      assert.deepEqual([next.admitted, next.degraded], [true, false]);
      assert.equal(await gov.usage("open", ctx), 3, "the degraded check's charge was replayed once");
    } finally {
      await mine.close();
    }
  });

  it("replays each charge kept during an outage once, whatever the number of concurrent checks", async () => {
    let now = Date.now() / 1000;
    const flaky = new Flaky(backend);
    const gov = new Governor(Policy.of(day("calls", 1000)), flaky, { clock: () => now }); // a clock to step past the retry interval
    const ctx = context({ user: fresh("recover") });
    flaky.down = true;
    for (let i = 0; i < 3; i++) assert.equal((await gov.check(ctx)).degraded, true); // kept for later
    flaky.down = false;
    now += 2; // past the default retry interval (1 s)
    const ds = await Promise.all(Array.from({ length: 64 }, () => gov.check(ctx)));
    assert.ok(ds.every((d) => d.admitted && !d.degraded));
    assert.equal(flaky.replays, 3, "one task replays the kept charges, each once");
    assert.equal(await gov.usage("calls", ctx), 3 + 64);
  });

  it("tells busy from unreachable by the error's class", () => {
    const err = (message: string, code?: string): Error => Object.assign(new Error(message), code === undefined ? {} : { code });
    assert.equal(classify(err("canceling statement due to statement timeout", "57014"), true), "busy");
    assert.equal(classify(err("sorry, too many clients already", "53300"), true), "busy");
    assert.equal(classify(err("could not resize shared memory segment", "53100"), true), "busy");
    assert.equal(classify(err("timeout exceeded when trying to connect"), true), "busy");
    assert.equal(classify(err("timeout exceeded when trying to connect"), false), "down", "a full pool of a server last seen down");
    assert.equal(classify(err("connect ECONNREFUSED 127.0.0.1:1", "ECONNREFUSED"), true), "down");
    assert.equal(classify(err("terminating connection due to administrator command", "57P01"), true), "down");
    assert.equal(classify(err("Connection terminated unexpectedly"), true), "down");
    assert.equal(classify(err("Query read timeout"), true), "down");
    assert.equal(classify(err('relation "x" does not exist', "42P01"), true), null);
  });

  it("names the field of a bad setting", () => {
    const bad: [string, () => unknown][] = [
      ["url", () => PostgresBackend.fromUrl("redis://127.0.0.1:6379/0")],
      ["timeout", () => PostgresBackend.fromUrl(url, { timeout: 0 })],
      ["maxConnections", () => PostgresBackend.fromUrl(url, { maxConnections: 1.5 })],
      ["queueTimeout", () => PostgresBackend.fromUrl(url, { queueTimeout: -1 })],
    ];
    for (const [field, make] of bad) {
      assert.throws(make, (err: unknown) => err instanceof InvalidInputError && err.field === field, field);
    }
    assert.throws(
      () => PostgresBackend.fromUrl("mysql://u:s3cret@h/db"),
      (err: unknown) => err instanceof InvalidInputError && err.message.includes("***@h/db") && !err.message.includes("s3cret"),
      "the password is not shown",
    );
  });
});

/** A backend whose charges fail as unreachable while `down`, then pass through; it
 * counts the replays of kept charges (the only charges that want no totals back). */
class Flaky implements Backend {
  down = false;
  replays = 0;
  constructor(private readonly inner: Backend) {}
  charge(ops: readonly CounterOp[], options?: ChargeOptions): Promise<ChargeResult> {
    if (this.down) return Promise.reject(new BackendUnavailableError("postgres unreachable: test"));
    if (options?.wantUsed === false) this.replays++;
    return this.inner.charge(ops, options);
  }
  usage(keys: readonly string[]): Promise<number[]> {
    return this.inner.usage(keys);
  }
  release(keys: readonly string[], lease: string): Promise<number> {
    return this.inner.release(keys, lease);
  }
  renew(keys: readonly string[], lease: string, ttl: number): Promise<number> {
    return this.inner.renew(keys, lease, ttl);
  }
  leave(keys: readonly string[], ticket: string): Promise<number> {
    return this.inner.leave(keys, ticket);
  }
  inProgress(keys: readonly string[]): Promise<number[]> {
    return this.inner.inProgress(keys);
  }
  close(): Promise<void> {
    return Promise.resolve();
  }
}
