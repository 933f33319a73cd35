/**
 * The Redis scripts: the repository's `lua/` files, copied into the package at
 * build time (scripts/copy-lua.mjs), never translated. Each script is
 * `lib.lua`, a newline, then its body, exactly as the Python package sends it,
 * so both run the same SHA1 (the conformance vectors pin the digests; loading
 * refuses a copy whose digest differs from the one recorded at build time).
 *
 * @example
 * const charge = script("charge");  // { name, source, sha }
 */
import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";

import { GovernorError } from "./errors.js";

export const SCRIPTS = ["charge", "apply", "usage", "rewrite", "change", "lease"] as const;
export type ScriptName = (typeof SCRIPTS)[number];

export interface Script {
  readonly name: ScriptName;
  readonly source: string;
  readonly sha: string;
}

/** Where the copied scripts are: `<package>/lua/` (from src/ or dist/ alike). */
export const LUA_DIR = new URL("../lua/", import.meta.url);

const loaded = new Map<string, Script>();

export function sha1(text: string): string {
  return createHash("sha1").update(text, "utf8").digest("hex");
}

/** The full source of a script, checked against the digests recorded when it was copied. */
export function script(name: ScriptName, dir: URL = LUA_DIR): Script {
  const cacheKey = `${dir.href}|${name}`;
  const hit = loaded.get(cacheKey);
  if (hit !== undefined) return hit;
  if (!SCRIPTS.includes(name)) throw new GovernorError(`no Lua script named '${String(name)}'`);
  const read = (file: string): string => {
    try {
      return readFileSync(new URL(file, dir), "utf8");
    } catch {
      throw new GovernorError(`lua/${file} is missing: run "npm run build" (it copies ../lua into the package)`);
    }
  };
  const source = read("lib.lua") + "\n" + read(`${name}.lua`);
  const digests = JSON.parse(read("digests.json")) as Record<string, string>;
  const sha = sha1(source);
  if (digests[name] !== sha) {
    throw new GovernorError(
      `lua/${name}.lua does not match the digest recorded at build time (${digests[name] ?? "none"} != ${sha}): rebuild`,
    );
  }
  const out = Object.freeze({ name, source, sha });
  loaded.set(cacheKey, out);
  return out;
}
