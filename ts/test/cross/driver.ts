// A TypeScript governor driven line by line from another process (the Python
// cross-language tests, tests/test_typescript_cross.py): one JSON command per
// stdin line, one JSON answer per stdout line.
//
//   tsx test/cross/driver.ts <policy.toml> <redis or postgresql url>
//   {"op": "check", "ctx": {"user": "u"}}            -> {"status": 200, "admitted": true}
//   {"op": "checks", "n": 10, "spread_ms": 500, "ctx": {...}} -> {"statuses": [200, ...]}  (concurrently)
//   {"op": "meter", "limit": "spend", "amount": 5, "ctx": {...}} -> {"total": 5}
//   {"op": "usage", "limit": "spend", "ctx": {...}}  -> {"usage": 5}
//   {"op": "set_cap", "limit": "burst", "amount": 2, "ctx": {"user": "u"}} -> {"change": {...}}
//   {"op": "key", "limit": "burst", "ctx": {...}}    -> {"key": "mcpbg:v1:..."}
//   {"op": "wait_check", "name": "w1", "wait": 10, "ctx": {...}} -> {"started": true}
//       (check(ctx, {wait}) in the background, its decision kept under the name)
//   {"op": "result", "name": "w1"}                   -> {"status": 200, "retry_after": null}  (when it ends)
//   {"op": "admitted_names"}                         -> {"names": ["w1", ...]}  (in order of admission)
//   {"op": "release", "name": "w1"}                  -> {"released": true}
//   {"op": "reserve_all", "estimates": {"a": 5, "b": 5}, "actual": {"a": 3}, "ctx": {...}}
//       -> {"status": 200}  (reserveAll, then settled to actual; a refusal: its status)
//   {"op": "reserve_alls", "n": 20, "estimates": {...}, "hold_ms": 200, "spread_ms": 500, "ctx": {...}}
//       -> {"statuses": [200, 402, ...]}  (concurrently, each held hold_ms; estimates stand)
import { createInterface } from "node:readline";

import { LimitExceeded, Governor, PostgresBackend, RedisBackend, context, loadPolicyFile, type Context, type Decision } from "../../src/index.js";
import { setCap } from "../../src/admin.js";
import { checkPlan } from "../../src/planning.js";

const [policyFile, url] = process.argv.slice(2);
if (policyFile === undefined || url === undefined) {
  console.error("usage: driver.ts <policy.toml> <redis or postgresql url>");
  process.exit(2);
}
const policy = loadPolicyFile(policyFile);
// A postgresql:// URL: PostgresBackend with every setting at its default (tests/test_typescript_postgres.py).
const backend = /^postgres(ql)?:/.test(url) ? PostgresBackend.fromUrl(url) : RedisBackend.fromUrl(url, { timeout: 5 });
const governor = new Governor(policy, backend);

/** Background checks (wait_check) by name, and the names admitted so far, in order. */
const checks = new Map<string, Promise<Decision>>();
const admittedNames: string[] = [];

interface Command {
  op: string;
  name?: string;
  wait?: number;
  ctx?: Record<string, string>;
  limit?: string;
  amount?: number;
  n?: number;
  spread_ms?: number;
  estimates?: Record<string, number>;
  actual?: Record<string, number>;
  hold_ms?: number;
}

/** reserveAll, held `holdMs`, then settled to `actual` (left out: the estimate stands). */
async function reserveAll(cmd: Command, ctx: Context, holdMs: number): Promise<number> {
  let held;
  try {
    held = await governor.reserveAll(cmd.estimates ?? {}, ctx);
  } catch (err) {
    if (err instanceof LimitExceeded) return err.decision.status;
    throw err;
  }
  if (holdMs) await new Promise((resolve) => setTimeout(resolve, holdMs));
  Object.assign(held.actual, cmd.actual ?? {});
  await held.finish();
  return 200;
}

async function run(cmd: Command): Promise<unknown> {
  const ctx: Context = context(cmd.ctx ?? {});
  switch (cmd.op) {
    case "check": {
      const d = await governor.check(ctx);
      return { status: d.status, admitted: d.admitted, reason: d.reason, degraded: d.degraded };
    }
    case "checks": {
      // Started over spread_ms (0: all at once), to interleave with the other language's calls.
      const n = cmd.n ?? 1;
      const spread = cmd.spread_ms ?? 0;
      const ds = await Promise.all(
        Array.from({ length: n }, async (_, i) => {
          if (spread) await new Promise((resolve) => setTimeout(resolve, (i * spread) / n));
          return governor.check(ctx);
        }),
      );
      return { statuses: ds.map((d) => d.status), degraded: ds.filter((d) => d.degraded).length };
    }
    case "meter":
      return { total: (await governor.meter(cmd.limit ?? "", cmd.amount ?? 0, ctx)).total };
    case "usage":
      return { usage: await governor.usage(cmd.limit ?? "", ctx) };
    case "key": {
      const slot = checkPlan(policy, ctx, Date.now() / 1000).slots.find((s) => s.limit.name === cmd.limit);
      return { key: slot?.key ?? null };
    }
    case "approval_key": {
      const backend = governor.backend as RedisBackend;
      return { key: Buffer.from(await backend.approvalKey()).toString("hex") };
    }
    case "set_cap":
      return { change: await setCap(governor, cmd.limit ?? "", cmd.amount ?? 0, cmd.ctx ?? {}) };
    case "wait_check": {
      const name = cmd.name ?? "";
      const pending = governor.check(ctx, { wait: cmd.wait ?? 0 }).then((d) => {
        if (d.admitted) admittedNames.push(name);
        return d;
      });
      pending.catch(() => undefined); // reported by "result"
      checks.set(name, pending);
      return { started: true };
    }
    case "result": {
      const d = await (checks.get(cmd.name ?? "") ?? Promise.reject(new Error(`no check ${cmd.name}`)));
      return { status: d.status, admitted: d.admitted, retry_after: d.retryAfter, limit: d.limit };
    }
    case "admitted_names":
      return { names: admittedNames };
    case "release": {
      const d = await (checks.get(cmd.name ?? "") ?? Promise.reject(new Error(`no check ${cmd.name}`)));
      await governor.release(d);
      return { released: true };
    }
    case "reserve_all":
      return { status: await reserveAll(cmd, ctx, cmd.hold_ms ?? 0) };
    case "reserve_alls": {
      const n = cmd.n ?? 1;
      const spread = cmd.spread_ms ?? 0;
      const statuses = await Promise.all(
        Array.from({ length: n }, async (_, i) => {
          if (spread) await new Promise((resolve) => setTimeout(resolve, (i * spread) / n));
          return reserveAll(cmd, ctx, cmd.hold_ms ?? 0);
        }),
      );
      return { statuses };
    }
    case "close":
      await governor.close();
      return { closed: true };
    default:
      throw new Error(`unknown op ${cmd.op}`);
  }
}

const lines = createInterface({ input: process.stdin });
console.log(JSON.stringify({ ready: true }));
for await (const line of lines) {
  if (!line.trim()) continue;
  let answer: unknown;
  try {
    answer = await run(JSON.parse(line) as Command);
  } catch (err) {
    answer = { error: err instanceof Error ? `${err.name}: ${err.message}` : String(err) };
  }
  console.log(JSON.stringify(answer));
  if ((answer as { closed?: boolean }).closed) break;
}
process.exit(0);
