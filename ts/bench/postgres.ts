// Serial latency of the TypeScript Governor.check() with 3 limits on PostgresBackend
// (every setting at its default but `durable`), against one `SELECT 1` through the
// same pool, interleaved in chunks (alternating which goes first) so drift on a busy
// machine hits both alike. The limits and contexts are benchmarks/bench_postgres.py's,
// so that script can set the Node figure beside Python's from the same run: it runs
// this and reads the one JSON line it prints on stdout.
//
//   npx tsx bench/postgres.ts --postgres URL [--calls N] [--rounds R] [--durable false]
//                             [--callers 64 --seconds 3]
//   -> {"bench": "ts_postgres_check", "durable": true, "calls": 2000, "check_us": ...,
//       "select1_us": ..., "ratio": ...}    (medians in microseconds; ratio = check / SELECT 1)
//
// --callers N adds N concurrent callers for --seconds each: checks/s (coalesced) and
// SELECT 1/s through the same pool, their ratio, and how many checks the fail mode
// decided ("concurrent_checks_per_s", "concurrent_select1_per_s", "concurrent_ratio",
// "degraded").
//
// The database: --postgres, else MCPBG_TEST_POSTGRES_URL. Counters are named per run
// (their keys end within the month).
import { randomBytes } from "node:crypto";
import { parseArgs } from "node:util";

import { Governor, Limit, MAX_AMOUNT, Policy, PostgresBackend, Scope, Window, context } from "../src/index.js";

const { values } = parseArgs({
  options: {
    postgres: { type: "string" },
    calls: { type: "string", default: "2000" },
    rounds: { type: "string", default: "5" },
    chunk: { type: "string", default: "50" },
    durable: { type: "string", default: "true" },
    callers: { type: "string", default: "0" },
    seconds: { type: "string", default: "3" },
  },
});
const url = values.postgres ?? process.env["MCPBG_TEST_POSTGRES_URL"]?.trim();
if (!url) {
  console.error("bench/postgres.ts: name the database with --postgres URL (or MCPBG_TEST_POSTGRES_URL)");
  process.exit(2);
}
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
const concurrent: Record<string, number> = {};
const callers = Number(values.callers);
if (callers > 0) {
  const ms = Number(values.seconds) * 1000;
  let checks = 0;
  let degraded = 0;
  let selects = 0;
  let end = performance.now() + ms;
  await Promise.all(
    Array.from({ length: callers }, async (_, i) => {
      while (performance.now() < end) {
        const d = await governor.check(ctxs[i % ctxs.length] ?? null);
        checks++;
        if (d.degraded) degraded++;
      }
    }),
  );
  end = performance.now() + ms;
  await Promise.all(
    Array.from({ length: callers }, async () => {
      while (performance.now() < end) {
        await select1();
        selects++;
      }
    }),
  );
  Object.assign(concurrent, {
    callers,
    concurrent_checks_per_s: Math.round(checks / (ms / 1000)),
    concurrent_select1_per_s: Math.round(selects / (ms / 1000)),
    concurrent_ratio: Math.round((checks / selects) * 1000) / 1000,
    degraded,
  });
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
    ...concurrent,
  }),
);
