// Build step: copy the repository's lua/*.lua into the package (ts/lua/), with
// each script's layout (layout.json: the lib.lua lines of its prelude, from the
// conformance vectors; Python's lua/__init__.py picks them) and SHA1 (prelude +
// "\n" + body, as EVALSHA runs it, assembled as src/scripts.ts does). The
// digests must equal those of the vectors, which the Python implementation
// generated: a copy or layout that differs fails the build. The Postgres migrations
// (sql/*.sql) are copied into ts/sql/ too.
import { createHash } from "node:crypto";
import { copyFileSync, existsSync, mkdirSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";

const here = new URL("../", import.meta.url);
const from = new URL("../lua/", here);
const to = new URL("lua/", here);
const vectorsFile = new URL("../conformance/vectors.json", here);

if (!existsSync(from)) {
  // Installed from a tarball: the scripts and their layout were copied when it was packed.
  if (existsSync(new URL("digests.json", to)) && existsSync(new URL("layout.json", to)) && existsSync(new URL("sql/", here))) {
    process.exit(0);
  }
  console.error("copy-lua: ../lua not found and no copied scripts in ts/lua");
  process.exit(1);
}
mkdirSync(to, { recursive: true });
const vectors = JSON.parse(readFileSync(vectorsFile, "utf8"));
const { prefix, joiner, prelude } = vectors.script_layout;
// The scripts the package loads and their prelude; not lua/charge_many.lua (Python's
// batched checks, built around charge.lua by lua/__init__.py), nor a copy it left here.
const names = [prefix, ...vectors.script_layout.names.map((n) => `${n}.lua`)];
for (const file of readdirSync(to).filter((f) => f.endsWith(".lua") && !names.includes(f))) {
  rmSync(new URL(file, to));
}
for (const file of names) copyFileSync(new URL(file, from), new URL(file, to));
const layout = { prefix, joiner, prelude };
writeFileSync(new URL("layout.json", to), JSON.stringify(layout) + "\n");
// The same splice as src/scripts.ts (this runs before tsc): each range's lines,
// each with its "\n", then the joiner and the body. Both are held to the digests.
const libLines = readFileSync(new URL(prefix, to), "utf8").split("\n").slice(0, -1);
const digests = {};
const stale = [];
for (const name of vectors.script_layout.names) {
  const head = (prelude[name] ?? []).flatMap(([first, last]) => libLines.slice(first - 1, last).map((l) => l + "\n"));
  const source = head.join("") + joiner + readFileSync(new URL(`${name}.lua`, to), "utf8");
  digests[name] = createHash("sha1").update(source, "utf8").digest("hex");
  if (digests[name] !== vectors.scripts[name]) stale.push(name);
}
if (stale.length) {
  console.error(
    `copy-lua: lua/{${stale.join(",")}}.lua differ from conformance/vectors.json: ` +
      "regenerate the vectors (python conformance/generate.py > conformance/vectors.json)",
  );
  process.exit(1);
}
writeFileSync(new URL("digests.json", to), JSON.stringify(digests, null, 1) + "\n");
// The Postgres migrations (sql/NNNN_<name>.sql), for src/backends/postgres.ts, which
// applies them as Python's PostgresBackend does: the same files, never translated.
const sqlFrom = new URL("../sql/", here);
const sqlTo = new URL("sql/", here);
mkdirSync(sqlTo, { recursive: true });
const migration = (f) => /^\d{4}_[a-z0-9_]+\.sql$/.test(f);
const shipped = readdirSync(sqlFrom).filter(migration);
// A migration gone from sql/ (folded into another before release) must not linger here.
for (const file of readdirSync(sqlTo).filter((f) => migration(f) && !shipped.includes(f))) {
  rmSync(new URL(file, sqlTo));
}
for (const file of shipped) copyFileSync(new URL(file, sqlFrom), new URL(file, sqlTo));
// The built-in price table, as the Python package exports it into the vectors.
mkdirSync(new URL("data/", here), { recursive: true });
writeFileSync(new URL("data/prices.json", here), JSON.stringify(vectors.builtin_prices.models) + "\n");
writeFileSync(
  new URL("data/prices-version.json", here),
  JSON.stringify({ version: vectors.builtin_prices.version }) + "\n",
);
