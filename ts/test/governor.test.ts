// The Governor on both backends: caps, atomic admission, meters, reservations,
// leases, fail modes, the ledger entries, policy files and prices.
import assert from "node:assert/strict";
import { describe, it } from "node:test";

import {
  BackendUnavailableError,
  BudgetExceeded,
  EntryType,
  FailMode,
  Governor,
  InvalidInputError,
  Limit,
  LimitExceeded,
  MemoryLedger,
  Policy,
  PriceTable,
  RedisBackend,
  Scope,
  Unit,
  UnknownModelError,
  Window,
  context,
  loadPolicyFile,
  usd,
} from "../src/index.js";
import { backends, closer } from "./backends.js";
import { fresh, frozenClock } from "./services.js";

const close = closer();

for (const [name, backend] of backends(close)) {
  describe(`Governor on ${name}`, () => {
    it("admits exactly the cap under concurrent checks, and refuses with 429 and a retry hint", async () => {
      const gov = new Governor(Policy.of(new Limit("burst", { cap: 7, window: Window.MINUTE, scope: Scope.USER })), backend(), { clock: frozenClock() });
      const ctx = context({ user: fresh("u") });
      const decisions = await Promise.all(Array.from({ length: 25 }, () => gov.check(ctx)));
      assert.equal(decisions.filter((d) => d.admitted).length, 7);
      const refused = decisions.find((d) => !d.admitted);
      assert.ok(refused);
      assert.equal(refused.status, 429);
      assert.equal(refused.limit, "burst");
      assert.equal(refused.reason, "budget_exceeded:user/minute");
      assert.ok((refused.retryAfter ?? 0) >= 1);
      assert.throws(() => refused.raiseForStatus(), LimitExceeded);
      // A quota refusal is not the breaker's: `instanceof BudgetExceeded` is false for it.
      assert.throws(() => refused.raiseForStatus(), (e: Error) => !(e instanceof BudgetExceeded));
      assert.ok(BudgetExceeded.prototype instanceof LimitExceeded);
      assert.equal(await gov.usage("burst", ctx), 7);
    });

    it("charges all or nothing: a refusal by one limit charges none of the others", async () => {
      const gov = new Governor(
        Policy.of(
          new Limit("per_user", { cap: 100, window: Window.DAY, scope: Scope.USER }),
          new Limit("tenant", { cap: 2, window: Window.DAY, scope: Scope.TENANT }),
        ),
        backend(),
      );
      const [tenant, user] = [fresh("acme"), fresh("u")];
      for (let i = 0; i < 3; i++) await gov.check(context({ user, tenant }));
      assert.equal(await gov.usage("per_user", context({ user, tenant })), 2);
    });

    it("meters spend; a spent budget refuses the next check with 402 and no retry hint", async () => {
      const gov = new Governor(
        Policy.of(new Limit("spend", { cap: usd("0.10"), window: Window.DAY, scope: Scope.USER, unit: Unit.USD_MICROS })),
        backend(),
        { prices: PriceTable.builtin() },
      );
      const ctx = context({ user: fresh("u") });
      assert.ok((await gov.check(ctx)).admitted);
      const m = await gov.meter("spend", usd("0.06"), ctx);
      assert.deepEqual([m.total, m.within, m.crossed], [60_000, true, false]);
      const t = await gov.meterTokens("spend", "gpt-4o", { inputTokens: 10_000, outputTokens: 500, cacheReadTokens: 8_000 }, ctx);
      assert.deepEqual([t.charged, t.total, t.within, t.crossed], [20_000, 80_000, true, false]);
      await gov.meter("spend", usd("0.05"), ctx);
      const d = await gov.check(ctx);
      assert.deepEqual([d.admitted, d.status, d.retryAfter], [false, 402, null]);
    });

    it("meterTokens looks for the price table and the model before refusing a CALLS limit", async () => {
      const limits = Policy.of(
        new Limit("calls", { cap: 9, window: Window.DAY }),
        new Limit("tokens", { cap: 99, window: Window.DAY, unit: Unit.TOKENS, gated: false }),
      );
      const t = { inputTokens: 1, outputTokens: 1 };
      const bare = new Governor(limits, backend());
      await assert.rejects(bare.meterTokens("calls", "m", t), /needs a price table/);
      assert.equal((await bare.meterTokens("tokens", "m", t)).charged, 2);
      const priced = new Governor(limits, backend(), { prices: new PriceTable().withPrice("m", 1, 2) });
      await assert.rejects(priced.meterTokens("calls", "typo", t), UnknownModelError);
      await assert.rejects(priced.meterTokens("calls", "m", t), InvalidInputError);
    });

    it("reserves an estimate and settles it to the real cost", async () => {
      const gov = new Governor(
        Policy.of(new Limit("spend", { cap: 100, window: Window.DAY, scope: Scope.USER, unit: Unit.USD_MICROS })),
        backend(),
      );
      const ctx = context({ user: fresh("u") });
      const r = await gov.reserve("spend", 80, ctx);
      assert.equal(await gov.usage("spend", ctx), 80);
      await assert.rejects(gov.reserve("spend", 30, ctx), LimitExceeded);
      const settled = await gov.settle(r, 25);
      assert.equal(settled.total, 25);
      await gov.reserved("spend", 50, ctx, async (held) => {
        held.actual = 10;
      });
      assert.equal(await gov.usage("spend", ctx), 35);
    });

    it("holds concurrency-cap leases while calls run and gives them back", async () => {
      const gov = new Governor(Policy.of(new Limit("parallel", { cap: 2, unit: Unit.CONCURRENT, scope: Scope.USER })), backend());
      const ctx = context({ user: fresh("u") });
      const a = await gov.check(ctx);
      const b = await gov.check(ctx);
      const c = await gov.check(ctx);
      assert.deepEqual([a.admitted, b.admitted, c.admitted], [true, true, false]);
      assert.equal(c.retryAfter, 1);
      assert.equal(await gov.usage("parallel", ctx), 2);
      await gov.release(a);
      assert.ok((await gov.check(ctx)).admitted);
      assert.equal(await gov.admitted(context({ user: fresh("u") }), async (d) => d.lease?.keys.length), 1);
    });

    it("appends the ledger entries Python's governor appends, in-flight under their ids", async () => {
      const ledger = new MemoryLedger();
      const gov = new Governor(
        Policy.of(
          new Limit("burst", { cap: 1, window: Window.MINUTE, scope: Scope.USER }),
          new Limit("spend", { cap: usd(1), window: Window.DAY, scope: Scope.USER, unit: Unit.USD_MICROS, gated: false }),
        ),
        backend(),
        { ledger, clock: frozenClock() }, // one minute's "burst": the second check is refused
      );
      const ctx = context({ user: fresh("u"), tool: "search" });
      await gov.check(ctx);
      await gov.check(ctx);
      await gov.meter("spend", 5, ctx);
      assert.deepEqual(
        ledger.entries.map((e) => [e.type, e.status, (e.charges ?? []).map((c) => [c.limit, c.amount])]),
        [
          [EntryType.ADMITTED, 200, [["burst", 1]]],
          [EntryType.REJECTED, 429, []],
          [EntryType.METERED, 200, [["spend", 5]]],
        ],
      );
      assert.equal(await gov.usage("burst", ctx), 1);
      assert.match(ledger.entries[0]?.id ?? "", /^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/);
    });

    it("closes every reservation with one event naming it, the estimate left to stand too", async () => {
      const ledger = new MemoryLedger();
      const gov = new Governor(
        Policy.of(new Limit("spend", { cap: usd(1), window: Window.DAY, scope: Scope.USER, unit: Unit.USD_MICROS })),
        backend(),
        { ledger },
      );
      const ctx = context({ user: fresh("u") });
      await gov.reserved("spend", 50, ctx, async () => {}); // actual never set: the estimate stands
      await gov.reserved("spend", 30, ctx, async (held) => {
        held.actual = 30;
      });
      await gov.reserved("spend", 40, ctx, async (held) => {
        held.actual = 10;
      });
      await gov.reserved("spend", 20, ctx, async (held) => {
        held.release();
      });
      const reserved = ledger.entries.filter((e) => e.type === EntryType.RESERVED).map((e) => e.id);
      const closes = reserved.map((id) =>
        ledger.entries.filter((e) => e.reservation === id).map((e) => [e.type, (e.charges ?? []).map((c) => c.amount)]),
      );
      assert.deepEqual(closes, [
        [[EntryType.SETTLED, []]], // a zero delta: no charges, only the link
        [[EntryType.SETTLED, []]],
        [[EntryType.SETTLED, [-30]]],
        [[EntryType.RELEASED, [-20]]],
      ]);
      assert.equal(await gov.usage("spend", ctx), 90);
    });
  });
}

describe("fail modes with the counters unreachable", () => {
  const dead = (): RedisBackend => {
    return close(RedisBackend.fromUrl("redis://127.0.0.1:1/0", { timeout: 0.2 }));
  };

  it("a fail-closed limit refuses with 503 and a retry hint", async () => {
    const gov = new Governor(
      Policy.of(new Limit("burst", { cap: 5, window: Window.MINUTE, scope: Scope.USER, failMode: FailMode.CLOSED })),
      dead(),
    );
    const d = await gov.check(context({ user: "u" }));
    assert.deepEqual([d.admitted, d.status, d.reason, d.degraded], [false, 503, "budget_unavailable:user/minute", true]);
    assert.equal(d.retryAfter, 1);
  });

  it("a fail-open limit counts in a process-local fallback (a cap per replica, never unlimited)", async () => {
    const gov = new Governor(Policy.of(new Limit("burst", { cap: 3, window: Window.MINUTE, scope: Scope.USER })), dead(), { clock: frozenClock() });
    const ctx = context({ user: "u" });
    const statuses = [];
    for (let i = 0; i < 5; i++) statuses.push((await gov.check(ctx)).status);
    assert.deepEqual(statuses, [200, 200, 200, 429, 429]);
    await assert.rejects(gov.usage("burst", ctx), BackendUnavailableError);
  });
});

describe("policy files", () => {
  it("load the repository's example policy", () => {
    const policy = loadPolicyFile(new URL("../../examples/policy.toml", import.meta.url).pathname);
    assert.equal(policy.timezone, "Europe/Paris");
    assert.equal(policy.get("global_spend").cap, usd(25));
    assert.equal(policy.get("global_spend").refusalStatus, 503);
  });

  it("name the file, line, key and value of a mistake", () => {
    assert.throws(
      () => loadPolicyFile(new URL("../../examples/nope.toml", import.meta.url).pathname),
      /policy: no such file/,
    );
  });
});
