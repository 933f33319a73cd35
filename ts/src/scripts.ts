/**
 * The Redis scripts: the repository's `lua/` files, copied into the package at
 * build time (scripts/copy-lua.mjs), never translated. Each script is its
 * prelude (the lib.lua lines `layout.json` lists for it: the helpers its body
 * uses, as Python's lua/__init__.py picks them and the conformance vectors
 * carry them), a newline, then its body, exactly as the Python package sends
 * it, so both run the same SHA1 (the vectors pin the digests; loading refuses
 * a copy whose digest differs from the one recorded at build time).
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

/** ts/lua/layout.json: each script's prelude as lib.lua line ranges (1-based, inclusive). */
interface Layout {
  readonly prefix: string;
  readonly joiner: string;
  readonly prelude: Readonly<Record<string, readonly (readonly [number, number])[]>>;
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
  const layout = JSON.parse(read("layout.json")) as Layout;
  const lib = read(layout.prefix).split("\n").slice(0, -1);
  const head = (layout.prelude[name] ?? []).flatMap(([first, last]) =>
    lib.slice(first - 1, last).map((line) => line + "\n"),
  );
  const source = head.join("") + layout.joiner + read(`${name}.lua`);
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
