// Runs the test command it is given with MCPBG_TEST_REDIS_URL set: the caller's own
// (pytest's tests/test_typescript.py passes this run's Redis), else a private
// redis-server on a free loopback port, started here and stopped after, as every other
// suite of the repository starts its own. Never the shared Redis on 6379.
// REDIS_SERVER names the binary (default: redis-server from the PATH).
import { spawn, spawnSync } from "node:child_process";
import { createServer } from "node:net";
import { setTimeout as sleep } from "node:timers/promises";

const [command, ...args] = process.argv.slice(2);

async function freePort() {
  const server = createServer();
  await new Promise((resolve, reject) => {
    server.once("error", reject);
    server.listen(0, "127.0.0.1", resolve);
  });
  const { port } = server.address();
  await new Promise((resolve) => server.close(resolve));
  return port;
}

async function privateRedis() {
  const binary = process.env.REDIS_SERVER || "redis-server";
  if (spawnSync(binary, ["--version"]).status !== 0) {
    console.error(
      `test-services: no ${binary} on the PATH and no MCPBG_TEST_REDIS_URL: install Redis ` +
        "(apt-get install redis-server), set REDIS_SERVER, or run the suite from pytest " +
        "(tests/test_typescript.py), which passes its own",
    );
    process.exit(2);
  }
  const port = await freePort();
  const server = spawn(
    binary,
    ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
    { stdio: "ignore" },
  );
  const url = `redis://127.0.0.1:${port}/0`;
  for (let i = 0; i < 200; i++) {  // until it answers PING (a wait, not a timing check)
    const ping = spawnSync("redis-cli", ["-p", String(port), "ping"], { encoding: "utf8" });
    if (ping.stdout?.trim() === "PONG") return { url, server };
    await sleep(50);
  }
  server.kill();
  console.error(`test-services: ${binary} did not answer on port ${port}`);
  process.exit(2);
}

const given = process.env.MCPBG_TEST_REDIS_URL?.trim();
const started = given ? null : await privateRedis();
const env = { ...process.env, MCPBG_TEST_REDIS_URL: given || started.url };
const child = spawn(command, args, { stdio: "inherit", env, shell: false });
child.on("exit", (code, signal) => {
  started?.server.kill();
  process.exit(code ?? (signal ? 1 : 0));
});
