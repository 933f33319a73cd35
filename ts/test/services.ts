// The services the TypeScript suite talks to, found as the Python fixtures find them:
// MCPBG_TEST_REDIS_URL when pytest (tests/test_typescript.py) passes its own,
// else the local Redis on 127.0.0.1:6379 with a database of this suite's own (13).
// Tests never flush: every test uses ids of its own.
import { randomBytes } from "node:crypto";

export const REDIS_URL = process.env["MCPBG_TEST_REDIS_URL"]?.trim() || "redis://127.0.0.1:6379/13";

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
