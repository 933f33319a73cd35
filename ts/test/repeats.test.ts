// The loop guard (src/repeats.ts): Python's call hash, and 10 identical calls with a repeat cap of 3.
import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { InMemoryTransport } from "@modelcontextprotocol/sdk/inMemory.js";
import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { z } from "zod";

import { Governor, InvalidInputError, Limit, MemoryBackend, callHash, canonicalJson, context, parsePolicy } from "../src/index.js";
import { governTools } from "../src/integrations/sdk.js";
import { globMatch } from "../src/policy.js";
import { VECTORS, type Json } from "./vectors.js";



describe("the call hash", () => {
  it("is Python's, vector for vector", () => {
    assert.ok((VECTORS.call_hash as Json[]).length >= 10);
    for (const v of VECTORS.call_hash as Json[]) {
      assert.equal(canonicalJson(v.arguments ?? {}), v.canonical, v.canonical);
      assert.equal(callHash(v.tool, v.arguments), v.hash, v.canonical);
    }
  });

  it("refuses what is not JSON", () => {
    assert.throws(() => canonicalJson({ x: Number.NaN }), InvalidInputError);
    assert.throws(() => canonicalJson({ x: new Set([1]) }), InvalidInputError);
  });

  it("matches tools as Python's fnmatchcase does", () => {
    assert.ok(globMatch("brave_*", "brave_web"));
    assert.ok(globMatch("b?ave_[a-z]eb", "brave_web"));
    assert.ok(!globMatch("brave_*", "Brave_web"));
    assert.ok(globMatch("a.b", "a.b") && !globMatch("a.b", "axb"));
    assert.ok(globMatch("[!x]y", "zy") && !globMatch("[!x]y", "xy"));
    assert.deepEqual(new Limit("r", { cap: 3, window: "minute", tools: "s*" }).tools, ["s*"]);
    assert.throws(() => new Limit("r", { cap: 3, window: "minute", tools: [""] }), /Limit\('r'\)\.tools/);
  });
});

describe("the loop guard", () => {
  it("admits 3 of 10 identical calls and tells the agent it is repeating itself", async () => {
    const policy = parsePolicy('[[limits]]\nname = "repeats"\ncap = 3\nwindow = "minute"\nscope = ["session", "call"]\n');
    const governor = new Governor(policy, new MemoryBackend());
    const server = new McpServer({ name: "s", version: "1.0.0" });
    governTools(server, governor, { identify: () => context({ user: "u_1", session: "s-1" }) });
    const seen: string[] = [];
    server.registerTool("search", { inputSchema: { q: z.string() } }, async ({ q }) => {
      seen.push(q);
      return { content: [{ type: "text", text: q }] };
    });
    const [clientSide, serverSide] = InMemoryTransport.createLinkedPair();
    const client = new Client({ name: "t", version: "1.0.0" });
    await Promise.all([server.connect(serverSide), client.connect(clientSide)]);
    const texts: (string | null)[] = [];
    for (let i = 0; i < 10; i++) {
      const r = (await client.callTool({ name: "search", arguments: { q: "same" } })) as Json;
      texts.push(r.isError ? r.content[0].text : null);
    }
    const other = (await client.callTool({ name: "search", arguments: { q: "other" } })) as Json;
    assert.deepEqual(texts.slice(0, 3), [null, null, null]);
    for (const t of texts.slice(3)) {
      assert.match(t ?? "", /^budget_exceeded:session\+call\/minute limit=repeats status=429 /);
      assert.match(t ?? "", /You are repeating yourself/);
    }
    assert.equal(other.isError, undefined);
    assert.deepEqual(seen, ["same", "same", "same", "other"]);
    await client.close();
  });
});
