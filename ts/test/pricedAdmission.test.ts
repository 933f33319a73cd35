// A fixed price charged by the admission (Python: tests/test_priced_burst.py and
// the fixed-price cases of test_emit.py): a governed tool whose price is known
// before it runs is admitted and charged in one charge.lua call, nothing is
// charged after it, a failed call has paid once, and the ledger keeps its two
// events (one admission, one metered cost, ids of their own).
import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { EntryType, Governor, Limit, MemoryLedger, Policy, RedisBackend, Scope, Unit, Window, context, usd, type Backend } from "../src/index.js";
import { governedCall } from "../src/integrations/common.js";
import { backends, backendsWithPostgres } from "./backends.js";
import { fresh } from "./services.js";

const PRICE = usd("0.01");

function policy(): Policy {
  return Policy.of(
    new Limit("calls", { cap: 1000, window: Window.DAY, scope: Scope.USER }),
    // Gated: the check consults it, so a price that does not fit refuses the call.
    new Limit("spend", { cap: usd("0.05"), window: Window.DAY, scope: Scope.USER, unit: Unit.USD_MICROS }),
    // Metered only: charged as a meter charges, past its cap too.
    new Limit("team", { cap: usd("0.02"), window: Window.DAY, scope: Scope.USER, unit: Unit.USD_MICROS, gated: false }),
  );
}

/** `backend` counting its charges. */
function counted(b: Backend): { backend: Backend; charges: () => number } {
  let n = 0;
  const real = b.charge.bind(b);
  b.charge = (...args: Parameters<Backend["charge"]>) => {
    n += 1;
    return real(...args);
  };
  return { backend: b, charges: () => n };
}

for (const [name, open] of await backendsWithPostgres()) {
  describe(`a fixed price charged at admission on ${name}`, () => {
    it("admits and charges in one round trip, ledger events unchanged, failures paid once, refused when it does not fit", async () => {
      const { backend, charges } = counted(open());
      assert.equal(backend.pricesAtAdmission, true);
      const ledger = new MemoryLedger();
      const gov = new Governor(policy(), backend, { ledger });
      const ctx = context({ user: fresh("ana") });
      const price = { spend: PRICE, team: PRICE };
      const ok = async (): Promise<string> => "ok";
      const fail = async (): Promise<string> => {
        throw new Error("tool failed");
      };
      assert.equal(await governedCall(gov, ctx, ok, price, null), "ok");
      assert.equal(charges(), 1, "one charge.lua call: the admission charged the price");
      await assert.rejects(governedCall(gov, ctx, fail, price, null), /tool failed/);
      assert.equal(charges(), 2, "a failed call paid with its admission: nothing more");
      // Cancelled during its admission: the work never starts, the price is paid once.
      const cancel = new AbortController();
      let started = false;
      const send = backend.charge;
      backend.charge = (...args: Parameters<Backend["charge"]>) => {
        cancel.abort(new Error("cancelled")); // while the admission's charge is on its way
        return send(...args);
      };
      await assert.rejects(governedCall(gov, ctx, async () => (started = true), price, null, 0, null, cancel.signal), /cancelled/);
      backend.charge = send;
      assert.equal(started, false);
      assert.equal(charges(), 3, "a cancelled call paid with its admission: nothing more");
      for (let i = 0; i < 2; i++) await governedCall(gov, ctx, ok, price, null);
      // $0.05 of room on the gated limit: the sixth price does not fit, the call is refused.
      let ran = false;
      await assert.rejects(
        governedCall(gov, ctx, async () => (ran = true), price, null),
        (err: Error) => err.name === "LimitExceeded" || /spend/.test(err.message),
      );
      assert.equal(ran, false);
      assert.equal(await gov.usage("spend", ctx), 5 * PRICE);
      assert.equal(await gov.usage("team", ctx), 5 * PRICE, "metered-only: charged past its cap");
      assert.equal(await gov.usage("calls", ctx), 5);

      // The ledger: per admitted call one admission (the check's charges) and one
      // metered cost event (the price), distinct ids; one rejection.
      const types = ledger.entries.map((e) => e.type);
      assert.deepEqual(types, [...Array(5).fill([EntryType.ADMITTED, EntryType.METERED]).flat(), EntryType.REJECTED]);
      const [admitted, cost] = ledger.entries;
      assert.deepEqual((admitted?.charges ?? []).map((c) => [c.limit, c.amount]), [["calls", 1]]);
      assert.deepEqual((cost?.charges ?? []).map((c) => [c.limit, c.amount]), [["spend", PRICE], ["team", PRICE]]);
      assert.notEqual(admitted?.id, cost?.id);
      assert.equal(cost?.time, admitted?.time);

      if (backend instanceof RedisBackend) {
        // The price's in-flight amounts are the cost event's, the count the admission's:
        // the projection moves each exactly once.
        const spendKey = (cost?.charges ?? [])[0]?.key ?? "";
        const callsKey = (admitted?.charges ?? [])[0]?.key ?? "";
        assert.equal(await backend.client.hget(spendKey, `e:${cost?.id}`), String(PRICE));
        assert.equal(await backend.client.hget(spendKey, `e:${admitted?.id}`), null);
        assert.equal(await backend.client.hget(callsKey, `e:${admitted?.id}`), "1");
      }
    });

    it("without a ledger, charges inline in the one call", async () => {
      const { backend, charges } = counted(open());
      const gov = new Governor(policy(), backend);
      const ctx = context({ user: fresh("bo") });
      for (let i = 0; i < 3; i++) await governedCall(gov, ctx, async () => "ok", { spend: PRICE }, null);
      assert.equal(charges(), 3);
      assert.equal(await gov.usage("spend", ctx), 3 * PRICE);
      // A hard cap: its estimate is reserved by the admission, then settled to the price.
      await governedCall(gov, ctx, async () => "ok", { spend: PRICE }, { spend: 2 * PRICE });
      assert.equal(charges(), 5, "admit and reserve, settle");
      assert.equal(await gov.usage("spend", ctx), 4 * PRICE);
    });
  });
}

for (const [name, open] of backends()) {
  describe(`meterBehind on ${name}`, () => {
    it("writes the charge before it returns, the reply off the caller's path, the ledger event as meterCharges'", async () => {
      const ledger = new MemoryLedger();
      const backend = open();
      const gov = new Governor(policy(), backend, { ledger });
      const ctx = context({ user: fresh("cy") });
      let replied = false;
      if (backend instanceof RedisBackend) {
        await backend.client.ping(); // connected: the charge can be written at once
        const send = backend.chargeSent.bind(backend);
        backend.chargeSent = (...args: Parameters<RedisBackend["chargeSent"]>) => {
          const sent = send(...args);
          assert.notEqual(sent, null, "a connected Redis writes at once");
          void sent?.then(() => (replied = true));
          return sent;
        };
      }
      await gov.meterBehind({ spend: PRICE, team: 2 * PRICE }, ctx);
      if (backend instanceof RedisBackend) assert.equal(replied, false, "returned before the reply");
      // Written on the same connection first: the next read of this process sees it.
      assert.equal(await gov.usage("spend", ctx), PRICE);
      assert.equal(await gov.usage("team", ctx), 2 * PRICE);
      const [metered] = ledger.entries;
      assert.equal(metered?.type, EntryType.METERED);
      assert.deepEqual((metered?.charges ?? []).map((c) => [c.limit, c.amount]), [["spend", PRICE], ["team", 2 * PRICE]]);
      // Hard cap on one limit, a fixed price on another: the settle and the price left
      // are both written without awaiting their replies (on Redis).
      let sentBehind = 0;
      if (backend instanceof RedisBackend) {
        const send = backend.chargeSent.bind(backend);
        backend.chargeSent = (...args: Parameters<RedisBackend["chargeSent"]>) => {
          sentBehind += 1;
          return send(...args);
        };
      }
      await governedCall(gov, ctx, async () => "ok", { spend: PRICE, team: PRICE }, { spend: 2 * PRICE });
      if (backend instanceof RedisBackend) assert.equal(sentBehind, 2);
      assert.equal(await gov.usage("team", ctx), 3 * PRICE);
      assert.equal(await gov.usage("spend", ctx), 2 * PRICE);
    });
  });
}
