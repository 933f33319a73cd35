/**
 * The loop guard (Python: repeats.py): a limit whose scope includes `call` counts identical
 * calls, the same tool with the same arguments, by `callHash`; conformance/vectors.json holds
 * the hash's vectors.
 *
 * @example
 * callHash("search", { q: "mcp", n: 3 }) === callHash("search", { n: 3, q: "mcp" })  // true
 */
import { createHash } from "node:crypto";

import { type Context, context } from "./context.js";
import { InvalidInputError } from "./errors.js";
import type { Policy } from "./policy.js";

/** Hex digits of the hash kept in the key (128 bits). */
export const HASH_HEX = 32;

function codePointCompare(a: string, b: string): number {
  // Python sorts keys by code point; JavaScript's < compares UTF-16 units.
  const x = [...a].map((c) => c.codePointAt(0) as number);
  const y = [...b].map((c) => c.codePointAt(0) as number);
  for (let i = 0; i < Math.min(x.length, y.length); i++) if (x[i] !== y[i]) return (x[i] as number) - (y[i] as number);
  return x.length - y.length;
}

/** `value` as canonical JSON: keys sorted by code point, no whitespace, non-ASCII as is. */
export function canonicalJson(value: unknown): string {
  if (value === null) return "null";
  if (typeof value === "boolean") return value ? "true" : "false";
  if (typeof value === "number") {
    // ECMAScript's number to string is the canonical form (RFC 8785); Python writes the same.
    if (!Number.isFinite(value)) throw new InvalidInputError("arguments", value, "not a JSON number");
    return JSON.stringify(value);
  }
  if (typeof value === "string") return JSON.stringify(value);
  if (Array.isArray(value)) return `[${value.map(canonicalJson).join(",")}]`;
  if (typeof value === "object" && Object.getPrototypeOf(value) === Object.prototype) {
    const keys = Object.keys(value as object).sort(codePointCompare);
    return `{${keys.map((k) => `${JSON.stringify(k)}:${canonicalJson((value as Record<string, unknown>)[k])}`).join(",")}}`;
  }
  throw new InvalidInputError("arguments", typeof value, "not a JSON value");
}

/** The identity of one call: SHA-256 of its tool, a newline and its canonical arguments. */
export function callHash(tool: string, args: unknown): string {
  const text = `${tool}\n${canonicalJson(args ?? {})}`;
  return createHash("sha256").update(text, "utf8").digest("hex").slice(0, HASH_HEX);
}

/** Whether a limit of `policy` counts identical calls. */
export function countsCalls(policy: Policy): boolean {
  return policy.limits.some((l) => l.dimensions.includes("call"));
}

/** `ctx` with the call's hash when the policy has a loop guard. */
export function withCall(policy: Policy, ctx: Context, tool: string, args: unknown): Context {
  return countsCalls(policy) ? context({ ...ctx, call: callHash(tool, args) }) : ctx;
}

/** Whether a refusal's reason (`budget_exceeded:session+call/minute`) is the loop guard's. */
export function isRepeat(reason: string): boolean {
  const rest = reason.slice(reason.indexOf(":") + 1);
  return rest.slice(0, rest.indexOf("/") === -1 ? rest.length : rest.indexOf("/")).split("+").includes("call");
}
