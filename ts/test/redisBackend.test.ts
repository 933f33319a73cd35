// RedisBackend's own wire handling on a Redis of this file's own: a Redis without the
// scripts (a restart, SCRIPT FLUSH) answers NOSCRIPT, and the charge loads the script
// and sends the same framed command again. A private server, because flushing scripts
// on the shared one would disturb every other client: the one pytest started
// (MCPBG_TEST_OWN_REDIS_URL, tests/test_typescript.py), else a redis-server from the
// PATH on a free port, without persistence.
import assert from "node:assert/strict";
import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { after, before, describe, it } from "node:test";

import { Governor, Limit, Policy, RedisBackend, Scope, Window, context, script } from "../src/index.js";
import { OWN_REDIS_URL, freePort, frozenClock } from "./services.js";

const haveServer = OWN_REDIS_URL !== undefined || spawnSync("redis-server", ["--version"]).status === 0;

describe("RedisBackend on a Redis that lost its scripts", {
  skip: haveServer ? false : "no private Redis: set MCPBG_TEST_OWN_REDIS_URL (pytest tests/test_typescript.py does), or put redis-server on the PATH",
}, () => {
  let server: ChildProcess | undefined;
  let backend: RedisBackend;

  before(async () => {
    let url = OWN_REDIS_URL;
    if (url === undefined) {
      const port = await freePort();
      server = spawn("redis-server", ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"], {
        stdio: "ignore",
      });
      url = `redis://127.0.0.1:${port}/0`;
    }
    backend = RedisBackend.fromUrl(url, { timeout: 2 });
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
