// A governed McpServer over streamable HTTP (SDK 1.x, sessions), for tests/test_cancel_sweep.py:
// the Python sweep's clients cancel its calls at every instant of their admission.
//
//   tsx test/cross/cancelServer.ts POLICY.toml STORE_URL [BOOTSTRAP TOPIC OUTBOX]
//     STORE_URL: redis://... (RedisBackend) or postgresql://... (PostgresBackend)
//     BOOTSTRAP TOPIC OUTBOX: the events go to the KafkaLedger (test/driverLedger.ts);
//       without them the governor runs inline (no ledger)
//     prints {"port": P} once listening; the caller is the request's _meta.user;
//     tool "work" costs its _meta price and sleeps 5 ms; SIGTERM closes it.
import { randomUUID } from "node:crypto";
import { createServer, type IncomingMessage } from "node:http";

import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { StreamableHTTPServerTransport } from "@modelcontextprotocol/sdk/server/streamableHttp.js";
import { isInitializeRequest } from "@modelcontextprotocol/sdk/types.js";

import { Governor, PostgresBackend, RedisBackend, context, loadPolicyFile } from "../../src/index.js";
import { governTools } from "../../src/integrations/sdk.js";
import { driverLedger } from "../driverLedger.js";

const [policyFile, url, bootstrap, topic, outbox] = process.argv.slice(2) as [string, string, ...string[]];
const backend = url.startsWith("postgres") ? PostgresBackend.fromUrl(url) : RedisBackend.fromUrl(url);
const ledger =
  bootstrap !== undefined && topic !== undefined && outbox !== undefined
    ? driverLedger(bootstrap, topic, outbox, 25)
    : null;
const governor = new Governor(loadPolicyFile(policyFile), backend, { ledger });

function mcpServer(): McpServer {
  const server = new McpServer({ name: "swept", version: "1.0.0" });
  governTools(server, governor, {
    identify: (extra) => {
      const user = (extra as { _meta?: { user?: unknown } })._meta?.user;
      return typeof user === "string" ? context({ user }) : null;
    },
  });
  server.registerTool("work", { _meta: { mcpbg: { cost_usd: "0.01", limit: "spend" } } }, async () => {
    await new Promise((resolve) => setTimeout(resolve, 5));
    return { content: [{ type: "text", text: "done" }] };
  });
  return server;
}

const sessions = new Map<string, StreamableHTTPServerTransport>();

async function body(req: IncomingMessage): Promise<unknown> {
  const chunks: Buffer[] = [];
  for await (const chunk of req) chunks.push(chunk as Buffer);
  return chunks.length ? JSON.parse(Buffer.concat(chunks).toString("utf8")) : undefined;
}

const http = createServer((req, res) => {
  void (async () => {
    const parsed = req.method === "POST" ? await body(req) : undefined;
    const id = req.headers["mcp-session-id"];
    let transport = typeof id === "string" ? sessions.get(id) : undefined;
    if (transport === undefined && isInitializeRequest(parsed)) {
      const fresh = new StreamableHTTPServerTransport({
        sessionIdGenerator: () => randomUUID(),
        onsessioninitialized: (sid) => void sessions.set(sid, fresh),
      });
      fresh.onclose = () => {
        if (fresh.sessionId !== undefined) sessions.delete(fresh.sessionId);
      };
      await mcpServer().connect(fresh);
      transport = fresh;
    }
    if (transport === undefined) {
      res.writeHead(400).end("no session");
      return;
    }
    await transport.handleRequest(req, res, parsed);
  })().catch((err: unknown) => {
    process.stderr.write(`${String(err)}\n`);
    if (!res.headersSent) res.writeHead(500).end();
  });
});

http.listen(0, "127.0.0.1", () => {
  const address = http.address();
  process.stdout.write(JSON.stringify({ port: typeof address === "object" && address ? address.port : 0 }) + "\n");
});

process.on("SIGTERM", () => {
  http.close();
  void governor.close().finally(() => process.exit(0));
});
