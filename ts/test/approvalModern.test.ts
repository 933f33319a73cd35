// OnExceed.ASK for clients on the 2026-07-28 protocol (SDK 2.x: @modelcontextprotocol/server
// and /client), which has no back-channel: the question is the call's `input_required`
// result (SEP-2322), and the retry carrying the answer is admitted over the limit
// (Python: tests/test_approval.py, test_a_modern_client_*). Real clients and servers,
// the modern one over the SDK's HTTP handler (in process, no socket).
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { describe, it } from "node:test";

import { Client, InMemoryTransport as ClientMemoryTransport, StreamableHTTPClientTransport } from "@modelcontextprotocol/client";
import { InMemoryTransport, McpServer, createMcpHandler } from "@modelcontextprotocol/server";

import { Redis } from "ioredis";

import {
  BackendUnavailableError,
  EntryType,
  Governor,
  InvalidInputError,
  MemoryBackend,
  MemoryLedger,
  RedisBackend,
  context,
  parsePolicy,
  refusalText,
  type Backend,
  type Context,
} from "../src/index.js";
import { openApproval } from "../src/approval.js";
import { APPROVAL_REQUEST, approvalSeal, governTools } from "../src/integrations/sdk.js";
import { APPROVAL_KEY } from "../src/keys.js";
import { closer } from "./backends.js";
import { REDIS_URL, fresh } from "./services.js";

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

/**
 * A server factory (createMcpHandler makes one server per request); `key`: the
 * seal's, else the default; `backend`: the counters' (default a MemoryBackend).
 */
function governed(user: string, key?: string, backend: Backend = new MemoryBackend()): { gov: Governor; ledger: MemoryLedger; server: () => McpServer } {
  const ledger = new MemoryLedger();
  const gov = new Governor(parsePolicy(POLICY), backend, { ledger });
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

const ENVELOPE = {
  "io.modelcontextprotocol/protocolVersion": "2026-07-28",
  "io.modelcontextprotocol/clientInfo": { name: "raw", version: "1" },
  "io.modelcontextprotocol/clientCapabilities": { elicitation: { form: {} } },
};

/** A raw 2026-07-28 tools/call of "search" to `server` (its JSON-RPC result), so a test picks the replica of each round. */
function poster(server: () => McpServer): (params?: Record<string, unknown>) => Promise<Record<string, unknown>> {
  const handler = createMcpHandler(server);
  let id = 0;
  return async (params = {}) => {
    const response = await handler.fetch(
      new Request("http://localhost/mcp", {
        method: "POST",
        headers: { "content-type": "application/json", accept: "application/json, text/event-stream", "mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call", "mcp-name": "search" },
        body: JSON.stringify({ jsonrpc: "2.0", id: ++id, method: "tools/call", params: { name: "search", arguments: {}, _meta: ENVELOPE, ...params } }),
      }),
    );
    const text = await response.text();
    const line = text.split("\n").find((l) => l.startsWith("data:"));
    const body = JSON.parse(line === undefined ? text : line.slice(5)) as { result?: Record<string, unknown>; error?: unknown };
    assert.ok(body.result, `no result: ${text}`);
    return body.result;
  };
}

const YES = { [APPROVAL_REQUEST]: { action: "accept", content: { value: true } } };

/** The limit an opened state's approval text names for `caller`, else null. */
function limitOf(text: string | null, caller: Context): string | null {
  return text === null ? null : (openApproval(text, caller, Date.now() / 1000)?.limit ?? null);
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
    const post = poster(server);
    await post();
    const question = await post();
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
    // A state the server never sealed approves nothing: the answer gets the usual refusal.
    const forged = await post({ inputResponses: YES, requestState: "daily" });
    assert.equal(forged["isError"], true, JSON.stringify(forged));
    // The sealed one, answered yes: admitted over the limit.
    const admitted = await post({ inputResponses: YES, requestState: state });
    assert.deepEqual(admitted["content"], [{ type: "text", text: "results" }]);
  });

  it("an approval is spent once, by its caller: reused or presented by another caller, the usual refusal", async () => {
    const [ana, bob] = [fresh("ana"), fresh("bob")];
    let user = ana;
    const ledger = new MemoryLedger();
    const gov = new Governor(parsePolicy(POLICY), new MemoryBackend(), { ledger });
    const server = (): McpServer => {
      const s = new McpServer({ name: "asking", version: "1.0.0" });
      governTools(s, gov, { identify: () => context({ user }) });
      s.registerTool("search", { description: "search" }, async () => ({ content: [{ type: "text", text: "results" }] }));
      return s;
    };
    const post = poster(server);
    assert.deepEqual((await post())["content"], RESULTS); // Ana's one call
    user = bob;
    assert.deepEqual((await post())["content"], RESULTS); // Bob's one call
    user = ana;
    const state = await questionState(post);
    user = bob; // Bob presents Ana's approval: his own cap refuses
    const stolen = await post({ inputResponses: YES, requestState: state });
    assert.equal(stolen["isError"], true, JSON.stringify(stolen));
    user = ana;
    assert.deepEqual((await post({ inputResponses: YES, requestState: state }))["content"], RESULTS);
    const again = await Promise.all([0, 1, 2].map(() => post({ inputResponses: YES, requestState: state })));
    for (const refused of again) {
      assert.equal(refused["isError"], true, JSON.stringify(refused));
      assert.match((refused["content"] as Result["content"])[0]?.text ?? "", /^budget_exceeded:user\/day/);
    }
    assert.equal(await gov.usage("daily", context({ user: ana })), 2);
    assert.equal(await gov.usage("daily", context({ user: bob })), 1);
    const approved = ledger.entries.filter((e) => e.approved?.length);
    assert.deepEqual(approved.map((e) => [e.type, e.approved, e.context.user]), [[EntryType.ADMITTED, ["daily"], ana]]);
  });

  it("the governor spends an approval with the admission, once, on Redis too", async () => {
    for (const backend of [new MemoryBackend(), redisBackend()]) {
      const user = fresh("ana");
      const ledger = new MemoryLedger();
      const gov = new Governor(parsePolicy(POLICY), backend, { ledger });
      const ana = context({ user });
      const until = Math.floor(Date.now() / 1000) + 60;
      const approval = { limit: "daily", once: randomBytes(16).toString("hex"), until };
      assert.equal((await gov.check(ana)).admitted, true);
      assert.equal((await gov.check(ana, { approved: ["daily"], approval })).admitted, true);
      // Its event names the one-time id: the projection marks it spent (Python: events.Spent).
      assert.deepEqual(ledger.entries.at(-1)?.spent, [approval]);
      const refused = await gov.check(ana, { approved: ["daily"], approval });
      assert.deepEqual([refused.admitted, refused.limit, refused.status], [false, "daily", 429]);
      const lapsed = { ...approval, once: randomBytes(16).toString("hex"), until: until - 61 };
      assert.equal((await gov.check(ana, { approved: ["daily"], approval: lapsed })).admitted, false);
      assert.equal(await gov.usage("daily", ana), 2);
    }
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

const close = closer();

/** A RedisBackend of its own (a replica's), on the suite's Redis; `keyPrefix`: a Redis of its own within it. */
function redisBackend(keyPrefix = ""): RedisBackend {
  return close(RedisBackend.fromUrl(REDIS_URL, { timeout: 2, redis: { keyPrefix } }));
}

/** The state of the question `post` gets once the user's one call a day is spent. */
async function questionState(post: ReturnType<typeof poster>): Promise<string> {
  const question = await post();
  assert.equal(question["resultType"], "input_required", JSON.stringify(question));
  return question["requestState"] as string;
}

const RESULTS = [{ type: "text", text: "results" }];

describe("the default approval seal across replicas", () => {
  it("replicas on one Redis share it: a question replica A asked is approved on replica B", async () => {
    const user = fresh("ana");
    const a = governed(user, undefined, redisBackend());
    const b = governed(user, undefined, redisBackend());
    const [postA, postB] = [poster(a.server), poster(b.server)];
    assert.deepEqual((await postA())["content"], RESULTS);
    const state = await questionState(postA);
    const admitted = await postB({ inputResponses: YES, requestState: state });
    assert.deepEqual(admitted["content"], RESULTS, JSON.stringify(admitted));
    assert.deepEqual(b.ledger.entries.map((e) => [e.type, e.approved]), [[EntryType.ADMITTED, ["daily"]]]);
    assert.equal(await a.gov.usage("daily", context({ user })), 2);
    // The key is the one in Redis, not this process's own (which both replicas here would share).
    const redis = new Redis(REDIS_URL);
    const stored = Buffer.from((await redis.get(APPROVAL_KEY)) ?? "", "hex");
    await redis.quit();
    const caller = context({ user, tool: "search" });
    assert.equal(limitOf(approvalSeal(stored).open(state, caller), caller), "daily");
    assert.equal(approvalSeal().open(state, caller), null);
  });

  it("a question sealed on another Redis, or with an explicit key, approves nothing there", async () => {
    const user = fresh("ana");
    const a = governed(user, undefined, redisBackend());
    const other = governed(user, undefined, redisBackend(`${fresh("other")}:`)); // its own keys: another Redis
    const keyed = governed(user, "k".repeat(32), redisBackend());
    const keyedToo = governed(user, "k".repeat(32), redisBackend());
    const [postA, postOther, postKeyed, postKeyedToo] = [a, other, keyed, keyedToo].map((r) => poster(r.server)) as [
      ReturnType<typeof poster>,
      ReturnType<typeof poster>,
      ReturnType<typeof poster>,
      ReturnType<typeof poster>,
    ];
    await postA(); // the day's call, on the one Redis a, keyed and keyedToo share
    await postOther(); // and on the other Redis
    for (const state of [await questionState(postOther), await questionState(postKeyed)]) {
      const again = await postA({ inputResponses: YES, requestState: state });
      assert.equal(again["isError"], true, "not admitted: the usual refusal");
    }
    assert.equal(await a.gov.usage("daily", context({ user })), 1);
    // An explicit key wins over the shared one: what one keyed replica sealed, another opens.
    const state = await questionState(postKeyed);
    const caller = context({ user, tool: "search" });
    assert.equal(limitOf(approvalSeal("k".repeat(32)).open(state, caller), caller), "daily");
    assert.deepEqual((await postKeyedToo({ inputResponses: YES, requestState: state }))["content"], RESULTS);
  });

  it("a key Redis lost and another replica replaced is read again", async () => {
    const user = fresh("ana");
    const prefix = `${fresh("flushed")}:`; // a Redis of this test's own, to flush
    const a = governed(user, undefined, redisBackend(prefix));
    const postA = poster(a.server);
    await postA();
    await questionState(postA); // a has read the first key
    const redis = new Redis(REDIS_URL);
    const first = await redis.get(prefix + APPROVAL_KEY);
    assert.equal(await redis.del(prefix + APPROVAL_KEY), 1);
    const c = governed(user, undefined, redisBackend(prefix)); // sets a new key
    const state = await questionState(poster(c.server));
    const second = await redis.get(prefix + APPROVAL_KEY);
    assert.notEqual(first, second);
    assert.deepEqual((await postA({ inputResponses: YES, requestState: state }))["content"], RESULTS);
    await redis.del(prefix + APPROVAL_KEY);
    await redis.quit();
  });

  it("on a MemoryBackend the key is the process's: two servers of one process share it", async () => {
    const user = fresh("ana");
    const a = governed(user);
    const b = governed(user);
    const [postA, postB] = [poster(a.server), poster(b.server)];
    await postA();
    await postB();
    const state = await questionState(postA);
    const caller = context({ user, tool: "search" });
    assert.equal(limitOf(approvalSeal().open(state, caller), caller), "daily");
    assert.deepEqual((await postB({ inputResponses: YES, requestState: state }))["content"], RESULTS);
  });

  it("a key that cannot be read refuses the call the normal way: no question, no error", async () => {
    class NoKey extends MemoryBackend {
      approvalKey(): Promise<Uint8Array> {
        return Promise.reject(new BackendUnavailableError("redis unreachable: connect ECONNREFUSED"));
      }
    }
    const user = fresh("ana");
    const { gov, ledger, server } = governed(user, undefined, new NoKey());
    const post = poster(server);
    await post();
    const validElsewhere = approvalSeal().seal("daily", context({ user, tool: "search" }));
    for (const params of [{}, { inputResponses: YES, requestState: validElsewhere }]) {
      const refused = await post(params);
      assert.equal(refused["isError"], true, JSON.stringify(refused));
      assert.match((refused["content"] as Result["content"])[0]?.text ?? "", /^budget_exceeded:user\/day/);
    }
    assert.equal(await gov.usage("daily", context({ user })), 1);
    assert.deepEqual(ledger.entries.map((e) => e.type), [EntryType.ADMITTED, EntryType.REJECTED, EntryType.REJECTED]);
  });

  it("reads the key once per backend, whatever the servers a per-request factory makes", async () => {
    let reads = 0;
    class Counted extends MemoryBackend {
      approvalKey(): Promise<Uint8Array> {
        reads++;
        return Promise.resolve(Buffer.alloc(32, 7));
      }
    }
    const user = fresh("ana");
    const { server } = governed(user, undefined, new Counted());
    const post = poster(server);
    await post();
    const state = await questionState(post);
    assert.deepEqual((await post({ inputResponses: YES, requestState: state }))["content"], RESULTS);
    assert.equal(reads, 1);
  });
});
