// The services the TypeScript suite talks to, found as the Python fixtures find them:
// MCPBG_TEST_REDIS_URL, which pytest (tests/test_typescript.py) passes, or else
// `npm test` (scripts/test-services.mjs) sets to a private redis-server it starts;
// never the shared Redis on 6379.
// Tests never flush: every test uses ids of its own. pytest also passes a broker
// (MCPBG_TEST_KAFKA_BOOTSTRAP) and a private Redis (MCPBG_TEST_OWN_REDIS_URL) for the
// test that flushes its scripts; run alone, the suite has no broker, and starts a
// private redis-server when the PATH has one. Postgres: postgresUrl() below.
import { randomBytes } from "node:crypto";
import { createServer } from "node:net";

function setting(name: string): string | undefined {
  return process.env[name]?.trim() || undefined;
}

export const REDIS_URL =
  setting("MCPBG_TEST_REDIS_URL") ??
  (() => {
    throw new Error("MCPBG_TEST_REDIS_URL is not set: run the suite with `npm test`, which starts a private Redis");
  })();
export const KAFKA_BOOTSTRAP = setting("MCPBG_TEST_KAFKA_BOOTSTRAP");
export const OWN_REDIS_URL = setting("MCPBG_TEST_OWN_REDIS_URL");

/**
 * The Postgres database the PostgresBackend tests use: MCPBG_TEST_POSTGRES_URL when
 * pytest passes this run's scratch database (testing/postgres.py finds the server),
 * else a database of this suite's own on the local server (trust auth, user
 * postgres), created on first use. Tests never truncate: every test uses ids of its own.
 */
export async function postgresUrl(): Promise<string> {
  const given = setting("MCPBG_TEST_POSTGRES_URL");
  if (given !== undefined) return given;
  const { default: pg } = await import("pg");
  const admin = new pg.Client({ connectionString: "postgresql://postgres@127.0.0.1:5432/postgres" });
  await admin.connect();
  try {
    const found = await admin.query("SELECT 1 FROM pg_database WHERE datname = 'mcpbg_ts_test'");
    if (!found.rowCount) await admin.query("CREATE DATABASE mcpbg_ts_test");
  } finally {
    await admin.end();
  }
  return "postgresql://postgres@127.0.0.1:5432/mcpbg_ts_test";
}

/** A loopback port nothing listens on (yet). */
export async function freePort(): Promise<number> {
  const server = createServer();
  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen(0, "127.0.0.1", resolve);
  });
  const port = (server.address() as { port: number }).port;
  await new Promise((resolve) => server.close(resolve));
  return port;
}

/**
 * A clock stopped at the present (epoch seconds), for a Governor's `clock` option: a test's
 * calls all land in one bucket of a minute's or an hour's window however the wall clock
 * turns meanwhile, and a Redis backend (which expires keys on its own clock) sees real times.
 */
export function frozenClock(): () => number {
  const now = Date.now() / 1000;
  return () => now;
}

/** A fresh id, so tests sharing one Redis never share a counter. */
export function fresh(prefix = "t"): string {
  return `${prefix}_${randomBytes(6).toString("hex")}`;
}
