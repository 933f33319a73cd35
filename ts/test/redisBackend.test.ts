// RedisBackend's own wire handling on a Redis of this file's own (a redis-server
// it starts on a free port, no persistence; the binary in MCPBG_TEST_REDIS_SERVER,
// which tests/test_typescript.py sets to the one its fixtures use, else redis-server
// from the PATH): a Redis without the scripts (a
// restart, SCRIPT FLUSH) answers NOSCRIPT, and the charge loads the script and
// sends the same framed command again. A private server, because flushing
// scripts on the shared one would disturb every other client.
import assert from "node:assert/strict";
import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { createServer } from "node:net";
import { after, before, describe, it } from "node:test";

import { Governor, Limit, Policy, RedisBackend, Scope, Window, context, script } from "../src/index.js";
import { frozenClock } from "./services.js";

const SERVER = process.env.MCPBG_TEST_REDIS_SERVER?.trim() || "redis-server";
const haveServer = spawnSync(SERVER, ["--version"]).status === 0;

async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.once("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const addr = srv.address();
      srv.close(() => resolve(typeof addr === "object" && addr !== null ? addr.port : 0));
    });
  });
}

describe("RedisBackend on a Redis that lost its scripts", {
  skip: haveServer ? false : `no Redis binary: ${SERVER} does not run (set MCPBG_TEST_REDIS_SERVER; pytest tests/test_typescript.py does)`,
}, () => {
  let server: ChildProcess | undefined;
  let backend: RedisBackend;

  before(async () => {
    const port = await freePort();
    server = spawn(SERVER, ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"], {
      stdio: "ignore",
    });
    backend = RedisBackend.fromUrl(`redis://127.0.0.1:${port}/0`, { timeout: 2 });
    for (let i = 0; ; i++) {
      try {
        if ((await backend.client.ping()) === "PONG") break;
      } catch (err) {
        if (i >= 100) throw err; // 100 x 50 ms: the server did not come up
        await new Promise((r) => setTimeout(r, 50));
      }
    }
  });

  after(async () => {
    await backend.close();
    server?.kill();
  });

  it("loads the script on NOSCRIPT and sends the charge again, once", async () => {
    const gov = new Governor(Policy.of(new Limit("burst", { cap: 2, window: Window.MINUTE, scope: Scope.USER })), backend, {
      clock: frozenClock(), // one minute's "burst": the third check is refused
    });
    const ctx = context({ user: "u_noscript" });
    assert.deepEqual(await backend.client.call("SCRIPT", "EXISTS", script("charge").sha), [0]);
    assert.equal((await gov.check(ctx)).admitted, true);
    await backend.client.call("SCRIPT", "FLUSH");
    assert.equal((await gov.check(ctx)).admitted, true);
    const third = await gov.check(ctx);
    assert.deepEqual([third.admitted, third.status], [false, 429]);
    assert.equal(await gov.usage("burst", ctx), 2);
  });
});
