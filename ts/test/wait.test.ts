// Waiting for a concurrency slot (check/admitted with `wait`), on both backends:
// waiters are admitted first come, first served, a call arriving later is refused
// while they wait ahead of it, and a wait that runs out is the usual 429 with a
// retry hint, its ticket gone from the queue and one refusal in the ledger.
import assert from "node:assert/strict";
import { describe, it } from "node:test";

import {
  EntryType,
  Governor,
  InvalidInputError,
  Limit,
  MemoryBackend,
  MemoryLedger,
  Policy,
  RedisBackend,
  Scope,
  Unit,
  Window,
  context,
  type Decision,
} from "../src/index.js";
import { queueKey } from "../src/keys.js";
import { backends } from "./backends.js";
import { fresh, frozenClock } from "./services.js";


function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/** A promise that fails the test after `ms` instead of hanging it. */
function within<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: not within ${ms} ms`)), ms);
  });
  return Promise.race([p, late]).finally(() => clearTimeout(timer));
}

function parallel(cap: number): Policy {
  return Policy.of(new Limit("parallel", { cap, unit: Unit.CONCURRENT, scope: Scope.USER }));
}

for (const [name, backend] of backends()) {
  describe(`waiting for a concurrency slot on ${name}`, () => {
    it("admits N waiters for a cap of k slots in their order of arrival", async () => {
      const k = 2;
      const n = 6;
      const gov = new Governor(parallel(k), backend());
      const ctx = context({ user: fresh("u") });
      const held: Decision[] = [];
      for (let i = 0; i < k; i++) held.push((await gov.check(ctx)).raiseForStatus());
      // Each waiter arrives (is refused once, and queued) before the next one starts.
      const done: number[] = [];
      const waiters: Promise<Decision>[] = [];
      for (let i = 0; i < n; i++) {
        waiters.push(
          gov.check(ctx, { wait: 20 }).then((d) => {
            done.push(i);
            return d;
          }),
        );
        await sleep(30);
      }
      assert.deepEqual(done, [], "nobody is admitted while the slots are held");
      // Free one slot at a time: each time, the oldest waiter, and nobody else, gets it.
      for (let i = 0; i < n; i++) {
        const oldest = held.shift();
        assert.ok(oldest !== undefined);
        await gov.release(oldest);
        const admitted = await within(waiters[i] ?? Promise.reject(new Error("no waiter")), 5000, `waiter ${i}`);
        assert.equal(admitted.status, 200);
        assert.ok(admitted.lease !== null);
        assert.deepEqual(done, Array.from({ length: i + 1 }, (_, j) => j), "admitted in arrival order");
        assert.equal(await gov.usage("parallel", ctx), k);
        held.push(admitted);
      }
      for (const d of held) await gov.release(d);
      assert.equal(await gov.usage("parallel", ctx), 0);
    });

    it("refuses a call that does not wait while waiters are ahead of it, even with a slot free", async () => {
      const gov = new Governor(parallel(1), backend());
      const ctx = context({ user: fresh("u") });
      const holder = (await gov.check(ctx)).raiseForStatus();
      const waiter = gov.check(ctx, { wait: 10 });
      await sleep(50);
      await gov.release(holder);
      // The slot belongs to the waiter: whether or not it has polled yet, this call is refused.
      const late = await gov.check(ctx);
      assert.equal(late.status, 429);
      const d = await within(waiter, 5000, "the waiter");
      assert.equal(d.status, 200);
      await gov.release(d);
    });

    it("refuses with 429 and a retry hint when the wait runs out, leaving the queue", async () => {
      const ledger = new MemoryLedger();
      const b = backend();
      const gov = new Governor(parallel(1), b, { ledger });
      const ctx = context({ user: fresh("u") });
      const holder = (await gov.check(ctx)).raiseForStatus();
      const started = performance.now();
      const d = await gov.check(ctx, { wait: 0.3 });
      const waited = performance.now() - started;
      assert.equal(d.status, 429);
      assert.equal(d.admitted, false);
      assert.equal(d.limit, "parallel");
      assert.equal(d.retryAfter, 1);
      assert.deepEqual(d.headers, { "Retry-After": "1" });
      assert.match(d.reason, /concurrent/);
      assert.ok(waited >= 290, `gave up after ${waited.toFixed(0)} ms, before its wait of 300 ms`);
      // One admission (the holder) and one refusal: the retries while waiting are not events.
      assert.deepEqual(
        ledger.entries.map((e) => [e.type, e.status]),
        [
          [EntryType.ADMITTED, 200],
          [EntryType.REJECTED, 429],
        ],
      );
      if (b instanceof RedisBackend) {
        const lease = holder.lease?.keys[0] ?? "";
        assert.equal(await b.client.zcard(queueKey(lease)), 0, "the ticket left the queue");
      }
      // admitted() hands the refusal to the block (Python's contract); raiseForStatus throws it.
      assert.equal(await gov.admitted(ctx, async (x) => `${x.admitted} ${x.status}`, { wait: 0.05 }), "false 429");
      await assert.rejects(
        gov.admitted(ctx, async (x) => x.raiseForStatus().status, { wait: 0.05 }),
        (err: Error) => err.name === "LimitExceeded",
      );
      await gov.release(holder);
      assert.equal(await gov.admitted(ctx, async (x) => x.status, { wait: 0.05 }), 200);
      assert.equal(await gov.usage("parallel", ctx), 0);
    });

    it("a waiter whose signal aborts stops waiting and gives its place to the next", async () => {
      const gov = new Governor(parallel(1), backend());
      const ctx = context({ user: fresh("u") });
      const holder = (await gov.check(ctx)).raiseForStatus();
      const cancel = new AbortController();
      const first = gov.check(ctx, { wait: 60, signal: cancel.signal });
      await sleep(50);
      const second = gov.check(ctx, { wait: 60 });
      await sleep(50);
      cancel.abort();
      await assert.rejects(within(first, 2000, "the cancelled waiter"), (err: Error) => err.name === "AbortError");
      await gov.release(holder);
      // Without giving its place back, the first waiter's ticket would hold the slot for 60 s.
      const d = await within(second, 3000, "the next waiter");
      assert.equal(d.status, 200);
      await gov.release(d);
    });

    it("does not wait for a limit that is not a concurrency cap", async () => {
      const gov = new Governor(
        Policy.of(
          new Limit("parallel", { cap: 5, unit: Unit.CONCURRENT, scope: Scope.USER }),
          new Limit("burst", { cap: 1, window: Window.MINUTE, scope: Scope.USER }),
        ),
        backend(),
        { clock: frozenClock() }, // one minute's "burst": the second check is refused by it
      );
      const ctx = context({ user: fresh("u") });
      const first = (await gov.check(ctx)).raiseForStatus();
      const started = performance.now();
      const d = await gov.check(ctx, { wait: 5 });
      assert.equal(d.limit, "burst");
      assert.ok(performance.now() - started < 1000, "a window cap frees no slot by waiting");
      await gov.release(first);
    });
  });
}

describe("wait", () => {
  it("names a bad wait", async () => {
    const gov = new Governor(parallel(1), new MemoryBackend());
    for (const bad of [-1, 3601, Number.NaN, "1" as unknown as number]) {
      await assert.rejects(gov.check(context({ user: "u" }), { wait: bad }), (err: Error) => {
        assert.ok(err instanceof InvalidInputError);
        assert.equal(err.field, "wait");
        return true;
      });
    }
  });
});
