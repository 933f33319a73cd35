// A Node process for the cross-language tests (tests/test_typescript_ledger.py and the
// outbox tests here): it appends through the TypeScript ledger or outbox and says what
// it did on stdout, one line per step, so a test can SIGKILL it at a known point.
//
//   tsx test/ledgerDriver.ts kafka BOOTSTRAP TOPIC OUTBOX ENTRIES.json FROM TO [PAUSE_EVERY]
//       append entries [FROM, TO) of the JSON array through a KafkaLedger, printing
//       "appended I" after each append resolved, then close() and print "closed"
//       MCPBG_TS_KILL_AT=POINT:N SIGKILLs the process inside the shipper at its Nth
//       batch: before_send (about to send), after_send (the broker acknowledged, the
//       cursor not yet written), after_ack (the cursor written)
//   tsx test/ledgerDriver.ts outbox-append OUTBOX LINES.json [kill]
//       append the JSON array of strings to the outbox ("appended I"); "kill": SIGKILL
//       itself after the last one instead of closing
//   tsx test/ledgerDriver.ts outbox-drain OUTBOX ACK
//       print every unacknowledged record as one JSON string a line, acknowledge the
//       first ACK of them (durably), close
//   tsx test/ledgerDriver.ts outbox-hold OUTBOX
//       open (take the writer lock), print "locked", hold it until stdin closes
import { readFileSync } from "node:fs";

import { KafkaLedger } from "../src/ledger/kafka.js";
import { Outbox } from "../src/ledger/outbox.js";
import type { LedgerEntry } from "../src/ledger/types.js";
import { driverLedger } from "./driverLedger.js";

const [command, ...args] = process.argv.slice(2);
const say = (line: string) => process.stdout.write(line + "\n");

/** Wrap the shipper's steps so the process dies at a chosen one (MCPBG_TS_KILL_AT). */
function killPoints(): void {
  const spec = process.env.MCPBG_TS_KILL_AT;
  if (!spec) return;
  const [point, nth] = spec.split(":") as [string, string];
  let batches = 0;
  const die = () => process.kill(process.pid, "SIGKILL");
  type Step = (this: unknown, ...args: unknown[]) => Promise<void>;
  const ledger = KafkaLedger.prototype as unknown as { send: Step };
  const box = Outbox.prototype as unknown as { ack: Step };
  const send = ledger.send;
  ledger.send = async function (this: unknown, ...args: unknown[]) {
    batches += 1;
    if (point === "before_send" && batches === Number(nth)) die();
    await send.apply(this, args);
    if (point === "after_send" && batches === Number(nth)) die();
  };
  const ack = box.ack;
  box.ack = async function (this: unknown, ...args: unknown[]) {
    await ack.apply(this, args);
    if (point === "after_ack" && batches === Number(nth)) die();
  };
}

async function kafka(): Promise<void> {
  killPoints();
  const [bootstrap, topic, outbox, file, from, to, pauseEvery] = args as [
    string, string, string, string, string, string, string | undefined,
  ];
  const entries = JSON.parse(readFileSync(file, "utf8")) as LedgerEntry[];
  const ledger = driverLedger(bootstrap, topic, outbox, 25);
  const every = Number(pauseEvery ?? "0");
  for (let i = Number(from); i < Number(to); i++) {
    await ledger.append(entries[i]!);
    say(`appended ${i}`);
    // Let the shipper run between appends, so a kill lands mid-shipment too.
    if (every > 0 && i % every === every - 1) await new Promise((r) => setTimeout(r, 15));
  }
  await ledger.close(60_000);
  say(`closed ${ledger.unshipped}`);
}

async function outboxAppend(): Promise<void> {
  const [dir, file, mode] = args as [string, string, string | undefined];
  const lines = JSON.parse(readFileSync(file, "utf8")) as string[];
  const box = await Outbox.open(dir, { segmentBytes: 4096 });
  lines.forEach((line, i) => {
    box.append(Buffer.from(line, "utf8"));
    say(`appended ${i}`);
  });
  if (mode === "kill") process.kill(process.pid, "SIGKILL");
  await box.close();
  say("closed");
}

async function outboxDrain(): Promise<void> {
  const [dir, ack] = args as [string, string];
  const box = await Outbox.open(dir);
  const records = box.peek(1_000_000);
  for (const [, raw] of records) say(JSON.stringify(raw.toString("utf8")));
  const n = Number(ack);
  if (n > 0) await box.ack(records[n - 1]![0]);
  await box.close();
}

async function outboxHold(): Promise<void> {
  const [dir] = args as [string];
  const box = await Outbox.open(dir, { lockWaitMs: 0 });
  say("locked");
  process.stdin.resume();
  await new Promise((resolve) => process.stdin.once("end", resolve));
  await box.close();
}

const commands: Record<string, () => Promise<void>> = {
  kafka,
  "outbox-append": outboxAppend,
  "outbox-drain": outboxDrain,
  "outbox-hold": outboxHold,
};
const run = commands[command ?? ""];
if (run === undefined) {
  process.stderr.write(`ledgerDriver: unknown command ${JSON.stringify(command)}\n`);
  process.exit(2);
}
run().catch((err: unknown) => {
  process.stderr.write(`ledgerDriver: ${err instanceof Error ? (err.stack ?? err.message) : String(err)}\n`);
  process.exit(1);
});
