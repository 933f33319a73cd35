// Serial latency of the TypeScript Governor.check() with 3 limits on PostgresBackend
// (every setting at its default but `durable`), against one `SELECT 1` through the
// same pool, interleaved in chunks (alternating which goes first) so drift on a busy
// machine hits both alike. The limits and contexts are benchmarks/bench_postgres.py's,
// so that script can set the Node figure beside Python's from the same run: it runs
// this and reads the one JSON line it prints on stdout.
//
//   npx tsx bench/postgres.ts --postgres URL [--calls N] [--rounds R] [--durable false]
//   -> {"bench": "ts_postgres_check", "durable": true, "calls": 2000, "check_us": ...,
//       "select1_us": ..., "ratio": ...}    (medians in microseconds; ratio = check / SELECT 1)
//
// Default database: MCPBG_TEST_POSTGRES_URL, else the TypeScript suite's own
// (test/services.ts). Counters are named per run (their keys end within the month).
import { randomBytes } from "node:crypto";
import { parseArgs } from "node:util";

import { Governor, Limit, MAX_AMOUNT, Policy, PostgresBackend, Scope, Window, context } from "../src/index.js";
import { postgresUrl } from "../test/services.js";

const { values } = parseArgs({
  options: {
    postgres: { type: "string" },
    calls: { type: "string", default: "2000" },
    rounds: { type: "string", default: "5" },
    chunk: { type: "string", default: "50" },
    durable: { type: "string", default: "true" },
  },
});
const url = values.postgres ?? (await postgresUrl());
const calls = Number(values.calls);
const rounds = Number(values.rounds);
const chunk = Number(values.chunk);
const durable = values.durable !== "false";

const rid = randomBytes(4).toString("hex");
const policy = Policy.of(
  new Limit(`b${rid}_user`, { cap: MAX_AMOUNT, window: Window.DAY, scope: Scope.USER }),
  new Limit(`b${rid}_tenant`, { cap: MAX_AMOUNT, window: Window.MONTH, scope: Scope.TENANT }),
  new Limit(`b${rid}_tool`, { cap: MAX_AMOUNT, window: Window.HOUR, scope: [Scope.USER, Scope.TOOL] }),
);
const backend = PostgresBackend.fromUrl(url, { durable });
const governor = new Governor(policy, backend);
const ctxs = Array.from({ length: 64 }, (_, i) => context({ user: `u${i}`, tenant: `t${i % 8}`, tool: "search" }));

async function check(i: number): Promise<void> {
  const d = await governor.check(ctxs[i % ctxs.length] ?? null);
  if (!d.admitted || d.degraded) throw new Error(`check ${i}: ${d.status} ${d.reason} (degraded: ${d.degraded})`);
}

async function select1(): Promise<void> {
  await backend.pool.query("SELECT 1");
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  const mid = Math.floor(s.length / 2);
  return s.length % 2 ? (s[mid] ?? 0) : ((s[mid - 1] ?? 0) + (s[mid] ?? 0)) / 2;
}

await backend.migrate();
for (let i = 0; i < 100; i++) {
  await check(i); // the connection's plans and the rows exist before timing
  await select1();
}
const checkNs: number[] = [];
const baseNs: number[] = [];
let n = 0;
for (let r = 0; r < rounds; r++) {
  for (let done = 0; done < calls; done += chunk) {
    const size = Math.min(chunk, calls - done);
    const order = (done / chunk + r) % 2 ? ["check", "base"] : ["base", "check"];
    for (const which of order) {
      for (let i = 0; i < size; i++) {
        const t = process.hrtime.bigint();
        if (which === "check") await check(n++);
        else await select1();
        (which === "check" ? checkNs : baseNs).push(Number(process.hrtime.bigint() - t));
      }
    }
  }
}
await governor.close();
const checkUs = median(checkNs) / 1000;
const select1Us = median(baseNs) / 1000;
console.log(
  JSON.stringify({
    bench: "ts_postgres_check",
    durable,
    calls: calls * rounds,
    check_us: Math.round(checkUs * 10) / 10,
    select1_us: Math.round(select1Us * 10) / 10,
    ratio: Math.round((checkUs / select1Us) * 1000) / 1000,
  }),
);
