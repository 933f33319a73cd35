// A program reads a refusal as data: the official TypeScript SDK client reads
// status, retry_after and resets_at from a refused tool result's
// _meta["dev.mcpbg/refusal"] on every kind of refusal (429 quota, 402 spend,
// 503 breaker, 503 counters not ready, 403 unidentified), as Python's does
// (tests/test_refusal_meta.py); and an opted-in server answers a 429 with the
// JSON-RPC error of MCP's rate-limit proposal (SEP-3304, code -32023).
import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { InMemoryTransport } from "@modelcontextprotocol/sdk/inMemory.js";
import { Server } from "@modelcontextprotocol/sdk/server/index.js";
import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { CallToolRequestSchema, ListToolsRequestSchema, McpError } from "@modelcontextprotocol/sdk/types.js";

import { Governor, MemoryBackend, PostgresBackend, RATE_LIMITED, REFUSAL_META_KEY, context, parsePolicy } from "../src/index.js";
import { governTools, governedCallTool, type GovernOptions } from "../src/integrations/sdk.js";
import { frozenClock, postgresUrl } from "./services.js";

const POLICY = `
anonymous = "refuse"

[[limits]]
name = "burst"
cap = 2
window = "minute"
scope = "user"

[[limits]]
name = "user_spend"
cap_usd = "0.02"
window = "day"
scope = "user"

[[limits]]
name = "spend"
cap_usd = "0.10"
window = "day"
breaker = true
gated = false
`;

// Not the default fail mode: an OPEN limit counts locally while the counters are
// unreachable (not ready), and only a CLOSED one refuses with 503.
const CLOSED = POLICY.replace('scope = "user"\n', 'scope = "user"\nfail_mode = "closed"\n');

type Meta = Record<string, unknown>;
type Result = { isError?: boolean; content: { type: string; text?: string }[]; _meta?: Record<string, Meta> };

/** A governed McpServer whose caller is whoever `who.user` names (null: nobody). */
async function serve(governor: Governor, options: GovernOptions = {}): Promise<{ client: Client; who: { user: string | null } }> {
  const who: { user: string | null } = { user: null };
  const server = new McpServer({ name: "s", version: "1.0.0" });
  governTools(server, governor, { identify: () => (who.user === null ? null : context({ user: who.user })), ...options });
  server.registerTool("cheap", {}, async () => ({ content: [{ type: "text", text: "ok" }] }));
  server.registerTool("pricey", { _meta: { mcpbg: { cost_usd: "0.02", limit: "user_spend" } } }, async () => ({
    content: [{ type: "text", text: "ok" }],
  }));
  server.registerTool("expensive", { _meta: { mcpbg: { cost_usd: "0.10", limit: "spend" } } }, async () => ({
    content: [{ type: "text", text: "ok" }],
  }));
  const [clientSide, serverSide] = InMemoryTransport.createLinkedPair();
  const client = new Client({ name: "test-client", version: "1.0.0" });
  await Promise.all([server.connect(serverSide), client.connect(clientSide)]);
  return { client, who };
}

async function call(s: { client: Client; who: { user: string | null } }, tool: string, user: string | null): Promise<Result> {
  s.who.user = user;
  return (await s.client.callTool({ name: tool, arguments: {} })) as Result;
}

/** The refusal a program reads: the result's _meta entry (the text is beside it). */
function refusalOf(r: Result): Meta {
  assert.equal(r.isError, true, JSON.stringify(r));
  const meta = r._meta?.[REFUSAL_META_KEY];
  assert.ok(meta !== undefined, JSON.stringify(r));
  const text = r.content[0]?.text ?? "";
  assert.ok(text.startsWith(`${String(meta["reason"])} `) && text.includes(`status=${String(meta["status"])}`), text);
  return meta;
}

describe("refusals in _meta", () => {
  it("the SDK client reads status, retry_after and resets_at on every kind of refusal", async () => {
    const s = await serve(new Governor(parsePolicy(POLICY), new MemoryBackend(), { clock: frozenClock() }));
    await call(s, "cheap", "quota");
    await call(s, "cheap", "quota");
    const quota = refusalOf(await call(s, "cheap", "quota"));
    assert.deepEqual([quota["status"], quota["limit"], quota["scope"], quota["window"]], [429, "burst", "user", "minute"]);
    assert.ok(typeof quota["retry_after"] === "number" && quota["retry_after"] >= 1);
    assert.match(String(quota["resets_at"]), /^\d{4}-\d\d-\d\dT\d\d:\d\d:00Z$/);
    assert.equal((await call(s, "pricey", "spender")).isError ?? false, false); // reaches its cap
    const spent = refusalOf(await call(s, "pricey", "spender"));
    assert.deepEqual([spent["status"], spent["limit"], spent["window"], spent["retry_after"]], [402, "user_spend", "day", null]);
    assert.match(String(spent["resets_at"]), /T00:00:00Z$/);
    const nobody = refusalOf(await call(s, "cheap", null));
    assert.deepEqual([nobody["status"], nobody["error"], nobody["retry_after"], nobody["resets_at"]], [403, "caller_unidentified", null, null]);
    await call(s, "expensive", "big"); // trips the breaker
    const breaker = refusalOf(await call(s, "cheap", "anyone"));
    assert.deepEqual([breaker["status"], breaker["limit"], breaker["scope"]], [503, "spend", "global"]);
    assert.ok(typeof breaker["retry_after"] === "number" && breaker["resets_at"] !== null);
    await s.client.close();

    const strict = PostgresBackend.fromUrl(await postgresUrl(), { requireEpoch: true }); // no worker marked it ready
    try {
      const early = await serve(new Governor(parsePolicy(CLOSED), strict));
      const notReady = refusalOf(await call(early, "cheap", "early"));
      assert.deepEqual([notReady["status"], notReady["error"], notReady["resets_at"]], [503, "budget_unavailable", null]);
      assert.ok(typeof notReady["retry_after"] === "number" && notReady["retry_after"] >= 1);
      await early.client.close();
    } finally {
      await strict.close();
    }
  });

  it("an opted-in low-level server answers a 429 with the rate-limited JSON-RPC error, and nothing else", async () => {
    // McpServer turns whatever a tool handler throws into an error result, so the
    // opt-in is the low-level Server's, whose tools/call handler governedCallTool wraps.
    const governor = new Governor(parsePolicy(POLICY), new MemoryBackend(), { clock: frozenClock() });
    const who: { user: string | null } = { user: null };
    const tools = [
      { name: "cheap", inputSchema: { type: "object" as const } },
      { name: "pricey", inputSchema: { type: "object" as const }, _meta: { mcpbg: { cost_usd: "0.02", limit: "user_spend" } } },
    ];
    const server = new Server({ name: "s", version: "1.0.0" }, { capabilities: { tools: {} } });
    server.setRequestHandler(ListToolsRequestSchema, async () => ({ tools }));
    server.setRequestHandler(
      CallToolRequestSchema,
      governedCallTool(governor, async () => ({ content: [{ type: "text", text: "ok" }] }), {
        identify: () => (who.user === null ? null : context({ user: who.user })),
        meta: (name) => tools.find((t) => t.name === name)?._meta,
        rateLimitError: true,
      }),
    );
    const [clientSide, serverSide] = InMemoryTransport.createLinkedPair();
    const client = new Client({ name: "test-client", version: "1.0.0" });
    await Promise.all([server.connect(serverSide), client.connect(clientSide)]);
    const s = { client, who };
    await call(s, "cheap", "quota");
    await call(s, "cheap", "quota");
    await assert.rejects(call(s, "cheap", "quota"), (err: unknown) => {
      assert.ok(err instanceof McpError);
      assert.equal(err.code, RATE_LIMITED);
      const data = err.data as Record<string, Meta>;
      const meta = data[REFUSAL_META_KEY] as Meta;
      assert.equal(meta["status"], 429);
      assert.equal(data["retryAfterMs"], (meta["retry_after"] as number) * 1000);
      return true;
    });
    await call(s, "pricey", "spender");
    assert.equal(refusalOf(await call(s, "pricey", "spender"))["status"], 402); // a spent budget stays a result
    await client.close();
  });
});
