// The outbox: the commit point (records in the kernel when append returns), the cursor,
// recovery after a crash (SIGKILL, a torn tail), segment deletion, the writer lock,
// and the on-disk bytes Python's outbox writes (the same format: either drains the other).
import { strict as assert } from "node:assert";
import { spawnSync } from "node:child_process";
import * as fs from "node:fs";
import { tmpdir } from "node:os";
import * as path from "node:path";
import { test } from "node:test";

import { MemoryLedger } from "../src/ledger/memory.js";
import { Outbox, OutboxFullError } from "../src/ledger/outbox.js";
import { newId } from "../src/ledger/events.js";

function folder(): string {
  return fs.mkdtempSync(path.join(tmpdir(), "mcpbg-ts-outbox-"));
}

const rec = (i: number) => Buffer.from(JSON.stringify({ id: `e${i}`, pad: "x".repeat(100) }));
const ids = (batch: Array<[unknown, Buffer]>) =>
  batch.map(([, raw]) => (JSON.parse(raw.toString()) as { id: string }).id);

test("append, peek, ack: shipped records go, the rest stays in order", async () => {
  const dir = folder();
  const box = await Outbox.open(dir, { segmentBytes: 1024 });
  for (let i = 0; i < 30; i++) box.append(rec(i));
  assert.equal(box.length, 30);
  const batch = box.peek(10);
  assert.deepEqual(ids(batch), Array.from({ length: 10 }, (_, i) => `e${i}`));
  await box.ack(batch[9]![0]);
  assert.equal(box.length, 20);
  assert.deepEqual(ids(box.peek(100)).slice(0, 2), ["e10", "e11"]);
  await box.ack(box.peek(100).at(-1)![0]);
  assert.equal(box.length, 0);
  assert.ok(box.empty);
  await box.close();
  const left = fs.readdirSync(dir).filter((n) => n.endsWith(".jsonl"));
  assert.equal(left.length, 1, `only the segment being written is kept: ${left.join(", ")}`);
});

test("the cursor file holds Python's bytes, and reopening resumes after it", async () => {
  const dir = folder();
  let box = await Outbox.open(dir);
  for (let i = 0; i < 5; i++) box.append(rec(i));
  const batch = box.peek(2);
  await box.ack(batch[1]![0], { sync: false }); // rewritten in place, padded
  const raw = fs.readFileSync(path.join(dir, "outbox.cursor"), "utf8");
  assert.equal(raw.length, 128);
  const size = rec(0).length + 1;
  assert.equal(raw.trimEnd(), `{"segment": 0, "offset": ${2 * size}, "index": 2}`);
  await box.close();
  box = await Outbox.open(dir);
  assert.deepEqual(ids(box.peek(10)), ["e2", "e3", "e4"]);
  await box.ack(box.peek(10)[0]![0]); // durable: a new file renamed over it
  assert.equal(fs.readFileSync(path.join(dir, "outbox.cursor"), "utf8"), `{"segment": 0, "offset": ${3 * size}, "index": 3}`);
  await box.close();
  const lines = fs.readFileSync(path.join(dir, "outbox-00000000000000000000.jsonl"), "utf8").split("\n");
  assert.equal(lines.length, 6); // five lines, each ended by \n
});

test("a SIGKILLed writer loses nothing it appended; a torn tail is cut off", async () => {
  const dir = folder();
  const lines = path.join(dir, "..", `${path.basename(dir)}-lines.json`);
  fs.writeFileSync(lines, JSON.stringify(Array.from({ length: 50 }, (_, i) => rec(i).toString())));
  const child = spawnSync(process.execPath, ["--import", "tsx", "test/ledgerDriver.ts", "outbox-append", dir, lines, "kill"], {
    encoding: "utf8",
  });
  assert.equal(child.signal, "SIGKILL", child.stderr);
  assert.match(child.stdout, /appended 49\n$/);
  // A crash mid-write on top: half a record without its newline.
  const segments = fs.readdirSync(dir).filter((n) => n.endsWith(".jsonl")).sort();
  fs.appendFileSync(path.join(dir, segments.at(-1)!), '{"id": "half');
  const warnings: string[] = [];
  const box = await Outbox.open(dir, { warn: (m) => warnings.push(m), segmentBytes: 4096 });
  assert.deepEqual(ids(box.peek(1000)), Array.from({ length: 50 }, (_, i) => `e${i}`));
  assert.ok(warnings.some((w) => w.includes("torn tail")), warnings.join("\n"));
  box.append(rec(50)); // starts on a clean line
  assert.equal(ids(box.peek(1000)).at(-1), "e50");
  await box.close();
});

test("one writer per folder: a second open is refused with the reason, then allowed", async () => {
  const dir = folder();
  const box = await Outbox.open(dir);
  await assert.rejects(Outbox.open(dir, { lockWaitMs: 0 }), /another process is writing this log/);
  await box.close();
  const again = await Outbox.open(dir, { lockWaitMs: 0 });
  await again.close();
});

test("a full outbox refuses (nothing written) or admits past the limit", async () => {
  const dir = folder();
  const box = await Outbox.open(dir, { maxBytes: 3 * (rec(0).length + 1) });
  for (let i = 0; i < 3; i++) box.append(rec(i));
  assert.throws(() => box.append(rec(3)), OutboxFullError);
  assert.equal(box.length, 3);
  box.append(rec(3), true); // a charged event is kept anyway
  assert.equal(box.length, 4);
  await box.close();
  const warned: string[] = [];
  const admit = await Outbox.open(folder(), { maxBytes: 10, onFull: "admit", warn: (m) => warned.push(m) });
  admit.append(rec(0));
  assert.equal(admit.length, 1);
  assert.match(warned[0]!, /is full/);
  await admit.close();
});

test("a damaged line is reported once and still returned", async () => {
  const dir = folder();
  let box = await Outbox.open(dir);
  box.append(rec(0));
  box.append(Buffer.from("not json"));
  box.append(rec(2));
  await box.close();
  const bad: string[] = [];
  box = await Outbox.open(dir, { onMalformed: (_f, _p, data, reason) => bad.push(`${data.toString()}: ${reason}`) });
  assert.equal(box.peek(10).length, 3);
  assert.equal(box.peek(10).length, 3);
  assert.equal(bad.length, 1);
  assert.equal(box.malformed, 1);
  await box.close();
});

test("bad options name the option and the value", async () => {
  await assert.rejects(Outbox.open(folder(), { maxBytes: 0 }), /maxBytes: a positive size \(got 0\)/);
  await assert.rejects(
    Outbox.open(folder(), { onFull: "drop" as "admit" }),
    /onFull: "refuse" or "admit" \(got "drop"\)/,
  );
});

test("the memory ledger keeps entries in order and encodes them", async () => {
  const ledger = new MemoryLedger();
  await ledger.append({ id: newId(), type: "admitted", time: 1764442477, context: { user: "u" } });
  await ledger.append({ id: newId(), type: "rejected", time: 1764442478, context: { user: "u" }, limit: "burst", status: 429 });
  assert.deepEqual(ledger.entries.map((e) => e.type), ["admitted", "rejected"]);
  assert.match(ledger.events()[1]!, /"type":"mcpbg.rejected.v1".*"decision":\{"limit":"burst","status":429/);
  await ledger.close();
  await assert.rejects(ledger.append(ledger.entries[0]!), /append after close/);
});
