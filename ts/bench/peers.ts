// Per-call overhead of the fastmcp integration (governFastMCP), the TypeScript
// side of benchmarks/bench_peers.py: serial tools/call requests to one server
// of each kind, interleaved in small chunks (alternating which goes first) so
// drift on a busy machine hits every variant alike, each call timed on its own:
//
//   unguarded   the tool alone
//   redis_rtt   the tool doing one no-op EVALSHA itself (testing/noop.lua): one
//               Redis round trip, the floor of any guard on a shared counter
//   governed    governTool, a count limit checked and the tool's fixed price
//               (_meta.mcpbg cost_usd) charged on a USD limit, on the same Redis,
//               by the admission: one charge.lua call
//   two_trips   the same, the price metered after the tool and its reply awaited
//               (a backend without pricesAtAdmission and chargeSent: how every
//               priced call went before issue 33), the baseline of the change
//
// Target (issue 33): governed <= 1.03x redis_rtt over streamable HTTP, and the
// price counted exactly (the USD counter = governed calls x price, the count
// limit = governed calls). The three are tools of one server (governTool on
// one of them), called by one client: only the tool differs, so the scheduling
// of a process of its own, which on a loaded machine moves a variant by 20%
// either way, does not. --apart gives each its own server instead (Python's
// layout). Over streamable HTTP the server is a process of its own (this
// script with --serve); over the SDK's in-memory transport (FastMCP.connect)
// client and server share this process.
//
//   npx tsx bench/peers.ts [--redis URL] [--calls N] [--rounds R] [--chunk K] [--apart] [--json]
//
// Default Redis: MCPBG_TEST_REDIS_URL, else redis://127.0.0.1:6379/13. Only this
// run's keys are written (mcpbg:v1:bench_<run id>_*; the run deletes them). Exit
// status 1 when a timed call failed or a counter is not exact.
import { spawn, type ChildProcess } from "node:child_process";
import { randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";
import { createConnection, createServer } from "node:net";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { InMemoryTransport } from "@modelcontextprotocol/sdk/inMemory.js";
import { FastMCP } from "fastmcp";
import { Redis } from "ioredis";
import { z } from "zod";

import type { Policy, RedisBackend } from "../src/index.js";

// The shipped build (dist/, which `npm run bench:peers` builds first), as users run it;
// the types are src/'s. tsx's transform of src/ wraps every closure in a __name() call
// the build does not have: about 6 µs of a governed call here, 0.2% of a call over HTTP.
const DIST = "../dist/";
const { Governor, Limit, MAX_AMOUNT, Policy: Policies, RedisBackend: Backends, Unit, Window, context, usd } =
  (await import(`${DIST}index.js`)) as typeof import("../src/index.js");
const { governTool } = (await import(`${DIST}integrations/fastmcp.js`)) as typeof import("../src/integrations/fastmcp.js");

const TARGET = 1.03;
const PRICE = "0.001";
const KINDS = ["unguarded", "redis_rtt", "governed", "two_trips"] as const;
type Kind = (typeof KINDS)[number];

const { values } = parseArgs({
  options: {
    redis: { type: "string" },
    calls: { type: "string", default: "600" },
    rounds: { type: "string", default: "5" },
    chunk: { type: "string", default: "25" },
    warmup: { type: "string", default: "100" },
    json: { type: "boolean", default: false },
    apart: { type: "boolean", default: false },
    serve: { type: "string" },
    port: { type: "string" },
    rid: { type: "string" },
  },
});
const url = values.redis ?? (process.env["MCPBG_TEST_REDIS_URL"]?.trim() || "redis://127.0.0.1:6379/13");

const policyOf = (rid: string): Policy =>
  Policies.of(
    // DAY: a window boundary mid-run would open a second bucket and spoil the count.
    new Limit(`bench_${rid}_calls`, { cap: MAX_AMOUNT, window: Window.DAY }),
    new Limit(`bench_${rid}_spend`, { cap: MAX_AMOUNT, window: Window.DAY, unit: Unit.USD_MICROS, gated: false }),
  );

/** One server with a tool per kind (named by it); `close` ends what it holds open. */
function buildServer(kinds: readonly Kind[], rid: string): { server: FastMCP; close: () => Promise<void> } {
  const server = new FastMCP({ name: "peer", version: "1.0.0" });
  const closers: (() => Promise<void>)[] = [];
  for (const kind of kinds) {
    let rtt: (() => Promise<unknown>) | null = null;
    if (kind === "redis_rtt") {
      const client = new Redis(url);
      const noop = readFileSync(new URL("../../testing/noop.lua", import.meta.url), "utf8");
      let sha: string | null = null;
      rtt = async () => client.evalsha((sha ??= (await client.script("LOAD", noop)) as string), 0);
      closers.push(async () => void client.disconnect());
    }
    const tool = {
      name: kind,
      parameters: z.object({ n: z.number() }),
      execute: async ({ n }: { n: number }) => {
        if (rtt !== null) await rtt(); // the calibration: what one Redis round trip costs here
        return String(n);
      },
    };
    if (kind === "governed" || kind === "two_trips") {
      const redis = Backends.fromUrl(url, { timeout: 5 });
      // two_trips: the same backend, saying it can neither price at admission nor charge without waiting.
      const backend: RedisBackend =
        kind === "governed" ? redis : Object.create(redis, { pricesAtAdmission: { value: false }, chargeSent: { value: undefined } });
      const governor = new Governor(policyOf(rid), backend);
      closers.push(() => governor.close());
      const priced = { ...tool, _meta: { mcpbg: { cost_usd: PRICE, limit: `bench_${rid}_spend` } } };
      server.addTool(governTool(governor, priced, { identify: () => context({ user: "bench_user" }) }));
    } else server.addTool(tool);
  }
  return { server, close: async () => void (await Promise.all(closers.map((c) => c()))) };
}

// -- --serve: one server over streamable HTTP, until SIGTERM ------------------------

if (values.serve !== undefined) {
  const kinds = values.serve === "all" ? KINDS : [values.serve as Kind];
  const { server, close } = buildServer(kinds, values.rid ?? "");
  await server.start({ transportType: "httpStream", httpStream: { port: Number(values.port), host: "127.0.0.1" } });
  process.on("SIGTERM", () => {
    void server
      .stop()
      .then(close)
      .finally(() => process.exit(0));
  });
} else await main();

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.listen(0, "127.0.0.1", () => {
      const a = s.address();
      s.close(() => (typeof a === "object" && a !== null ? resolve(a.port) : reject(new Error("no port"))));
    });
  });
}

async function listening(port: number, child: ChildProcess): Promise<void> {
  const deadline = Date.now() + 60_000;
  while (Date.now() < deadline) {
    if (child.exitCode !== null) throw new Error(`server on port ${port} exited with ${child.exitCode}`);
    const up = await new Promise<boolean>((resolve) => {
      const c = createConnection({ port, host: "127.0.0.1" }, () => {
        c.end();
        resolve(true);
      });
      c.on("error", () => resolve(false));
    });
    if (up) return;
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`server on port ${port} did not listen within 60 s`);
}

function quantile(xs: readonly number[], q: number): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(q * s.length))] ?? NaN;
}

type Call = () => Promise<void>;

/** Serial calls to each target, interleaved `chunk` at a time; microseconds per call. */
async function latency(targets: Record<Kind, Call>, counted: { governed: number; failed: number }): Promise<Record<Kind, number[]>> {
  const [calls, rounds, chunk, warmup] = [values.calls, values.rounds, values.chunk, values.warmup].map(Number) as [number, number, number, number];
  const samples = { unguarded: [] as number[], redis_rtt: [] as number[], governed: [] as number[], two_trips: [] as number[] };
  const once = async (kind: Kind): Promise<void> => {
    if (kind === "governed" || kind === "two_trips") counted.governed++;
    try {
      await targets[kind]();
    } catch {
      counted.failed++;
    }
  };
  for (let i = 0; i < warmup; i++) for (const kind of KINDS) await once(kind);
  for (let r = 0; r < rounds; r++) {
    for (let done = 0; done < calls; done += chunk) {
      const order = (done / chunk) % 2 === 0 ? KINDS : [...KINDS].reverse();
      for (const kind of order) {
        for (let i = 0; i < Math.min(chunk, calls - done); i++) {
          const t = process.hrtime.bigint();
          await once(kind);
          samples[kind].push(Number(process.hrtime.bigint() - t) / 1000);
        }
      }
    }
    process.stderr.write(`round ${r + 1}/${rounds}\n`);
  }
  return samples;
}

/** A tools/call of `name` through `client` that throws unless the tool answered. */
function caller(client: Client, name: Kind): Call {
  let n = 0;
  return async () => {
    const r = await client.callTool({ name, arguments: { n: n++ } });
    if (r.isError) throw new Error(JSON.stringify(r.content));
  };
}

function summary(samples: Record<Kind, number[]>): { kind: Kind; calls: number; median_us: number; p99_us: number; vs_unguarded: number; vs_redis_rtt: number }[] {
  const base = quantile(samples.unguarded, 0.5);
  const rtt = quantile(samples.redis_rtt, 0.5);
  return KINDS.map((kind) => {
    const median = quantile(samples[kind], 0.5);
    return { kind, calls: samples[kind].length, median_us: median, p99_us: quantile(samples[kind], 0.99), vs_unguarded: median / base, vs_redis_rtt: median / rtt };
  });
}

async function main(): Promise<void> {
  const rid = randomBytes(4).toString("hex");
  const counted = { governed: 0, failed: 0 };
  const children: ChildProcess[] = [];
  const clients: Client[] = [];
  const closers: (() => Promise<void>)[] = [];
  const results: Record<string, ReturnType<typeof summary>> = {};
  try {
    // The servers: one with every tool, or one per kind (--apart).
    const groups: (readonly Kind[])[] = values.apart ? KINDS.map((k) => [k]) : [KINDS];
    // Streamable HTTP: a server process each.
    const script = fileURLToPath(import.meta.url);
    const http = {} as Record<Kind, Call>;
    for (const group of groups) {
      const port = await freePort();
      const serve = group.length > 1 ? "all" : (group[0] ?? "");
      const child = spawn(process.execPath, [...process.execArgv, script, "--serve", serve, "--port", String(port), "--rid", rid, "--redis", url], {
        stdio: ["ignore", "ignore", "inherit"],
      });
      children.push(child);
      await listening(port, child);
      const client = new Client({ name: "bench", version: "1.0.0" });
      await client.connect(new StreamableHTTPClientTransport(new URL(`http://127.0.0.1:${port}/mcp`)));
      clients.push(client);
      for (const kind of group) http[kind] = caller(client, kind);
    }
    process.stderr.write("streamable HTTP\n");
    results["streamable_http"] = summary(await latency(http, counted));

    // In memory: client and servers in this process.
    const memory = {} as Record<Kind, Call>;
    for (const group of groups) {
      const { server, close } = buildServer(group, rid);
      closers.push(close);
      const [clientSide, serverSide] = InMemoryTransport.createLinkedPair();
      const client = new Client({ name: "bench", version: "1.0.0" });
      await Promise.all([server.connect(serverSide), client.connect(clientSide)]);
      clients.push(client);
      for (const kind of group) memory[kind] = caller(client, kind);
    }
    process.stderr.write("in memory\n");
    results["in_memory"] = summary(await latency(memory, counted));
  } finally {
    for (const c of clients) await c.close().catch(() => undefined);
    for (const close of closers) await close().catch(() => undefined);
    for (const child of children) child.kill("SIGTERM");
  }

  // The price counted exactly: every governed call charged once, on both limits.
  const governor = new Governor(policyOf(rid), Backends.fromUrl(url, { timeout: 5 }));
  const spend = await governor.usage(`bench_${rid}_spend`);
  const calls = await governor.usage(`bench_${rid}_calls`);
  const price = usd(PRICE);
  const exact = spend === counted.governed * price && calls === counted.governed;
  const client = (governor.backend as RedisBackend).client;
  let cursor = "0";
  do {
    const [next, keys] = (await client.scan(cursor, "MATCH", `mcpbg:v1:bench_${rid}_*`, "COUNT", 1000)) as [string, string[]];
    if (keys.length) await client.del(...keys);
    cursor = next;
  } while (cursor !== "0");
  await governor.close();

  const http = results["streamable_http"]?.find((r) => r.kind === "governed")?.vs_redis_rtt ?? NaN;
  // governed and two_trips charge the same counters: both count.
  const counters = { governed_calls: counted.governed, spend_micros: spend, expected_micros: counted.governed * price, calls_counted: calls, exact };
  if (values.json) {
    console.log(JSON.stringify({ url, node: process.version, apart: values.apart, results, counters, failed: counted.failed, ratio: http, target: TARGET }, null, 1));
  } else {
    const layout = values.apart ? "a server per variant" : "one server, a tool per variant";
    console.log(`Node ${process.version}, Redis ${url}, fastmcp governTool, ${layout}, serial calls interleaved in chunks of ${values.chunk}`);
    for (const [transport, rows] of Object.entries(results)) {
      console.log(`${transport}:\n  variant      calls   median µs   p99 µs   vs unguarded   vs redis_rtt`);
      for (const r of rows) {
        console.log(
          `  ${r.kind.padEnd(11)} ${String(r.calls).padStart(6)} ${r.median_us.toFixed(1).padStart(11)} ${r.p99_us.toFixed(1).padStart(8)} ` +
            `${r.vs_unguarded.toFixed(2).padStart(13)}x ${r.vs_redis_rtt.toFixed(2).padStart(13)}x`,
        );
      }
    }
    console.log(`governed / one no-op EVALSHA in the tool, streamable HTTP: ${http.toFixed(3)}x (target <= ${TARGET}x): ${http <= TARGET ? "met" : "NOT met"}`);
    for (const [transport, rows] of Object.entries(results)) {
      const median = (kind: Kind): number => rows.find((r) => r.kind === kind)?.median_us ?? NaN;
      console.log(`${transport}: governed ${(median("two_trips") - median("governed")).toFixed(0)} µs faster than two_trips (${(median("governed") / median("two_trips")).toFixed(3)}x)`);
    }
    console.log(
      `price counted exactly: ${exact ? "yes" : "NO"} (${counted.governed} governed calls x ${price} µ$ = ${counted.governed * price}; ` +
        `spend counter ${spend}, count limit ${calls}); failed calls: ${counted.failed}`,
    );
  }
  // fastmcp's sessions keep pinging closed in-memory clients: end here.
  process.exit(exact && counted.failed === 0 ? 0 : 1);
}
