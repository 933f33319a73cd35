// Hard caps on several limits (Python: tests/test_hard_caps.py): a call's estimates
// are reserved all or nothing in one charge, as one `reserved` event, and settled in
// one charge, as one closing event naming it; two calls near two caps never each hold
// part and refuse the other.
import assert from "node:assert/strict";
import { describe, it } from "node:test";

import {
  EntryType,
  Governor,
  Limit,
  MemoryLedger,
  Policy,
  Scope,
  Unit,
  Window,
  context,
  usd,
  type Backend,
} from "../src/index.js";
import { governedCall } from "../src/integrations/common.js";
import { governHandler } from "../src/integrations/sdk.js";
import { backendsWithPostgres } from "./backends.js";
import { fresh } from "./services.js";


function twoLimits(): Policy {
  return Policy.of(
    new Limit("user_spend", { cap: usd("0.10"), window: Window.DAY, scope: Scope.USER, unit: Unit.USD_MICROS }),
    new Limit("tenant_spend", { cap: usd("0.10"), window: Window.DAY, scope: Scope.TENANT, unit: Unit.USD_MICROS }),
  );
}

type Result = { isError?: boolean; content: { text: string }[] };

for (const [name, backend] of await backendsWithPostgres()) {
  describe(`hard caps on ${name}`, () => {
    it("holds estimates on several limits all or nothing in one round trip", async () => {
      const ledger = new MemoryLedger();
      const b = backend();
      let charges = 0;
      const real = b.charge.bind(b);
      b.charge = (...args: Parameters<Backend["charge"]>) => {
        charges += 1;
        return real(...args);
      };
      const gov = new Governor(twoLimits(), b, { ledger });
      const ctx = context({ user: fresh("ana"), tenant: fresh("acme") });
      const work = async (): Promise<string> => "ok";
      const both = { user_spend: usd("0.05"), tenant_spend: usd("0.05") };
      await governedCall(gov, ctx, work, { user_spend: usd("0.02") }, both);
      // Check and reserve both (one charge where the backend reserves with the admission,
      // else two), settle both: whatever the number of limits.
      assert.equal(charges, gov.pricesAtAdmission ? 2 : 3);
      const [reserved, closed] = ledger.entries.filter((e) => e.type === EntryType.RESERVED || e.type === EntryType.SETTLED);
      assert.equal(reserved?.type, EntryType.RESERVED);
      assert.deepEqual(
        (reserved?.charges ?? []).map((c) => [c.limit, c.amount]),
        [
          ["user_spend", usd("0.05")],
          ["tenant_spend", usd("0.05")],
        ],
      );
      assert.equal(closed?.type, EntryType.SETTLED);
      assert.equal(closed?.reservation, reserved?.id);
      assert.deepEqual(
        (closed?.charges ?? []).map((c) => [c.limit, c.amount]),
        [["user_spend", -usd("0.03")]],
      );
      assert.equal(await gov.usage("user_spend", ctx), usd("0.02"));
      assert.equal(await gov.usage("tenant_spend", ctx), usd("0.05")); // its estimate stands

      // tenant_spend has 0.05 left: 0.06 does not fit, and user_spend holds nothing.
      ledger.entries.length = 0;
      await assert.rejects(
        governedCall(gov, ctx, work, null, { user_spend: usd("0.06"), tenant_spend: usd("0.06") }),
        /budget_exceeded/,
      );
      assert.equal(await gov.usage("user_spend", ctx), usd("0.02"));
      assert.equal(await gov.usage("tenant_spend", ctx), usd("0.05"));
      // The reservation was refused whole, nothing reserved; where it goes with the
      // admission, the call is refused whole too (else its check had admitted it).
      assert.deepEqual(
        ledger.entries.map((e) => e.type),
        gov.pricesAtAdmission ? [EntryType.REJECTED] : [EntryType.ADMITTED, EntryType.REJECTED],
      );
    });

    it("reserveAll: released returns every estimate in one released event", async () => {
      const ledger = new MemoryLedger();
      const gov = new Governor(twoLimits(), backend(), { ledger });
      const ctx = context({ user: fresh("ana"), tenant: fresh("acme") });
      const held = await gov.reserveAll({ user_spend: 7, tenant_spend: 9 }, ctx);
      assert.equal(await gov.usage("tenant_spend", ctx), 9);
      held.release();
      await held.finish();
      await held.finish(); // once
      assert.deepEqual(
        ledger.entries.map((e) => [e.type, (e.charges ?? []).map((c) => [c.limit, c.amount]), e.reservation]),
        [
          [EntryType.RESERVED, [["user_spend", 7], ["tenant_spend", 9]], null],
          [EntryType.RELEASED, [["user_spend", -7], ["tenant_spend", -9]], held.id],
        ],
      );
      assert.equal(await gov.usage("user_spend", ctx), 0);
      assert.equal(await gov.usage("tenant_spend", ctx), 0);
    });

    it("two calls near two caps: one runs, the other is refused whole (never both refused)", async () => {
      const gov = new Governor(twoLimits(), backend(), { ledger: new MemoryLedger() });
      const ctx = context({ user: fresh("ana"), tenant: fresh("acme") });
      // Each call's estimate fits either cap alone, but two do not: 0.06 + 0.06 > 0.10.
      // The two tools name the limits in opposite orders, so reserving one limit after
      // the other would let each call hold one cap and be refused by the other.
      const ran: string[] = [];
      const tool = (toolName: string, limits: string[]) =>
        governHandler(
          gov,
          toolName,
          async () => {
            ran.push(toolName);
            await new Promise((r) => setTimeout(r, 30)); // both calls in flight at once
            return { content: [{ type: "text", text: "ok" }] };
          },
          { mcpbg: { limit: limits, estimate_usd: "0.06" } },
          { identify: () => ctx },
        ) as unknown as (args: unknown, extra: unknown) => Promise<Result>;
      const ab = tool("ab", ["user_spend", "tenant_spend"]);
      const ba = tool("ba", ["tenant_spend", "user_spend"]);
      const results = await Promise.all([ab({}, {}), ba({}, {})]);
      const ok = results.filter((r) => r.isError !== true);
      const refused = results.filter((r) => r.isError === true);
      assert.equal(ok.length, 1, `exactly one call runs: ${JSON.stringify(results)}`);
      assert.equal(refused.length, 1);
      assert.match(refused[0]?.content[0]?.text ?? "", /^budget_exceeded:/);
      assert.equal(ran.length, 1);
      // The one that ran kept its estimates; the refused one holds nothing anywhere.
      assert.equal(await gov.usage("user_spend", ctx), usd("0.06"));
      assert.equal(await gov.usage("tenant_spend", ctx), usd("0.06"));
    });
  });
}
