// The encoder against the Python side: conformance/events.json holds sample entries and
// the exact CloudEvent lines Python writes of them; every TypeScript-made event must be
// byte-identical and valid under the JSON Schema `mcpbg schema` prints.
import { strict as assert } from "node:assert";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { Ajv2020 } from "ajv/dist/2020.js";
import addFormatsModule from "ajv-formats";

import {
  crc32,
  encode,
  idTime,
  newId,
  partitionKey,
  partitionOf,
  rfc3339,
} from "../src/ledger/events.js";
import { ENTRY_TYPES, type LedgerEntry } from "../src/ledger/types.js";
import { Governor, Limit, MemoryBackend, MemoryLedger, Policy, Scope, Unit, Window, context, usd } from "../src/index.js";

interface Vector {
  entry: LedgerEntry;
  type: string;
  key: string;
  event: string;
}

const root = new URL("../../conformance/", import.meta.url);
const data = JSON.parse(readFileSync(new URL("events.json", root), "utf8")) as {
  source: string;
  vectors: Vector[];
};
const schemas = JSON.parse(readFileSync(new URL("events.schema.json", root), "utf8")) as Record<
  string,
  object
>;

const ajv = new Ajv2020({ strict: false, allErrors: true });
const addFormats = addFormatsModule as unknown as (a: Ajv2020) => void;
addFormats(ajv);
const validators = new Map(Object.entries(schemas).map(([name, s]) => [name, ajv.compile(s)]));

function validate(raw: string): void {
  const event = JSON.parse(raw) as { type: string };
  const check = validators.get(event.type);
  assert.ok(check, `no schema for ${event.type}`);
  assert.ok(check(event), `${event.type}: ${ajv.errorsText(check.errors)}\n${raw}`);
}

/** The entry with every field at Python's default left out. */
function minimal(entry: LedgerEntry): LedgerEntry {
  const out: Record<string, unknown> = { id: entry.id, type: entry.type, time: entry.time };
  const ctx = Object.fromEntries(Object.entries(entry.context).filter(([, v]) => v != null));
  out.context = ctx;
  if (entry.charges?.length) out.charges = entry.charges;
  if (entry.limit != null) out.limit = entry.limit;
  if (entry.status !== 200) out.status = entry.status;
  if (entry.over?.length) out.over = entry.over;
  if (entry.usage != null) out.usage = entry.usage;
  if (entry.degraded) out.degraded = true;
  if (entry.reservation != null) out.reservation = entry.reservation;
  if (entry.change != null) out.change = entry.change;
  if (entry.approved?.length) out.approved = entry.approved;
  if (entry.spent?.length) out.spent = entry.spent;
  return out as unknown as LedgerEntry;
}

test("the vectors cover every entry type", () => {
  const types = new Set(data.vectors.map((v) => v.type));
  assert.deepEqual([...types].sort(), ENTRY_TYPES.map((t) => `mcpbg.${t}.v1`).sort());
  assert.deepEqual(Object.keys(schemas).sort(), [...types].sort());
});

test("encode(entry) is byte for byte the event Python writes", () => {
  for (const v of data.vectors) {
    assert.equal(encode(v.entry, data.source), v.event, `entry ${v.entry.id} (${v.type})`);
    assert.equal(encode(minimal(v.entry), data.source), v.event, `minimal ${v.entry.id}`);
  }
});

test("bigint amounts encode as the same digits", () => {
  for (const v of data.vectors) {
    const charges = (v.entry.charges ?? []).map((c) => ({ ...c, amount: BigInt(c.amount) }));
    assert.equal(encode({ ...v.entry, charges }, data.source), v.event);
  }
});

test("the Kafka record key and partition are Python's", () => {
  for (const v of data.vectors) {
    const key = partitionKey(v.entry.context);
    assert.equal(key.toString("utf8"), v.key);
  }
  // Python: zlib.crc32(b"acme") == 96778814, partition_of(b"acme", 6) == 2
  assert.equal(crc32(Buffer.from("acme")), 96778814);
  assert.equal(partitionOf(Buffer.from("acme"), 6), 2);
  assert.equal(crc32(Buffer.from("café 日本")), 3829060481);
  assert.equal(crc32(Buffer.from("")), 0);
});

test("every TypeScript-made event validates against the schema mcpbg prints", () => {
  for (const v of data.vectors) validate(encode(v.entry, "/mcpbg/ts-test"));
  // and one made here from scratch, with a fresh id and the current time
  const first = data.vectors[0]!.entry;
  validate(encode({ ...first, id: newId() }, "/mcpbg/ts-test"));
});

test("a wrong encoding fails the schema (the validator is not vacuous)", () => {
  const raw = encode(data.vectors[0]!.entry, "/mcpbg/ts-test").replace('"status":200', '"status":"200"');
  const event = JSON.parse(raw) as { type: string };
  assert.equal(validators.get(event.type)!(event), false);
});

test("times round half to even to the microsecond, as Python's round", () => {
  assert.equal(rfc3339(1764442477.0078125), "2025-11-29T18:54:37.007812Z");
  assert.equal(rfc3339(1764442477.25), "2025-11-29T18:54:37.250000Z");
  assert.equal(rfc3339(-0.5), "1969-12-31T23:59:59.500000Z");
  assert.equal(rfc3339(1764442478 - 1e-7), "2025-11-29T18:54:38.000000Z");
});

test("ids are time-ordered UUIDv7s", () => {
  const ids = Array.from({ length: 5000 }, () => newId());
  assert.deepEqual([...ids].sort(), ids);
  assert.equal(new Set(ids).size, ids.length);
  for (const id of ids.slice(0, 50)) {
    assert.match(id, /^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/);
  }
  const made = idTime(newId())!;
  assert.ok(Math.abs(made - Date.now() / 1000) < 60, String(made));
  for (const v of data.vectors) assert.equal(idTime(v.entry.id), Math.floor(v.entry.time * 1000) / 1000);
  assert.equal(idTime("not-a-uuid"), null);
});

test("a fractional amount is refused with the field named", () => {
  const entry = data.vectors[0]!.entry;
  const charges = [{ ...entry.charges![0]!, amount: 1.5 }];
  assert.throws(() => encode({ ...entry, charges }, "/s"), /charges\[0\]\.amount: expected a whole number.*1\.5/);
});

test("a hard cap on two limits writes Python's reserved and settled events, byte for byte", async () => {
  // conformance/events.py: Reservations(gov, {"spend": usd(1), "tokens": 5000}, alice),
  // then actual["spend"] = usd("0.375"), a tick later.
  const i = data.vectors.findIndex((v) => v.type === "mcpbg.reserved.v1" && (v.entry.charges ?? []).length === 2);
  const [reserved, settled] = [data.vectors[i]!, data.vectors[i + 1]!];
  assert.equal(settled.type, "mcpbg.settled.v1");
  const clock = [reserved.entry.time];
  const ledger = new MemoryLedger();
  const policy = Policy.of(
    new Limit("spend", { cap: usd(5), window: Window.DAY, unit: Unit.USD_MICROS, scope: Scope.TENANT, gated: false }),
    new Limit("tokens", { cap: 1_000_000, window: Window.WEEK, unit: Unit.TOKENS, scope: Scope.USER }),
    { timezone: "Europe/Paris" },
  );
  const gov = new Governor(policy, new MemoryBackend(() => clock[0]!), { ledger, clock: () => clock[0]! });
  const alice = context({ user: "alice", tenant: "acme", tool: "search", agent: "bot-1" });
  const held = await gov.reserveAll({ spend: usd(1), tokens: 5000 }, alice);
  clock[0] = settled.entry.time;
  held.actual["spend"] = usd("0.375");
  await held.finish();
  const [r, s] = ledger.entries;
  assert.equal(ledger.entries.length, 2);
  assert.equal(s?.reservation, r?.id);
  const ids = { id: reserved.entry.id };
  assert.equal(encode({ ...r!, ...ids }, data.source), reserved.event);
  assert.equal(encode({ ...s!, id: settled.entry.id, reservation: reserved.entry.id }, data.source), settled.event);
});
