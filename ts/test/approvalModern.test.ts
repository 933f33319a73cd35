// OnExceed.ASK for clients on the 2026-07-28 protocol (SDK 2.x: @modelcontextprotocol/server
// and /client), which has no back-channel: the question is the call's `input_required`
// result (SEP-2322), and the retry carrying the answer is admitted over the limit
// (Python: tests/test_approval.py, test_a_modern_client_*). Real clients and servers,
// the modern one over the SDK's HTTP handler (in process, no socket).
import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { Client, InMemoryTransport as ClientMemoryTransport, StreamableHTTPClientTransport } from "@modelcontextprotocol/client";
import { InMemoryTransport, McpServer, createMcpHandler } from "@modelcontextprotocol/server";

import { EntryType, Governor, InvalidInputError, MemoryBackend, MemoryLedger, context, parsePolicy, refusalText } from "../src/index.js";
import { APPROVAL_REQUEST, approvalSeal, governTools } from "../src/integrations/sdk.js";
import { fresh } from "./services.js";

const POLICY = `
[[limits]]
name = "daily"
cap = 1
window = "day"
scope = "user"
on_exceed = "ask"
`;

type Result = { isError?: boolean; content: { type: string; text?: string }[] };
type Answer = { action: "accept" | "decline" | "cancel"; content?: Record<string, string | number | boolean | string[]> };

/** A server factory (createMcpHandler makes one server per request); `key`: the seal's, else the default. */
function governed(user: string, key?: string): { gov: Governor; ledger: MemoryLedger; server: () => McpServer } {
  const ledger = new MemoryLedger();
  const gov = new Governor(parsePolicy(POLICY), new MemoryBackend(), { ledger });
  const server = (): McpServer => {
    const s = new McpServer({ name: "asking", version: "1.0.0" });
    governTools(s, gov, { identify: () => context({ user }), ...(key !== undefined && { approvalSeal: approvalSeal(key) }) });
    s.registerTool("search", { description: "search" }, async () => ({ content: [{ type: "text", text: "results" }] }));
    return s;
  };
  return { gov, ledger, server };
}

/** A 2026-07-28 client of `server` (a fresh server per request, as createMcpHandler serves) answering with `answer`. */
async function modernClient(server: () => McpServer, answer: Answer | null, asked: string[]): Promise<Client> {
  const handler = createMcpHandler(server);
  const fetch = (url: string | URL, init?: RequestInit): Promise<Response> => handler.fetch(new Request(url, init));
  const transport = new StreamableHTTPClientTransport(new URL("http://localhost/mcp"), { fetch });
  const client = new Client(
    { name: "modern", version: "1.0.0" },
    { capabilities: answer === null ? {} : { elicitation: { form: {} } }, versionNegotiation: { mode: { pin: "2026-07-28" } } },
  );
  if (answer !== null) {
    client.setRequestHandler("elicitation/create", async (request) => {
      asked.push(request.params.message);
      return answer;
    });
  }
  await client.connect(transport);
  return client;
}

async function call(client: Client): Promise<Result> {
  return (await client.callTool({ name: "search", arguments: {} })) as Result;
}

describe("OnExceed.ASK on the 2026-07-28 protocol (SDK 2.x)", () => {
  it("a modern client is asked in the next round and admitted", async () => {
    const user = fresh("ana");
    const { gov, ledger, server } = governed(user);
    const asked: string[] = [];
    const client = await modernClient(server, { action: "accept", content: { value: true } }, asked);
    assert.equal((await call(client)).isError, undefined);
    const result = await call(client);
    assert.equal(result.isError, undefined, JSON.stringify(result));
    assert.equal(result.content[0]?.text, "results");
    assert.deepEqual(asked, ["Budget 'daily' is spent (budget_exceeded:user/day). Allow this one call to 'search' to go over it?"]);
    assert.equal(await gov.usage("daily", context({ user })), 2);
    assert.deepEqual(
      ledger.entries.map((e) => [e.type, e.approved]),
      [
        [EntryType.ADMITTED, []],
        [EntryType.REJECTED, []], // the refusal that asked
        [EntryType.ADMITTED, ["daily"]],
      ],
    );
    await client.close();
  });

  for (const answer of [{ action: "decline" }, { action: "accept", content: { value: false } }] as Answer[]) {
    it(`a modern client that answers ${JSON.stringify(answer)} is refused`, async () => {
      const user = fresh("ana");
      const { gov, server } = governed(user);
      const asked: string[] = [];
      const client = await modernClient(server, answer, asked);
      await call(client);
      const refused = await call(client);
      assert.equal(refused.isError, true);
      assert.match(refused.content[0]?.text ?? "", /^budget_exceeded:user\/day/);
      assert.equal(asked.length, 1);
      assert.equal(await gov.usage("daily", context({ user })), 1);
      await client.close();
    });
  }

  it("a modern client that cannot elicit gets the normal refusal, unasked", async () => {
    const user = fresh("ana");
    const { gov, ledger, server } = governed(user);
    const client = await modernClient(server, null, []);
    await call(client);
    const refused = await call(client);
    assert.equal(refused.isError, true);
    const decision = await gov.check(context({ user, tool: "search" }));
    assert.equal(refused.content[0]?.text?.split(" ")[0], refusalText(decision).split(" ")[0]);
    assert.deepEqual(
      ledger.entries.map((e) => e.type),
      [EntryType.ADMITTED, EntryType.REJECTED, EntryType.REJECTED],
    );
    await client.close();
  });

  it("the question is Python's input_required result: the elicitation under mcpbg_approval, the limit sealed", async () => {
    const user = fresh("ana");
    const { server } = governed(user, "a key every replica shares, 32+ bytes");
    const handler = createMcpHandler(server);
    const envelope = {
      "io.modelcontextprotocol/protocolVersion": "2026-07-28",
      "io.modelcontextprotocol/clientInfo": { name: "raw", version: "1" },
      "io.modelcontextprotocol/clientCapabilities": { elicitation: { form: {} } },
    };
    const post = async (id: number, params: Record<string, unknown>): Promise<Record<string, unknown>> => {
      const response = await handler.fetch(
        new Request("http://localhost/mcp", {
          method: "POST",
          headers: { "content-type": "application/json", accept: "application/json, text/event-stream", "mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call", "mcp-name": "search" },
          body: JSON.stringify({ jsonrpc: "2.0", id, method: "tools/call", params: { name: "search", arguments: {}, _meta: envelope, ...params } }),
        }),
      );
      const text = await response.text();
      const line = text.split("\n").find((l) => l.startsWith("data:"));
      const body = JSON.parse(line === undefined ? text : line.slice(5)) as { result?: Record<string, unknown>; error?: unknown };
      assert.ok(body.result, `no result: ${text}`);
      return body.result;
    };
    await post(1, {});
    const question = await post(2, {});
    const state = question["requestState"];
    assert.equal(typeof state, "string");
    assert.doesNotMatch(String(state), /^daily$/, "the limit is sealed, not in clear");
    // Python (mcp_types.InputRequiredResult, by alias): the same question, word for word.
    assert.deepEqual(
      { ...question, requestState: "<sealed>", _meta: undefined },
      {
        resultType: "input_required",
        inputRequests: {
          [APPROVAL_REQUEST]: {
            method: "elicitation/create",
            params: {
              mode: "form",
              message: "Budget 'daily' is spent (budget_exceeded:user/day). Allow this one call to 'search' to go over it?",
              requestedSchema: { type: "object", properties: { value: { type: "boolean", title: "Go over budget" } }, required: ["value"] },
            },
          },
        },
        requestState: "<sealed>",
        _meta: undefined,
      },
    );
    const yes = { [APPROVAL_REQUEST]: { action: "accept", content: { value: true } } };
    // A state the server never sealed approves nothing: the client is asked (again).
    const forged = await post(3, { inputResponses: yes, requestState: "daily" });
    assert.equal(forged["resultType"], "input_required");
    // The sealed one, answered yes: admitted over the limit.
    const admitted = await post(4, { inputResponses: yes, requestState: state });
    assert.deepEqual(admitted["content"], [{ type: "text", text: "results" }]);
  });

  it("a handshake-era SDK 2.x client is asked over its back-channel (ctx.mcpReq.elicitInput)", async () => {
    const user = fresh("ana");
    const { gov, ledger, server } = governed(user);
    const asked: string[] = [];
    const [clientSide, serverSide] = InMemoryTransport.createLinkedPair();
    const client = new Client({ name: "legacy", version: "1.0.0" }, { capabilities: { elicitation: { form: {} } } });
    client.setRequestHandler("elicitation/create", async (request) => {
      asked.push(request.params.message);
      return { action: "accept", content: { value: true } };
    });
    await Promise.all([server().connect(serverSide), client.connect(clientSide as unknown as ClientMemoryTransport)]);
    await call(client);
    const result = await call(client);
    assert.equal(result.isError, undefined, JSON.stringify(result));
    assert.equal(asked.length, 1);
    assert.equal(await gov.usage("daily", context({ user })), 2);
    assert.deepEqual(
      ledger.entries.map((e) => [e.type, e.approved]),
      [
        [EntryType.ADMITTED, []],
        [EntryType.REJECTED, []],
        [EntryType.ADMITTED, ["daily"]],
      ],
    );
    await client.close();
  });
});

describe("approvalSeal", () => {
  it("opens only what it sealed, for the same caller and tool", () => {
    const seal = approvalSeal("k".repeat(32));
    const ana = context({ user: "ana", tool: "search" });
    const state = seal.seal("daily", ana);
    assert.equal(seal.open(state, ana), "daily");
    assert.equal(seal.open(state, context({ user: "bo", tool: "search" })), null);
    assert.equal(seal.open(state, context({ user: "ana", tool: "fetch" })), null);
    assert.equal(approvalSeal("j".repeat(32)).open(state, ana), null);
    assert.equal(seal.open("daily", ana), null);
    assert.equal(seal.open(undefined, ana), null);
    assert.throws(() => approvalSeal("short"), (err: Error) => err instanceof InvalidInputError && /approval_key/.test(err.message));
  });
});
