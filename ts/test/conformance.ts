// The checks of the key scheme against the vectors, parameterised by the key
// builder, so a test can run them with a patched separator and see them fail.
import { scopeValues } from "../src/context.js";
import { escape, KeyBuilder } from "../src/keys.js";
import { Limit, Policy } from "../src/policy.js";
import { bucketFor } from "../src/windows.js";
import { ctxOf, limitOptions, VECTORS, type Json } from "./vectors.js";

/** Every mismatch between the key vectors and what `keys` builds (empty: conformant). */
export function keyMismatches(keys: KeyBuilder, vectors: Json = VECTORS): string[] {
  const out: string[] = [];
  const contexts = vectors.contexts.map(ctxOf);
  const limits = new Map<string, Limit>(vectors.limits.map((l: Json) => [l.name, new Limit(l.name, limitOptions(l))]));
  const policies = new Map<string | null, Policy>();
  for (const v of vectors.keys as Json[]) {
    let policy = policies.get(v.tz);
    if (policy === undefined) {
      policy = new Policy([...limits.values()], { timezone: v.tz });
      policies.set(v.tz, policy);
    }
    const limit = policy.get(v.limit);
    const values = scopeValues(limit.dimensions, contexts[v.context]);
    if (values === null) {
      out.push(`${v.limit}: no scope values`);
      continue;
    }
    const now = Date.parse(v.at) / 1000;
    const bucket = bucketFor(limit.window ?? "session", now, policy.tz, limit.anchorFor(values));
    const key = keys.counterKey(limit.name, keys.scopeSegment(limit.dimensions, values), bucket.label);
    const got = { key, bucket: bucket.label, expire_at: bucket.expireAt(now), seconds_left: bucket.secondsLeft(now) };
    for (const field of ["key", "bucket", "expire_at", "seconds_left"] as const) {
      if (got[field] !== v[field]) {
        out.push(`${v.tz ?? "UTC"} ${v.at} ${v.limit} ctx${v.context} ${field}: ${got[field]} != ${v[field]}`);
      }
    }
  }
  for (const v of vectors.leases as Json[]) {
    const l = new Limit(v.limit, { cap: 1, unit: "concurrent", scope: leaseScope(v.limit) });
    const values = scopeValues(l.dimensions, contexts[v.context]) ?? [];
    const key = keys.leaseKey(l.name, keys.scopeSegment(l.dimensions, values));
    if (key !== v.key) out.push(`lease ${v.limit} ctx${v.context}: ${key} != ${v.key}`);
  }
  return out;
}

function leaseScope(name: string): Json {
  return { parallel: "user", tenant_parallel: "tenant", tool_parallel: ["user", "tool"], all_parallel: null }[name];
}

/** Every mismatch of escape() with the escape vectors. */
export function escapeMismatches(): string[] {
  const out: string[] = [];
  for (const [shown, want] of Object.entries(VECTORS.escape as Record<string, string>)) {
    const m = /^(.)\*(\d+)$/u.exec(shown);
    const value = m ? (m[1] ?? "").repeat(Number(m[2])) : shown;
    const got = escape(value);
    if (got !== want) out.push(`${JSON.stringify(shown)}: ${got} != ${want}`);
  }
  return out;
}
