// The TypeScript package checks itself against every conformance vector the
// Python implementation generated: keys, buckets, expiries, escapes, money,
// prices, script digests, the exact charge.lua calls (and mcpbg_charge's arguments on
// Postgres), policy files, refusals.
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { copyFileSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { pathToFileURL } from "node:url";
import { describe, it } from "node:test";

import { CHARGE_MANY_SQL, CHARGE_SQL, chargeManyParams, chargeParams, type BatchedCheck } from "../src/backends/postgres.js";
import { chargeCommand, chargeFrame } from "../src/backends/redis.js";
import { splitCost, withCost } from "../src/backends/types.js";
import { Decision, REFUSAL_META_KEY, refusalBody, refusalMeta, refusalText } from "../src/decision.js";
import { GovernorError, InvalidInputError, PolicyFileError, UnknownModelError } from "../src/errors.js";
import { KeyBuilder, SEPARATORS } from "../src/keys.js";
import { usd } from "../src/money.js";
import * as planning from "../src/planning.js";
import { parsePolicy } from "../src/policyFile.js";
import { PriceTable } from "../src/prices.js";
import { LUA_DIR, script, SCRIPTS, sha1 } from "../src/scripts.js";
import { callHash } from "../src/repeats.js";
import { toolPrices } from "../src/integrations/common.js";
import { escapeMismatches, keyMismatches } from "./conformance.js";
import { ctxOf, VECTORS, type Json } from "./vectors.js";

describe("keys, buckets and expiries", () => {
  it("match every key vector (windows, time zones, DST, billing days, hostile ids)", () => {
    assert.ok(VECTORS.keys.length > 500);
    assert.deepEqual(keyMismatches(new KeyBuilder()), []);
  });

  it("escape scope values as Python does", () => {
    assert.deepEqual(escapeMismatches(), []);
  });

  it("fail when one vector is changed by one character", () => {
    const changed = structuredClone(VECTORS);
    changed.keys[0].key = changed.keys[0].key.replace(":", ";");
    changed.keys[1].expire_at += 1;
    assert.equal(keyMismatches(new KeyBuilder(), changed).length, 2);
  });

  for (const [name, patched] of [
    ["segment", { ...SEPARATORS, segment: ";" }],
    ["dimension", { ...SEPARATORS, dimension: ";" }],
    ["pair", { ...SEPARATORS, pair: ":" }],
  ] as const) {
    it(`fail when the ${name} separator of the key builder changes by one character`, () => {
      const mismatches = keyMismatches(new KeyBuilder(patched));
      assert.ok(mismatches.length > 0, "a patched key builder passed the key vectors");
    });
  }
});

describe("money", () => {
  it("converts dollars to micros, rounding up once", () => {
    for (const [text, micros] of Object.entries(VECTORS.usd as Record<string, number>)) assert.equal(usd(text), micros, text);
    for (const [text, micros] of Object.entries(VECTORS.usd_more.good as Record<string, number>)) {
      assert.equal(usd(text), micros, text);
    }
  });

  it("refuses what Python refuses, naming the same field and problem", () => {
    for (const [text, want] of Object.entries(VECTORS.usd_more.bad as Record<string, Json>)) {
      assert.throws(
        () => usd(text),
        (err: unknown) => err instanceof InvalidInputError && err.field === want.field && err.problem === want.problem,
        text,
      );
    }
  });
});

describe("prices", () => {
  it("price the golden custom cases", () => {
    const table = new PriceTable().withPrice("m", 3, 15, "0.3", "3.75");
    for (const c of VECTORS.prices as Json[]) {
      const [inputTokens, outputTokens, cacheReadTokens, cacheWriteTokens] = c.tokens;
      assert.equal(table.costMicros("m", { inputTokens, outputTokens, cacheReadTokens, cacheWriteTokens }), c.micros);
    }
  });

  it("price built-in models as the Python table does", () => {
    const table = PriceTable.builtin();
    assert.equal(table.version, VECTORS.builtin_prices.version);
    assert.equal(table.size, Object.keys(VECTORS.builtin_prices.models).length);
    for (const c of VECTORS.builtin_prices.cases as Json[]) {
      const [inputTokens, outputTokens, cacheReadTokens, cacheWriteTokens] = c.tokens;
      if (c.micros === null) continue;
      assert.equal(table.costMicros(c.model, { inputTokens, outputTokens, cacheReadTokens, cacheWriteTokens }), c.micros, c.model);
    }
  });

  it("raise for an unknown model, never pricing it at zero", () => {
    for (const u of VECTORS.builtin_prices.unknown as Json[]) {
      assert.throws(
        () => PriceTable.builtin().costMicros(u.model, { inputTokens: 1, outputTokens: 1 }),
        (err: unknown) => err instanceof UnknownModelError && err.message === u.message,
      );
    }
  });
});

describe("scripts", () => {
  it("are the repository's lua/ files, with the vectors' digests", () => {
    assert.deepEqual([...SCRIPTS], VECTORS.script_layout.names);
    for (const name of SCRIPTS) {
      const s = script(name);
      assert.equal(s.sha, VECTORS.scripts[name], name);
      // Rebuilt from ../lua and the vectors' layout: the prelude's lib.lua lines, "\n", the body.
      const lib = readFileSync(new URL("../../lua/lib.lua", import.meta.url), "utf8");
      const lines = lib.split("\n").slice(0, -1);
      const spans = VECTORS.script_layout.prelude[name] as [number, number][];
      const body = readFileSync(new URL(`../../lua/${name}.lua`, import.meta.url), "utf8");
      const repo = spans.flatMap(([a, b]) => lines.slice(a - 1, b).map((l) => l + "\n")).join("") + "\n" + body;
      assert.equal(repo, s.source, `${name}: the copy differs from ../lua`);
      assert.equal(createHash("sha1").update(repo).digest("hex"), s.sha, name);
      // The layout matters: the whole lib.lua before the body is another script.
      if (name === "charge") assert.notEqual(sha1(lib + "\n" + body), s.sha);
    }
  });

  it("refuse a layout that is not the one the digests were recorded with", () => {
    const dir = mkdtempSync(join(tmpdir(), "mcpbg-lua-"));
    try {
      for (const file of readdirSync(LUA_DIR)) copyFileSync(new URL(file, LUA_DIR), join(dir, file));
      const layout = JSON.parse(readFileSync(join(dir, "layout.json"), "utf8")) as Json;
      const whole = readFileSync(join(dir, "lib.lua"), "utf8").split("\n").length - 1;
      layout.prelude.charge = [[1, whole]]; // every helper, as before preludes
      writeFileSync(join(dir, "layout.json"), JSON.stringify(layout));
      const at = pathToFileURL(dir + "/");
      assert.throws(() => script("charge", at), (err: unknown) => err instanceof GovernorError && /digest/.test(err.message));
      assert.equal(script("usage", at).sha, VECTORS.scripts.usage);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("call charge.lua (and mcpbg_charge) with exactly the arguments Python's backends send", () => {
    const policies = VECTORS.policies.good;
    const batch: BatchedCheck[] = [];
    for (const [i, c] of (VECTORS.charge as Json[]).entries()) {
      const policy = parsePolicy(policies[c.policy].toml);
      const ctx = ctxOf(c.context);
      let ops: readonly planning.CounterOp[];
      if (c.call === "check") ops = planning.checkPlan(policy, ctx, c.now).ops;
      else {
        const lim = planning.meteredLimit(policy, c.limit);
        ops = planning.meterSlots([[lim, c.amount]], ctx, c.now, policy).map(planning.opOf);
      }
      const options = {
        eventId: c.ledger ? "0190f5a2-7e3b-7c1d-9f00-0000000000bb" : null,
        opId: c.ledger ? null : "0190f5a2-7e3b-7c1d-9f00-0000000000aa",
        wantUsed: true,
        lease: c.lease ? "0190f5a2-7e3b-7c1d-9f00-0000000000cc" : null,
        leaseTtl: 30,
        ticket: c.ticket ?? null,
        requireEpoch: c.require_epoch ?? false,
        nowMs: c.now * 1000,
      };
      const what = `${c.policy} ${c.call} ${JSON.stringify(c.context)}`;
      assert.deepEqual(["EVALSHA", ...chargeCommand(script("charge").sha, ops, options)], c.command, what);
      // What RedisBackend writes to the socket: Python's command, framed here on its own.
      const resp = (args: string[]): string =>
        `*${args.length}\r\n` + args.map((a) => `$${Buffer.byteLength(a)}\r\n${a}\r\n`).join("");
      assert.equal(chargeFrame(script("charge").sha, ops, options), resp(c.command), `${what}: framed`);
      // The same charge on Postgres: mcpbg_charge's arguments as Python's PostgresBackend passes them.
      assert.deepEqual(chargeParams(ops, options), c.sql, `${what}: postgres`);
      if ((VECTORS.charge_many.cases as number[]).includes(i)) batch.push({ ops, eventId: options.eventId, opId: options.opId, wantUsed: true });
    }
    assert.equal(CHARGE_SQL, VECTORS.sql.charge, "the statement PostgresBackend runs");
    // The coalesced form: those checks as one mcpbg_charge_many batch, in order, and the
    // first alone. Python sends array literals, node-postgres makes its own from arrays:
    // each argument is compared as the values Postgres reads.
    assert.equal(batch.length, VECTORS.charge_many.cases.length);
    const read = (args: unknown[]): unknown[] => args.map((a) => (typeof a === "string" && a.startsWith("{") ? arrayLiteral(a) : a));
    assert.deepEqual(chargeManyParams(batch, false), read(VECTORS.charge_many.sql), "mcpbg_charge_many");
    assert.deepEqual(chargeManyParams(batch.slice(0, 1), false), read(VECTORS.charge_many.sql_one), "mcpbg_charge_many, one check");
    assert.equal(CHARGE_MANY_SQL, VECTORS.sql.charge_many);
  });

  it("charge a fixed price with the admission in the one charge.lua call Python's RedisBackend sends", () => {
    assert.ok(VECTORS.charge_priced.length >= 3);
    for (const c of VECTORS.charge_priced as Json[]) {
      const policy = parsePolicy(VECTORS.policies.good[c.policy].toml);
      const ctx = ctxOf(c.context);
      // The price's limits in the order Python's mapping gave them (the vectors' JSON
      // sorts keys): the order of their counters in the command, last seen.
      const at = (name: string): number => (c.command as string[]).map((a) => a.startsWith(`mcpbg:v1:${name}:`)).lastIndexOf(true);
      const names = Object.keys(c.price as Record<string, number>).sort((x, y) => at(x) - at(y));
      const pairs = names.map((name) => [planning.meteredLimit(policy, name), c.price[name] as number] as const);
      const plan = planning.withPrice(planning.checkPlan(policy, ctx, c.now), planning.meterSlots(pairs, ctx, c.now, policy));
      const first = plan.slots.length - plan.cost;
      assert.equal(first, c.cost_from);
      const options = {
        eventId: c.ledger ? withCost("0190f5a2-7e3b-7c1d-9f00-0000000000bb", "0190f5a2-7e3b-7c1d-9f00-0000000000ee", first) : null,
        opId: c.ledger ? null : "0190f5a2-7e3b-7c1d-9f00-0000000000aa",
        wantUsed: true,
        nowMs: c.now * 1000,
      };
      const what = `${c.policy} priced ${JSON.stringify(c.price)} ledger=${c.ledger}`;
      assert.deepEqual(["EVALSHA", ...chargeCommand(script("charge").sha, plan.ops, options)], c.command, what);
      assert.deepEqual(splitCost(withCost("a", "b", first)), ["a", "b", first]);
    }
  });
});

describe("policy files", () => {
  it("load into the same limits, plans and assignments", () => {
    for (const [name, want] of Object.entries(VECTORS.policies.good as Record<string, Json>)) {
      const policy = parsePolicy(want.toml, `${name}.toml`);
      assert.equal(policy.timezone, want.timezone, name);
      assert.equal(policy.anonymous, want.anonymous, name);
      const limits = policy.limits.map((l) => ({
        name: l.name,
        cap: l.cap,
        window: l.window,
        scope: [...l.dimensions],
        unit: l.unit,
        gated: l.gated,
        breaker: l.breaker,
        fail_mode: l.failMode,
        local_fallback: l.localFallback,
        status: l.status,
        on_exceed: l.onExceed,
        alert_at: [...l.alertAt],
        anchor_day: l.anchorDay,
        anchors: Object.fromEntries(l.anchors),
        caps: Object.fromEntries(l.caps),
        tools: [...l.tools],
      }));
      assert.deepEqual(limits, want.limits, name);
      assert.deepEqual(Object.fromEntries(policy.plans.map((p) => [p.name, Object.fromEntries(p.caps)])), want.plans, name);
      assert.deepEqual(Object.fromEntries(policy.assignments), want.assignments, name);
    }
  });

  it("refuse bad files naming the same key path and line", () => {
    for (const [name, want] of Object.entries(VECTORS.policies.bad as Record<string, Json>)) {
      assert.throws(
        () => parsePolicy(want.toml, `${name}.toml`),
        (err: unknown) => {
          assert.ok(err instanceof PolicyFileError, `${name}: ${String(err)}`);
          assert.equal(err.field, want.field, name);
          assert.equal(err.line, want.line, `${name}: ${err.message}`);
          return true;
        },
      );
    }
  });
});

describe("refusals", () => {
  it("read and carry the statuses Python's integrations give", () => {
    for (const r of VECTORS.refusals as Json[]) {
      const d = new Decision({
        admitted: false,
        limit: r.limit,
        status: r.status,
        retryAfter: r.retry_after,
        resetsAt: r.resets_at,
        reason: r.reason,
      });
      assert.equal(refusalText(d), r.text, r.name);
      assert.deepEqual(refusalBody(d), r.body, r.name);
      assert.deepEqual({ [REFUSAL_META_KEY]: refusalMeta(d) }, r.meta, r.name);
      assert.deepEqual(d.headers, r.headers, r.name);
      assert.equal(d.refusalType().name, r.error, r.name);
    }
  });

  it("are the decisions the planner makes for each kind of limit", () => {
    const policy = parsePolicy(VECTORS.policies.good.refusals.toml);
    const ctx = ctxOf({ user: "u_42", tenant: "acme" });
    const now = 1_796_066_077;
    for (const r of VECTORS.refusals as Json[]) {
      const [kind, name] = r.name.split(":");
      if (name === undefined) continue;
      const repeats = name === "repeats" ? parsePolicy(VECTORS.policies.good.repeats.toml) : null;
      const s =
        repeats === null
          ? planning.slot(policy.get(name), ctx, now, policy.tz, 1, true)
          : planning.slot(repeats.get(name), ctxOf({ session: "s-1", tool: "search", call: callHash("search", { q: "mcp" }) }), now, repeats.tz, 1, true);
      assert.ok(s !== null);
      const d = kind === "refused" ? planning.refused(s, now) : planning.unavailable(s, 1);
      assert.equal(refusalText(d), r.text, r.name);
      assert.equal(d.status, r.status, r.name);
    }
  });
});

describe("tool prices (_meta.mcpbg)", () => {
  it("read as Python's integrations read them", () => {
    const policy = parsePolicy(VECTORS.policies.good.three_gated.toml);
    for (const v of VECTORS.tool_meta as Json[]) {
      if (v.error !== undefined) {
        assert.throws(
          () => toolPrices(policy, "search", v.meta),
          (err: unknown) => err instanceof InvalidInputError && err.field === v.error,
          JSON.stringify(v.meta),
        );
      } else {
        assert.deepEqual(toolPrices(policy, "search", v.meta), { price: v.price, estimate: v.estimate }, JSON.stringify(v.meta));
      }
    }
  });
});

/** The values of a one-dimensional Postgres array literal ("{...}"): quoted elements
 * (backslash escapes) as strings, NULL as null, t/f as booleans, others as numbers. */
function arrayLiteral(text: string): unknown[] {
  const out: unknown[] = [];
  const body = text.slice(1, -1);
  let i = 0;
  while (i < body.length) {
    if (body[i] === '"') {
      let value = "";
      for (i++; body[i] !== '"'; i++) value += body[i] === "\\" ? (body[++i] ?? "") : body[i];
      out.push(value);
      i += 2; // the closing quote and the comma
    } else {
      const end = body.indexOf(",", i) < 0 ? body.length : body.indexOf(",", i);
      const token = body.slice(i, end);
      out.push(token === "NULL" ? null : token === "t" ? true : token === "f" ? false : Number(token));
      i = end + 1;
    }
  }
  return out;
}
