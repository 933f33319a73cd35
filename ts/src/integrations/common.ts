/**
 * What the MCP integrations share (Python: integrations/flow.py, fastmcp.py):
 * one governed call (check, run, meter), the tool prices of `_meta.mcpbg`,
 * and the refusal as an error result.
 *
 * @example
 * toolPrices(policy, "search", { mcpbg: { cost_usd: "0.01", limit: "spend" } })
 * // { price: { spend: 10000 }, estimate: null }
 */
import type { Context } from "../context.js";
import { refusalBody, refusalText, type Decision } from "../decision.js";
import { BudgetExceeded, InvalidInputError } from "../errors.js";
import type { Governor, Reservation } from "../governor.js";
import { Unit, checkAmount, usd } from "../money.js";
import type { Policy } from "../policy.js";

/** What a call costs: limit name -> amount in that limit's unit. */
export type Charges = Record<string, number>;

export const META_KEY = "mcpbg";
const FIELDS = new Set(["limit", "cost", "cost_usd", "estimate", "estimate_usd"]);

function amounts(policy: Policy, spec: Record<string, unknown>, names: string[], where: string, kind: string): Charges {
  const dollars = `${kind}_usd`;
  const out: Charges = {};
  for (const name of names) {
    const lim = policy.get(name);
    if (dollars in spec) {
      const value = spec[dollars];
      if (lim.unit !== Unit.USD_MICROS) throw new InvalidInputError(`${where}.${dollars}`, value, `limit '${name}' counts ${lim.unit}`);
      if (kind === "estimate" && typeof value !== "string") {
        throw new InvalidInputError(`${where}.${dollars}`, value, 'expected dollars as a string, such as "0.05"');
      }
      try {
        out[name] = usd(value as string);
      } catch (err) {
        if (err instanceof InvalidInputError) throw new InvalidInputError(`${where}.${dollars}`, value, err.problem);
        throw err;
      }
    } else out[name] = checkAmount(spec[kind], `${where}.${kind}`);
  }
  return out;
}

/** The fixed price and the estimate a tool's `_meta` declares (`{"mcpbg": {...}}`), validated. */
export function toolPrices(
  policy: Policy,
  tool: string,
  meta: Record<string, unknown> | null | undefined,
): { price: Charges | null; estimate: Charges | null } {
  if (!meta || !(META_KEY in meta)) return { price: null, estimate: null };
  const spec = meta[META_KEY];
  const where = `tool '${tool}' meta.${META_KEY}`;
  if (spec === null || typeof spec !== "object" || Array.isArray(spec)) {
    throw new InvalidInputError(where, spec, 'expected {"limit": ..., "cost_usd": ...}');
  }
  const s = spec as Record<string, unknown>;
  const unknown = Object.keys(s).filter((k) => !FIELDS.has(k)).sort();
  if (unknown.length) throw new InvalidInputError(`${where}.${unknown[0]}`, s, "unknown field");
  let names = s["limit"];
  if (typeof names === "string") names = [names];
  if (!Array.isArray(names) || !names.length || !names.every((n) => typeof n === "string")) {
    throw new InvalidInputError(`${where}.limit`, s["limit"] ?? null, "expected a limit name or a list");
  }
  const hasCost = "cost" in s || "cost_usd" in s;
  const hasEstimate = "estimate" in s || "estimate_usd" in s;
  if (("cost" in s && "cost_usd" in s) || !(hasCost || hasEstimate)) {
    throw new InvalidInputError(where, s, "give exactly one of cost_usd (dollars) or cost");
  }
  if ("estimate" in s && "estimate_usd" in s) {
    throw new InvalidInputError(where, s, "give exactly one of estimate_usd (dollars) or estimate");
  }
  for (const name of names as string[]) {
    if (!policy.has(name)) {
      throw new InvalidInputError(`${where}.limit`, name, `no such limit (known: ${policy.limits.map((l) => l.name).join(", ")})`);
    }
  }
  return {
    price: hasCost ? amounts(policy, s, names as string[], where, "cost") : null,
    estimate: hasEstimate ? amounts(policy, s, names as string[], where, "estimate") : null,
  };
}

/** How an integration names its caller; null/undefined: nobody (the policy's `anonymous` rule). */
export type Identify<E> = (extra: E) => Context | null | undefined | Promise<Context | null | undefined>;

/** The error result of a refused call: the refusal text, and its fields under `mcpbg`. */
export function refusalResult(decision: Decision): {
  content: { type: "text"; text: string }[];
  structuredContent: Record<string, unknown>;
  isError: true;
} {
  return {
    content: [{ type: "text", text: refusalText(decision) }],
    structuredContent: { [META_KEY]: refusalBody(decision) },
    isError: true,
  };
}

/**
 * One governed call: identify, check (a refusal throws BudgetExceeded and the
 * work never runs; `wait`: seconds a full concurrency cap may hold the call
 * for a slot first), reserve estimates, run, then charge: a completed call is
 * charged its price even past a cap; a failed one its fixed price.
 */
export async function governedCall<R>(
  governor: Governor,
  ctx: Context,
  work: () => Promise<R>,
  fixed: Charges | null,
  estimate: Charges | null,
  wait = 0,
): Promise<R> {
  const caller = await governor.identified(ctx);
  return governor.admitted(caller, async () => {
    const held: Reservation[] = [];
    try {
      for (const [limit, amount] of Object.entries(estimate ?? {})) held.push(await governor.reserve(limit, amount, caller));
    } catch (err) {
      for (const r of held) r.release();
      for (const r of held) await r.finish(false);
      throw err;
    }
    const charge = async (): Promise<void> => {
      const rest: Charges = { ...(fixed ?? {}) };
      for (const r of held) {
        if (r.limit.name in rest) {
          r.actual = rest[r.limit.name] ?? null;
          delete rest[r.limit.name];
        }
        await r.finish(false);
      }
      if (Object.keys(rest).length) await governor.meterCharges(rest, caller);
    };
    let result: R;
    try {
      result = await work();
    } catch (err) {
      await charge();
      throw err;
    }
    await charge();
    return result;
  }, { wait });
}

export function isRefusal(err: unknown): err is BudgetExceeded {
  return err instanceof BudgetExceeded;
}
