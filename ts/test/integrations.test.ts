// The MCP middleware with real in-process clients of each SDK: check before,
// meter after, the tool's name as Context.tool, identify, _meta.mcpbg prices,
// and refusals with the Python middleware's text and status (from the vectors).
import assert from "node:assert/strict";
import { after, describe, it } from "node:test";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { InMemoryTransport } from "@modelcontextprotocol/sdk/inMemory.js";
import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { Server } from "@modelcontextprotocol/sdk/server/index.js";
import { CallToolRequestSchema, ListToolsRequestSchema } from "@modelcontextprotocol/sdk/types.js";
import { FastMCP } from "fastmcp";
import { z } from "zod";

import { Governor, MemoryBackend, REFUSAL_META_KEY, context, parsePolicy, refusalText, type Context } from "../src/index.js";
import { governFastMCP } from "../src/integrations/fastmcp.js";
import { governTools, governedCallTool } from "../src/integrations/sdk.js";
import { frozenClock } from "./services.js";
import { VECTORS } from "./vectors.js";

const POLICY = `
[[limits]]
name = "burst"
cap = 2
window = "minute"
scope = "user"

[[limits]]
name = "per_tool"
cap = 100
window = "day"
scope = ["user", "tool"]

[[limits]]
name = "spend"
cap_usd = "0.025"
window = "day"
scope = "user"
`;

type Result = { isError?: boolean; content: { type: string; text?: string }[]; structuredContent?: Record<string, Json> };
// eslint-disable-next-line @typescript-eslint/no-explicit-any
type Json = any;

const sessions: { close(): Promise<void> }[] = [];
after(async () => {
  for (const s of sessions) await s.close();
});

async function connect(server: { connect(t: InMemoryTransport): Promise<unknown> }): Promise<Client> {
  const [clientSide, serverSide] = InMemoryTransport.createLinkedPair();
  const client = new Client({ name: "test-client", version: "1.0.0" });
  const [session] = await Promise.all([server.connect(serverSide), client.connect(clientSide)]);
  if (session && typeof (session as { close?: unknown }).close === "function") sessions.push(session as { close(): Promise<void> });
  return client;
}

const fastOptions = { name: "s", version: "1.0.0", ping: { enabled: false }, roots: { enabled: false } } as const;

async function call(client: Client, name: string, args: Record<string, unknown> = {}): Promise<Result> {
  return (await client.callTool({ name, arguments: args })) as Result;
}

/** Three calls of a priced tool by one user: the third refused by the spend cap (402). */
async function exercise(client: Client, governor: Governor, user: string): Promise<void> {
  const ctx: Context = context({ user });
  const first = await call(client, "search", { q: "a" });
  assert.equal(first.isError ?? false, false, JSON.stringify(first));
  assert.equal(first.content[0]?.text, "found a");
  assert.equal(await governor.usage("spend", ctx), 10_000); // _meta.mcpbg cost_usd 0.01, metered after
  assert.equal(await governor.usage("per_tool", context({ user, tool: "search" })), 1);
  await call(client, "search", { q: "b" });
  const third = await call(client, "search", { q: "c" });
  assert.equal(third.isError, true);
  const text = third.content[0]?.text ?? "";
  // Rate limited by burst (2 per minute) before spend: the Python middleware's wording.
  const burst = VECTORS.refusals.find((r: Json) => r.name === "refused:burst");
  assert.equal(text.split(" ")[0], burst.reason);
  assert.match(text, /^budget_exceeded:user\/minute limit=burst status=429 retry_after=\d+s resets_at=\S+\. Rate limited by limit 'burst'\. Do not call again for \d+ seconds \(at \S+\); calls before then are refused too\.$/);
  assert.equal(await governor.usage("burst", ctx), 2);
  assert.equal(await governor.usage("spend", ctx), 20_000); // the refused call charged nothing
}

function governorOf(): Governor {
  // Frozen: "burst" is a minute's, and its refusal must not meet a turning minute.
  return new Governor(parsePolicy(POLICY), new MemoryBackend(), { clock: frozenClock() });
}

describe("@modelcontextprotocol/sdk McpServer", () => {
  it("checks before, meters after, prices from _meta.mcpbg, refuses as Python does", async () => {
    const governor = governorOf();
    const server = new McpServer({ name: "s", version: "1.0.0" });
    governTools(server, governor, { identify: () => context({ user: "sdk_user" }) });
    server.registerTool(
      "search",
      { inputSchema: { q: z.string() }, _meta: { mcpbg: { cost_usd: "0.01", limit: "spend" } } },
      async ({ q }) => ({ content: [{ type: "text", text: `found ${q}` }] }),
    );
    const client = await connect(server);
    await exercise(client, governor, "sdk_user");
    await client.close();
  });

  it("refuses an unidentified caller with 403 when a limit counts per user", async () => {
    const governor = governorOf();
    const server = new McpServer({ name: "s", version: "1.0.0" });
    governTools(server, governor);
    server.registerTool("search", {}, async () => ({ content: [{ type: "text", text: "ran" }] }));
    const client = await connect(server);
    const r = await call(client, "search");
    assert.equal(r.isError, true);
    const want = VECTORS.refusals.find((v: Json) => v.name === "caller_unidentified");
    assert.equal(r.content[0]?.text, want.text);
    assert.equal(r.structuredContent?.["mcpbg"]?.status, 403);
    await client.close();
  });

  it("a spent budget refuses with 402 and the text Python gives", async () => {
    const governor = new Governor(parsePolicy(POLICY.slice(POLICY.indexOf('[[limits]]\nname = "spend"'))), new MemoryBackend());
    const server = new McpServer({ name: "s", version: "1.0.0" });
    governTools(server, governor, { identify: () => context({ user: "spender" }) });
    server.registerTool("pricey", { _meta: { mcpbg: { cost_usd: "0.02", limit: "spend" } } }, async () => ({
      content: [{ type: "text", text: "ok" }],
    }));
    const client = await connect(server);
    await call(client, "pricey");
    await call(client, "pricey"); // 0.04 > 0.025: admitted (room at check), charged past the cap
    const r = await call(client, "pricey");
    assert.equal(r.isError, true);
    const body = r.structuredContent?.["mcpbg"];
    assert.equal(body.status, 402);
    assert.equal(body.retry_after, null);
    assert.equal(r.content[0]?.text, body.message);
    assert.match(body.message, /^budget_exceeded:user\/day limit=spend status=402 resets_at=\S+\. Refused by limit 'spend': this budget is spent until \S+\. Do not retry before then; report this to the user instead\.$/);
    await client.close();
  });
});

describe("@modelcontextprotocol/sdk low-level Server", () => {
  it("governs the tools/call handler", async () => {
    const governor = governorOf();
    const tools = [{ name: "search", inputSchema: { type: "object" as const }, _meta: { mcpbg: { cost_usd: "0.01", limit: "spend" } } }];
    const server = new Server({ name: "s", version: "1.0.0" }, { capabilities: { tools: {} } });
    server.setRequestHandler(ListToolsRequestSchema, async () => ({ tools }));
    server.setRequestHandler(
      CallToolRequestSchema,
      governedCallTool(
        governor,
        async (request) => ({ content: [{ type: "text", text: `found ${String(request.params.arguments?.["q"])}` }] }),
        { identify: () => context({ user: "low_user" }), meta: (name) => tools.find((t) => t.name === name)?._meta },
      ),
    );
    const client = await connect(server);
    await exercise(client, governor, "low_user");
    await client.close();
  });
});

describe("fastmcp", () => {
  it("checks before, meters after, prices from _meta.mcpbg, refuses with the Python text", async () => {
    const governor = governorOf();
    const server = new FastMCP(fastOptions);
    governFastMCP(server, governor, { identify: () => context({ user: "fast_user" }) });
    server.addTool({
      name: "search",
      parameters: z.object({ q: z.string() }),
      _meta: { mcpbg: { cost_usd: "0.01", limit: "spend" } },
      execute: async ({ q }) => `found ${q}`,
    });
    const client = await connect(server);
    await exercise(client, governor, "fast_user");
    await client.close();
  });

  it("the refusal text is refusalText(decision), as Python's BudgetToolError says", async () => {
    const governor = governorOf();
    const server = new FastMCP(fastOptions);
    governFastMCP(server, governor, { identify: () => context({ user: "fast2" }) });
    server.addTool({ name: "ping", execute: async () => "pong" });
    const client = await connect(server);
    await call(client, "ping");
    await call(client, "ping");
    const r = await call(client, "ping");
    const d = await governor.check(context({ user: "fast2", tool: "ping" }));
    assert.equal(r.isError, true);
    assert.equal(r.content[0]?.text?.split(". ")[0]?.replace(/retry_after=\d+s/, ""), refusalText(d).split(". ")[0]?.replace(/retry_after=\d+s/, ""));
    // The refusal as data beside the text, as Python's FastMCP middleware gives it.
    const meta = (r as Result & { _meta?: Record<string, Json> })._meta?.[REFUSAL_META_KEY];
    assert.deepEqual([meta?.status, meta?.limit, meta?.scope, meta?.window], [429, "burst", "user", "minute"]);
    assert.ok(meta?.retry_after >= 1 && typeof meta?.resets_at === "string");
    await client.close();
  });
});
