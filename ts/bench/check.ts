// Latency of the TypeScript Governor.check() with 3 gated limits against one
// no-op EVALSHA (testing/noop.lua) from Node, through the same ioredis client
// on the same Redis. Target (DESIGN.md): median check() <= 1.3x the median
// no-op EVALSHA, measured in one run.
//
// Variants are interleaved in chunks, alternating which goes first, so drift
// on a busy machine hits both alike; each call is timed on its own. Besides
// the baseline and check(), two variants split the gap, both written as
// ready RESP text (no framing in Node): the no-op script sent the charge's
// own KEYS and ARGV (what the request's size costs), and the charge command
// alone, byte for byte what check() writes (charge.lua's work in Redis, no
// governor code: the floor of check()). A last variant sends the same bytes to
// testing/charge_floor.lua, which makes charge.lua's very Redis commands with
// none of its logic (tests/test_charge_floor.py holds the two together): the
// cost of the work itself, which no script doing it atomically goes below.
//
//   npx tsx bench/check.ts [--redis URL] [--calls N] [--rounds R] [--json] [--profile]
//
// --profile adds, after the interleaved run: Redis' own time per EVALSHA of
// each variant (INFO commandstats deltas, each variant alone; on a shared
// Redis other clients' EVALSHAs count too, so point --redis at a private
// instance for clean figures) and the Node-side costs without Redis: check()
// through RedisBackend over a client that answers at once, and ioredis
// building each command.
//
// Default Redis: MCPBG_TEST_REDIS_URL, else redis://127.0.0.1:6379/13. Only this
// run's keys are written (they expire within the hour; the run deletes them).
import { randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";

import { Command, Redis } from "ioredis";

import { Governor, Limit, MAX_AMOUNT, Policy, RedisBackend, Scope, Window, chargeCommand, context, script } from "../src/index.js";
import { newId } from "../src/ledger/events.js";
import { checkPlan } from "../src/planning.js";

const TARGET = 1.3;
const { values } = parseArgs({
  options: {
    redis: { type: "string" },
    calls: { type: "string", default: "2000" },
    rounds: { type: "string", default: "5" },
    chunk: { type: "string", default: "50" },
    json: { type: "boolean", default: false },
    profile: { type: "boolean", default: false },
  },
});
const url = values.redis ?? (process.env["MCPBG_TEST_REDIS_URL"]?.trim() || "redis://127.0.0.1:6379/13");
const calls = Number(values.calls);
const rounds = Number(values.rounds);
const chunk = Number(values.chunk);

const rid = randomBytes(4).toString("hex");
const policy = Policy.of(
  new Limit(`b${rid}_user_day`, { cap: MAX_AMOUNT, window: Window.DAY, scope: Scope.USER }),
  new Limit(`b${rid}_tenant_min`, { cap: MAX_AMOUNT, window: Window.MINUTE, scope: Scope.TENANT }),
  new Limit(`b${rid}_tool_hour`, { cap: MAX_AMOUNT, window: Window.HOUR, scope: [Scope.USER, Scope.TOOL] }),
);
const backend = RedisBackend.fromUrl(url, { timeout: 5 });
const governor = new Governor(policy, backend);
const ctx = context({ user: "bench_user", tenant: "bench_tenant", tool: "search" });
const noop = readFileSync(new URL("../../testing/noop.lua", import.meta.url), "utf8");
const noopSha = (await backend.client.call("SCRIPT", "LOAD", noop)) as string;
const floor = readFileSync(new URL("../../testing/charge_floor.lua", import.meta.url), "utf8");
const floorSha = (await backend.client.call("SCRIPT", "LOAD", floor)) as string;

// The script alone: the very command check() sends, as the very RESP text it
// writes (framed once, a fresh operation id and clock per call), to tell the
// script's own cost in Redis from the governor's in Node.
const ops = checkPlan(policy, ctx, Date.now() / 1000).ops;
const PLACEHOLDER = "0190f5a2-7e3b-7c1d-9f00-0000000000aa"; // as long as every id newId() makes
const template = chargeCommand(script("charge").sha, ops, { opId: PLACEHOLDER, wantUsed: true });
const bulk = (a: string): string => `$${Buffer.byteLength(a)}\r\n${a}\r\n`;
function framedWithout(sha: string): string {
  const args = ["EVALSHA", sha, ...template.slice(1)];
  const text = `*${args.length}\r\n${args.map(bulk).join("")}`;
  return text.slice(0, text.lastIndexOf("$")); // all but the clock
}
/** A command written as the given RESP text (ioredis frames nothing). */
class Framed extends Command {
  constructor(private readonly text: string) {
    super("evalsha", [], { replyEncoding: "utf8" });
  }

  override toWritable(): string {
    return this.text;
  }
}
function sendFramed(head: string): Promise<unknown> {
  const c = new Framed(head.replaceAll(PLACEHOLDER, newId()) + bulk(String(Date.now())));
  void backend.client.sendCommand(c);
  return c.promise;
}
const chargeHead = framedWithout(template[0] ?? "");
const noopHead = framedWithout(noopSha);
const floorHead = framedWithout(floorSha);
const variants: Record<string, () => Promise<unknown>> = {
  "noop EVALSHA": () => backend.client.call("EVALSHA", noopSha, 0),
  "check() 3 limits": () => governor.check(ctx),
  "charge.lua alone": () => sendFramed(chargeHead),
  // The no-op script sent the charge's KEYS and ARGV: what the request's size costs.
  "noop, charge's args": () => sendFramed(noopHead),
  // charge.lua's Redis operations alone (testing/charge_floor.lua), no logic:
  // what no script doing check()'s work atomically can go below.
  "charge's ops, no logic": () => sendFramed(floorHead),
};
const samples: Record<string, number[]> = Object.fromEntries(Object.keys(variants).map((k) => [k, []]));

for (let i = 0; i < 200; i++) for (const run of Object.values(variants)) await run(); // warm up

const names = Object.keys(variants);
for (let r = 0; r < rounds; r++) {
  for (let done = 0; done < calls; done += chunk) {
    const order = (done / chunk) % 2 === 0 ? names : [...names].reverse();
    for (const name of order) {
      const run = variants[name];
      const out = samples[name];
      if (run === undefined || out === undefined) continue;
      for (let i = 0; i < chunk; i++) {
        const t = process.hrtime.bigint();
        await run();
        out.push(Number(process.hrtime.bigint() - t) / 1000);
      }
    }
  }
  process.stderr.write(`round ${r + 1}/${rounds}\n`);
}

function quantile(xs: number[], q: number): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(q * s.length))] ?? NaN;
}

const base = quantile(samples["noop EVALSHA"] ?? [], 0.5);
const rows = names.map((name) => {
  const xs = samples[name] ?? [];
  const median = quantile(xs, 0.5);
  return { variant: name, calls: xs.length, median_us: median, p99_us: quantile(xs, 0.99), ratio: median / base };
});
const ratioOf = (name: string): number => rows.find((r) => r.variant === name)?.ratio ?? NaN;
const ratio = ratioOf("check() 3 limits");
const alone = ratioOf("charge.lua alone");

// -- --profile: where the time goes --------------------------------------------

/** Redis' own microseconds per EVALSHA while `run` is the only variant running. */
async function serverUs(run: () => Promise<unknown>, n: number): Promise<number> {
  const stat = async (): Promise<[number, number]> => {
    const info = (await backend.client.info("commandstats")) as string;
    const m = /cmdstat_evalsha:calls=(\d+),usec=(\d+)/.exec(info);
    return m ? [Number(m[1]), Number(m[2])] : [0, 0];
  };
  const [c0, u0] = await stat();
  for (let i = 0; i < n; i++) await run();
  const [c1, u1] = await stat();
  return (u1 - u0) / Math.max(1, c1 - c0);
}

/** Median microseconds of `run` (synchronous, or resolving without I/O), in blocks of 100. */
async function nodeUs(run: () => unknown, n: number): Promise<number> {
  const per: number[] = [];
  for (let b = 0; b < n / 100; b++) {
    const t = process.hrtime.bigint();
    for (let i = 0; i < 100; i++) await run();
    per.push(Number(process.hrtime.bigint() - t) / 1000 / 100);
  }
  return quantile(per, 0.5);
}

interface Profile {
  server_us: Record<string, number>;
  node_us: Record<string, number>;
}

async function profile(): Promise<Profile> {
  const server_us: Record<string, number> = {};
  for (const name of names) {
    const run = variants[name];
    if (run === undefined) continue;
    const xs: number[] = [];
    for (let r = 0; r < 3; r++) xs.push(await serverUs(run, 2000));
    server_us[name] = quantile(xs, 0.5);
  }
  // The governor and RedisBackend with Redis taken away: an ioredis client whose
  // every command is framed for the socket as usual, then answered at once with
  // what charge.lua replies to an admitted check.
  const reply = [0, ...ops.map(() => 0), ...ops.map(() => MAX_AMOUNT)];
  const stub = new Redis({ lazyConnect: true });
  stub.sendCommand = (c: Command) => {
    c.toWritable(undefined as never);
    c.resolve(reply);
    return c.promise;
  };
  const offline = new Governor(policy, new RedisBackend(stub));
  const command = (args: string[]) => () => new Command("evalsha", args).toWritable(undefined as never);
  const node_us = {
    "check() over an instant client": await nodeUs(() => offline.check(ctx), 20_000),
    "ioredis framing the noop": await nodeUs(command([noopSha, "0"]), 20_000),
    "ioredis framing the charge": await nodeUs(command([...template]), 20_000),
  };
  return { server_us, node_us };
}

const prof = values.profile ? await profile() : null;

// Clean up this run's counters and operation markers.
for (const pattern of [`mcpbg:v1:b${rid}_*`]) {
  let cursor = "0";
  do {
    const [next, keys] = (await backend.client.scan(cursor, "MATCH", pattern, "COUNT", 1000)) as [string, string[]];
    if (keys.length) await backend.client.del(...keys);
    cursor = next;
  } while (cursor !== "0");
}
await governor.close();

if (values.json) console.log(JSON.stringify({ url, node: process.version, rows, ratio, target: TARGET, profile: prof }, null, 1));
else {
  console.log(`Node ${process.version}, Redis ${url}, ${calls * rounds} calls per variant, interleaved`);
  console.log("variant                  median µs   p99 µs   ratio");
  for (const r of rows) {
    console.log(`${r.variant.padEnd(24)} ${r.median_us.toFixed(1).padStart(9)} ${r.p99_us.toFixed(1).padStart(8)} ${r.ratio.toFixed(2).padStart(7)}x`);
  }
  console.log(`check() with 3 gated limits / no-op EVALSHA: ${ratio.toFixed(2)}x (target <= ${TARGET}x): ${ratio <= TARGET ? "met" : "NOT met"}`);
  console.log(
    `floor without governor code: charge.lua alone / no-op EVALSHA ${alone.toFixed(2)}x ` +
      `(request size alone ${ratioOf("noop, charge's args").toFixed(2)}x); check() / charge.lua alone: ${(ratio / alone).toFixed(2)}x`,
  );
  const ops = ratioOf("charge's ops, no logic");
  console.log(
    `floor of the work: charge's Redis operations with no logic / no-op EVALSHA ${ops.toFixed(2)}x; ` +
      `charge.lua / those operations ${(alone / ops).toFixed(2)}x; check() / those operations ${(ratio / ops).toFixed(2)}x`,
  );
  if (prof !== null) {
    console.log("Redis' own time per EVALSHA (INFO commandstats, each variant alone):");
    for (const [k, v] of Object.entries(prof.server_us)) console.log(`  ${k.padEnd(32)} ${v.toFixed(1).padStart(6)} µs`);
    console.log("Node-side time without Redis (median of blocks of 100):");
    for (const [k, v] of Object.entries(prof.node_us)) console.log(`  ${k.padEnd(32)} ${v.toFixed(2).padStart(6)} µs`);
  }
}
