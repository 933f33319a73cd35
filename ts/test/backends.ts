// The backends the Governor's suites run on (memory, and the Redis of services.ts),
// each opened fresh per test and closed once the test file's tests are done.
import { after } from "node:test";

import { MemoryBackend, PostgresBackend, RedisBackend, type Backend } from "../src/index.js";
import { REDIS_URL, postgresUrl } from "./services.js";

/** A function that hands back the backend it is given and closes it after the file's tests. */
export function closer(): <B extends Backend>(backend: B) => B {
  const opened: Backend[] = [];
  after(async () => {
    for (const b of opened) await b.close();
  });
  return (backend) => {
    opened.push(backend);
    return backend;
  };
}

/** Each backend by name, with a function opening a fresh one (closed by `close`). */
export function backends(close = closer()): [string, () => Backend][] {
  return [
    ["memory", () => close(new MemoryBackend())],
    ["redis", () => close(RedisBackend.fromUrl(REDIS_URL, { timeout: 2 }))],
  ];
}

/** backends() and a PostgresBackend (every setting at its default) on services.ts's database:
 * for the suites of what a store prices or holds with its admission. */
export async function backendsWithPostgres(close = closer()): Promise<[string, () => Backend][]> {
  const url = await postgresUrl();
  return [...backends(close), ["postgres", () => close(PostgresBackend.fromUrl(url))]];
}
