// The integrations' OnExceed.ASK approvals through MCP elicitation, with real
// in-process clients of each SDK (accepting, declining, unable to elicit), and
// their `wait` for a concurrency slot.
import assert from "node:assert/strict";
import { after, describe, it } from "node:test";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { InMemoryTransport } from "@modelcontextprotocol/sdk/inMemory.js";
import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { ElicitRequestSchema, type ElicitResult } from "@modelcontextprotocol/sdk/types.js";
import { FastMCP } from "fastmcp";

import { EntryType, Governor, InvalidInputError, MemoryBackend, MemoryLedger, RedisBackend, context, parsePolicy } from "../src/index.js";
import { governFastMCP } from "../src/integrations/fastmcp.js";
import { governTools } from "../src/integrations/sdk.js";
import { REDIS_URL, fresh, frozenClock } from "./services.js";

const POLICY = `
[[limits]]
name = "asked"
cap = 1
window = "minute"
scope = "user"
on_exceed = "ask"
`;

// "asked" is a minute's: each test's governor runs on a frozen clock, so its two calls
// share one bucket even when the minute turns between them.
type Result = { isError?: boolean; content: { type: string; text?: string }[] };

const sessions: { close(): Promise<void> }[] = [];
after(async () => {
  for (const s of sessions) await s.close();
});

/** A client that answers every elicitation with `answer` (null: it cannot elicit; "never": it never answers). */
async function connect(
  server: { connect(t: InMemoryTransport): Promise<unknown> },
  answer: ElicitResult | null | "never",
  asked: string[] = [],
): Promise<Client> {
  const [clientSide, serverSide] = InMemoryTransport.createLinkedPair();
  const client = new Client({ name: "test-client", version: "1.0.0" }, { capabilities: answer === null ? {} : { elicitation: {} } });
  if (answer !== null) {
    client.setRequestHandler(ElicitRequestSchema, async (request) => {
      asked.push(request.params.message);
      return answer === "never" ? new Promise<ElicitResult>(() => undefined) : answer;
    });
  }
  const [session] = await Promise.all([server.connect(serverSide), client.connect(clientSide)]);
  if (session && typeof (session as { close?: unknown }).close === "function") sessions.push(session as { close(): Promise<void> });
  return client;
}

async function call(client: Client, name: string): Promise<Result> {
  return (await client.callTool({ name, arguments: {} })) as Result;
}

const fastOptions = { name: "s", version: "1.0.0", ping: { enabled: false }, roots: { enabled: false } } as const;

const YES: ElicitResult = { action: "accept", content: { value: true } };
const NO: ElicitResult = { action: "decline" };

const frameworks: [string, (gov: Governor, user: string) => { connect(t: InMemoryTransport): Promise<unknown> }][] = [
  [
    "@modelcontextprotocol/sdk McpServer",
    (gov, user) => {
      const server = new McpServer({ name: "s", version: "1.0.0" });
      governTools(server, gov, { identify: () => context({ user }), approvalTimeout: 0.3 });
      server.registerTool("search", {}, async () => ({ content: [{ type: "text", text: "ran" }] }));
      return server;
    },
  ],
  [
    "fastmcp",
    (gov, user) => {
      const server = new FastMCP(fastOptions);
      governFastMCP(server, gov, { identify: () => context({ user }), approvalTimeout: 0.3 });
      server.addTool({ name: "search", execute: async () => "ran" });
      return server;
    },
  ],
];

for (const [name, serve] of frameworks) {
  describe(`OnExceed.ASK through ${name}`, () => {
    it("admits an over-budget call the user approves, and the ledger says so", async () => {
      const ledger = new MemoryLedger();
      const gov = new Governor(parsePolicy(POLICY), new MemoryBackend(), { ledger, clock: frozenClock() });
      const asked: string[] = [];
      const client = await connect(serve(gov, "yes"), YES, asked);
      assert.equal((await call(client, "search")).content[0]?.text, "ran");
      assert.deepEqual(asked, [], "a call within the budget asks nobody");
      const over = await call(client, "search");
      assert.equal(over.isError ?? false, false, JSON.stringify(over));
      assert.equal(over.content[0]?.text, "ran");
      assert.equal(asked.length, 1);
      assert.match(asked[0] ?? "", /^Budget 'asked' is spent \(budget_exceeded:user\/minute\)\. Allow this one call to 'search' to go over it\?$/);
      const admissions = ledger.entries.filter((e) => e.type === EntryType.ADMITTED);
      assert.deepEqual(
        admissions.map((e) => [e.approved ?? [], e.over]),
        [
          [[], []],
          [["asked"], ["asked"]],
        ],
      );
      assert.equal(await gov.usage("asked", context({ user: "yes" })), 2);
      await client.close();
    });

    it("refuses as usual when the user declines", async () => {
      const gov = new Governor(parsePolicy(POLICY), new MemoryBackend(), { clock: frozenClock() });
      const asked: string[] = [];
      const client = await connect(serve(gov, "no"), NO, asked);
      await call(client, "search");
      const r = await call(client, "search");
      assert.equal(r.isError, true);
      assert.match(r.content[0]?.text ?? "", /^budget_exceeded:user\/minute limit=asked status=429/);
      assert.equal(asked.length, 1);
      assert.equal(await gov.usage("asked", context({ user: "no" })), 1);
      await client.close();
    });

    it("refuses as usual when the user does not answer within approvalTimeout", async () => {
      const gov = new Governor(parsePolicy(POLICY), new MemoryBackend(), { clock: frozenClock() });
      const asked: string[] = [];
      const client = await connect(serve(gov, "silent"), "never", asked);
      await call(client, "search");
      const started = performance.now();
      const r = await call(client, "search");
      assert.equal(r.isError, true);
      assert.match(r.content[0]?.text ?? "", /limit=asked status=429/);
      assert.equal(asked.length, 1);
      assert.ok(performance.now() - started >= 250, "waited for the answer until the timeout");
      await client.close();
    });

    it("refuses as usual when the client cannot elicit", async () => {
      const gov = new Governor(parsePolicy(POLICY), new MemoryBackend(), { clock: frozenClock() });
      const client = await connect(serve(gov, "mute"), null);
      await call(client, "search");
      const r = await call(client, "search");
      assert.equal(r.isError, true);
      assert.match(r.content[0]?.text ?? "", /limit=asked status=429/);
      await client.close();
    });
  });
}

describe("the integrations' wait for a concurrency slot", () => {
  const PARALLEL = `
[[limits]]
name = "parallel"
cap = 3
unit = "concurrent"
scope = "user"
`;
  for (const wait of [0, 10]) {
    it(`20 concurrent calls against cap 3 on Redis: ${wait ? "all run, never more than 3 at once" : "3 run, the rest are refused"} (wait ${wait})`, async () => {
      const backend = RedisBackend.fromUrl(REDIS_URL, { timeout: 2 });
      const gov = new Governor(parsePolicy(PARALLEL), backend);
      const user = fresh("busy");
      const server = new McpServer({ name: "s", version: "1.0.0" });
      governTools(server, gov, { identify: () => context({ user }), wait });
      let running = 0;
      let most = 0;
      server.registerTool("slow", {}, async () => {
        most = Math.max(most, ++running);
        await new Promise((resolve) => setTimeout(resolve, 30));
        running--;
        return { content: [{ type: "text", text: "done" }] };
      });
      const client = await connect(server, null);
      const results = await Promise.all(Array.from({ length: 20 }, () => call(client, "slow")));
      const ran = results.filter((r) => !(r.isError ?? false)).length;
      assert.equal(most, 3);
      assert.equal(ran, wait ? 20 : 3);
      assert.equal(await gov.usage("parallel", context({ user })), 0, "every lease given back");
      await client.close();
      await gov.close();
    });
  }

  it("names a bad wait or approval timeout at registration", () => {
    const gov = new Governor(parsePolicy(PARALLEL), new MemoryBackend());
    const server = new McpServer({ name: "s", version: "1.0.0" });
    governTools(server, gov, { wait: -1 });
    assert.throws(
      () => server.registerTool("x", {}, async () => ({ content: [] })),
      (err: Error) => err instanceof InvalidInputError && err.field === "wait",
    );
    const other = new McpServer({ name: "s", version: "1.0.0" });
    governTools(other, gov, { approvalTimeout: 0 });
    assert.throws(
      () => other.registerTool("x", {}, async () => ({ content: [] })),
      (err: Error) => err instanceof InvalidInputError && err.field === "approval_timeout",
    );
  });
});
