// A TypeScript governor with a RedisBackend and a KafkaLedger on a real broker, for
// tests/test_typescript_governed.py: it runs a list of operations and says what each
// did on stdout (one JSON line each, written before the next starts), so the Python
// `mcpbg worker` projecting the topic can be held to exactly what TypeScript admitted.
//
//   tsx test/cross/governed.ts POLICY.toml REDIS_URL BOOTSTRAP TOPIC OUTBOX OPS.json FROM [KILL_AFTER]
//     OPS.json: [{"op": "check", "ctx": {...}}, {"op": "meter", "limit": "spend", "amount": 5, "ctx": {...}},
//                {"op": "priced", "price": {"spend": 5}, "ctx": {...}},  (admitted() charging its price)
//                {"op": "held", "estimate": {"spend": 9}, "price": {"spend": 5}, "ctx": {...}}]  (a hard-capped
//                governedCall: the estimate reserved by the admission, settled to the price)
//     runs ops [FROM, end): {"i": 3, "status": 200} / {"i": 4, "total": 5} / {"i": 5, "status": 200, "paid": true};
//     then close()
//     and {"closed": <events left unshipped>}
//     KILL_AFTER=K: at op K/2, waits until the shipper has shipped everything so far
//     (so the killed run has shipped part of its events); right after op K is reported, {"killing": K, "unshipped": n} and a
//     SIGKILL of this very process (its outbox then holds what it had not shipped)
import { readFileSync } from "node:fs";

import { Governor, LimitExceeded, RedisBackend, context, loadPolicyFile } from "../../src/index.js";
import { governedCall } from "../../src/integrations/common.js";
import { driverLedger } from "../driverLedger.js";

interface Op {
  op: "check" | "meter" | "priced" | "held";
  ctx: Record<string, string>;
  limit?: string;
  amount?: number;
  price?: Record<string, number>;
  estimate?: Record<string, number>;
}

/** A hard-capped call through the integrations' flow: its status (a refusal's too). */
async function heldCall(governor: Governor, op: Op): Promise<number> {
  try {
    await governedCall(governor, context(op.ctx), async () => "ok", op.price ?? null, op.estimate ?? null);
    return 200;
  } catch (err) {
    if (err instanceof LimitExceeded) return err.decision.status;
    throw err;
  }
}

const args = process.argv.slice(2);
if (args.length < 7) {
  process.stderr.write("usage: governed.ts POLICY REDIS_URL BOOTSTRAP TOPIC OUTBOX OPS FROM [KILL_AFTER]\n");
  process.exit(2);
}
const [policyFile, url, bootstrap, topic, outbox, opsFile, from, killAfter] = args as [
  string, string, string, string, string, string, string, string | undefined,
];
const say = (value: unknown) => process.stdout.write(JSON.stringify(value) + "\n"); // a pipe: synchronous

async function main(): Promise<void> {
  const ops = JSON.parse(readFileSync(opsFile, "utf8")) as Op[];
  const ledger = driverLedger(bootstrap, topic, outbox, 10);
  const governor = new Governor(loadPolicyFile(policyFile), RedisBackend.fromUrl(url, { timeout: 5 }), {
    ledger,
  });
  const kill = killAfter === undefined ? -1 : Number(killAfter);
  for (let i = Number(from); i < ops.length; i++) {
    const op = ops[i]!;
    const ctx = context(op.ctx);
    if (op.op === "check") say({ i, status: (await governor.check(ctx)).status });
    else if (op.op === "held") say({ i, status: await heldCall(governor, op) });
    else if (op.op === "priced") say({ i, ...(await governor.admitted(ctx, async (d, paid) => ({ status: d.status, paid }), { price: op.price ?? null })) });
    else say({ i, total: (await governor.meter(op.limit ?? "", op.amount ?? 0, ctx)).total });
    if (i === Math.floor(kill / 2)) {
      for (let waited = 0; ledger.unshipped > 0 && waited < 30_000; waited += 10) {
        await new Promise((resolve) => setTimeout(resolve, 10));
      }
      say({ shipped: i, unshipped: ledger.unshipped });
    }
    if (i === kill) {
      say({ killing: i, unshipped: ledger.unshipped });
      process.kill(process.pid, "SIGKILL");
    }
  }
  await governor.close();
  say({ closed: ledger.unshipped });
}

main().catch((err: unknown) => {
  process.stderr.write(`governed: ${err instanceof Error ? (err.stack ?? err.message) : String(err)}\n`);
  process.exit(1);
});
