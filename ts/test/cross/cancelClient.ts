// The TypeScript SDK client as the caller of tests/test_cancel_sweep.py: it calls tool
// "work" N times over streamable HTTP, each as its own user, aborting call i
// SPREAD_MS * i / (N - 1) ms in (the SDK sends notifications/cancelled), and pauses
// PAUSE_MS between calls so the server can give the slot back.
//
//   tsx test/cross/cancelClient.ts URL N SPREAD_MS PAUSE_MS PREFIX
//     prints one JSON line per call: {"user": "<PREFIX><i>", "cancelled": true|false}
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [url, n, spread, pause, prefix] = process.argv.slice(2) as [string, string, string, string, string];
const calls = Number(n);

async function main(): Promise<void> {
  const client = new Client({ name: "sweeper", version: "1.0.0" });
  await client.connect(new StreamableHTTPClientTransport(new URL(url)));
  for (let i = 0; i < calls; i++) {
    const user = `${prefix}${String(i).padStart(3, "0")}`;
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(new Error("cancelled by the sweep")), (Number(spread) * i) / (calls - 1));
    let cancelled = false;
    try {
      await client.callTool({ name: "work", arguments: {}, _meta: { user } }, undefined, { signal: abort.signal });
    } catch {
      cancelled = abort.signal.aborted;
    } finally {
      clearTimeout(timer);
    }
    process.stdout.write(JSON.stringify({ user, cancelled }) + "\n");
    await new Promise((resolve) => setTimeout(resolve, Number(pause)));
  }
  await client.close();
}

main().catch((err: unknown) => {
  process.stderr.write(`${String(err)}\n`);
  process.exit(1);
});
