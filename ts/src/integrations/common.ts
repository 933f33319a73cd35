/**
 * What the MCP integrations share (Python: integrations/flow.py, fastmcp.py):
 * one governed call (check, run, meter), the tool prices of `_meta.mcpbg`,
 * and the refusal as an error result.
 *
 * @example
 * toolPrices(policy, "search", { mcpbg: { cost_usd: "0.01", limit: "spend" } })
 * // { price: { spend: 10000 }, estimate: null }
 */
import { createHmac, randomBytes, timingSafeEqual } from "node:crypto";

import type { Approval } from "../approval.js";
import { contextKey, type Context } from "../context.js";
import { EXCEEDED, REFUSAL_META_KEY, refusalBody, refusalMeta, refusalText, type Decision } from "../decision.js";
import { LimitExceeded, InvalidInputError } from "../errors.js";
import { Reservations, type Governor } from "../governor.js";
import { Unit, checkAmount, usd } from "../money.js";
import { OnExceed, type Policy } from "../policy.js";

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

/**
 * The error result of a refused call: the refusal text, its fields under `mcpbg`,
 * and the refusal as data in `_meta` (refusalMeta, under REFUSAL_META_KEY).
 */
export function refusalResult(decision: Decision): {
  content: { type: "text"; text: string }[];
  structuredContent: Record<string, unknown>;
  isError: true;
  _meta: Record<string, unknown>;
} {
  return {
    content: [{ type: "text", text: refusalText(decision) }],
    structuredContent: { [META_KEY]: refusalBody(decision) },
    isError: true,
    _meta: { [REFUSAL_META_KEY]: refusalMeta(decision) },
  };
}

/** Asks the client's user whether a call refused by an OnExceed.ASK limit may go over it. */
export type Ask = (decision: Decision) => Promise<boolean>;

/** How long (seconds) the user has to answer an approval by default (Python: approval_timeout). */
export const APPROVAL_TIMEOUT = 120;

/**
 * The OnExceed.ASK limit whose refusal the user may wave through, else null:
 * never a breaker, an unnamed caller, unreachable counters or a full ledger
 * (Python: integrations/flow.py askable).
 */
export function askable(governor: Governor, decision: Decision, approved: readonly string[]): string | null {
  const name = decision.limit;
  if (decision.admitted || decision.degraded || name === null || approved.includes(name)) return null;
  if (!decision.reason.startsWith(EXCEEDED) || !governor.policy.has(name)) return null;
  const limit = governor.policy.get(name);
  return limit.onExceed === OnExceed.ASK && !limit.breaker ? name : null;
}

/** The question put to the user (the Python middleware's words). */
export function approvalMessage(decision: Decision, tool: string): string {
  return `Budget '${decision.limit ?? ""}' is spent (${decision.reason}). Allow this one call to '${tool}' to go over it?`;
}

/** The MCP elicitation (form mode) of that question: one boolean, true to go over. */
export function approvalRequest(decision: Decision, tool: string): {
  message: string;
  requestedSchema: { type: "object"; properties: { value: { type: "boolean"; title: string } }; required: string[] };
} {
  return {
    message: approvalMessage(decision, tool),
    requestedSchema: { type: "object", properties: { value: { type: "boolean", title: "Go over budget" } }, required: ["value"] },
  };
}

/** Whether an elicitation result says yes (accepted, with value true). */
export function approvalGiven(result: unknown): boolean {
  const r = result as { action?: unknown; content?: Record<string, unknown> } | null | undefined;
  return r?.action === "accept" && r.content?.["value"] === true;
}

/** The key of the approval question in an `input_required` result (Python: fastmcp.APPROVAL_REQUEST). */
export const APPROVAL_REQUEST = "mcpbg_approval";

/** The first protocol revision without a back-channel (SEP-2322): the question is the call's result. */
export const MODERN_PROTOCOL = "2026-07-28";

/** The `input_required` result of a call refused by an OnExceed.ASK limit (SEP-2322). */
export interface ApprovalQuestion {
  [key: string]: unknown;
  resultType: "input_required";
  inputRequests: Record<string, { method: "elicitation/create"; params: { mode: "form" } & ReturnType<typeof approvalRequest> }>;
  requestState: string;
}

/** The approval question as the call's result: the elicitation under APPROVAL_REQUEST, the sealed limit as requestState. */
export function approvalQuestion(decision: Decision, tool: string, requestState: string): ApprovalQuestion {
  return {
    resultType: "input_required",
    inputRequests: { [APPROVAL_REQUEST]: { method: "elicitation/create", params: { mode: "form", ...approvalRequest(decision, tool) } } },
    requestState,
  };
}

/** Thrown by an in-round Ask: the call ends with `result`, the question (Python: fastmcp._AskInRound). */
export class AskInRound extends Error {
  constructor(readonly result: ApprovalQuestion) {
    super("the approval question goes out as the call's result");
    this.name = "AskInRound";
  }
}

/** Whether a retried call's `inputResponses` answer our approval question yes (Python: fastmcp._yes). */
export function answeredYes(responses: unknown): boolean {
  if (responses === null || typeof responses !== "object") return false;
  return approvalGiven((responses as Record<string, unknown>)[APPROVAL_REQUEST]);
}

/**
 * Seals the approval's text (approval.ts approvalText: the refusing limit, the
 * caller, a one-time id, when it lapses) into the `requestState` a 2026-07-28
 * client echoes on its retry, and opens it again: the state is the client's to
 * hold, so it is signed (HMAC-SHA256) and bound to the caller and the tool, and
 * a client cannot approve a question it was never asked (Python: FastMCP seals
 * request_state). The one-time id is spent with the admission it allows.
 */
export interface ApprovalSeal {
  seal(text: string, caller: Context): string | Promise<string>;
  /**
   * The text `state` (what `ctx.mcpReq.requestState()` reads) was sealed with for
   * this caller and tool, else null. A server whose `requestState.verify` hook is
   * the SDK's codec passes a seal of its own: `codec.mint({ text })` to seal, and
   * the verified payload's `text` to open.
   */
  open(state: unknown, caller: Context): string | null | Promise<string | null>;
}

/** The per-process seal's key: random, one per process (every server a per-request factory makes shares it). */
const PROCESS_KEY = randomBytes(32);

const SEALED = "mcpbg1";

/** A sealed state taken apart (`mcpbg1.<limit>.<tag>`), else null. */
function sealedParts(state: unknown): { limit: string; tag: Buffer } | null {
  if (typeof state !== "string") return null;
  const [version, name, tag, ...rest] = state.split(".");
  if (version !== SEALED || name === undefined || tag === undefined || rest.length) return null;
  return { limit: Buffer.from(name, "base64url").toString("utf8"), tag: Buffer.from(tag, "base64url") };
}

/** An ApprovalSeal that answers at once. */
export interface HmacSeal extends ApprovalSeal {
  seal(limit: string, caller: Context): string;
  open(state: unknown, caller: Context): string | null;
}

/**
 * The HMAC seal: `key` (at least 32 bytes) must be the same on every replica a
 * client's retry may reach; default: random, one per process.
 */
export function approvalSeal(key: string | Uint8Array = PROCESS_KEY): HmacSeal {
  const secret = typeof key === "string" ? Buffer.from(key, "utf8") : Buffer.from(key);
  if (secret.length < 32) throw new InvalidInputError("approval_key", `${secret.length} bytes`, "expected at least 32 bytes");
  const mac = (limit: string, caller: Context): Buffer =>
    createHmac("sha256", secret).update(`mcpbg.approval\u0000${contextKey(caller)}\u0000${limit}`).digest();
  return {
    seal: (limit, caller) => `${SEALED}.${Buffer.from(limit, "utf8").toString("base64url")}.${mac(limit, caller).toString("base64url")}`,
    open: (state, caller) => {
      const parts = sealedParts(state);
      if (parts === null) return null;
      const want = mac(parts.limit, caller);
      return parts.tag.length === want.length && timingSafeEqual(parts.tag, want) ? parts.limit : null;
    },
  };
}

/**
 * The HMAC seal whose key `load()` fetches (a backend's approvalKey): read once
 * and kept; a well-formed state that does not open is tried once more with the
 * key read again, in case the store lost it (a flushed Redis) and another
 * replica set a new one since. A failed read fails that seal or open (the
 * caller refuses) and is tried again next time.
 */
export function loadedSeal(load: () => Promise<Uint8Array>): ApprovalSeal {
  let current: Promise<HmacSeal> | null = null;
  const fetched = (): Promise<HmacSeal> => {
    const p = load().then((key) => approvalSeal(key));
    current = p;
    p.catch(() => {
      if (current === p) current = null; // not kept: the next call reads again
    });
    return p;
  };
  const cached = (): Promise<HmacSeal> => current ?? fetched();
  return {
    seal: async (limit, caller) => (await cached()).seal(limit, caller),
    open: async (state, caller) => {
      const used = cached();
      const limit = (await used).open(state, caller);
      if (limit !== null || sealedParts(state) === null) return limit;
      // Calls that fail together read the key again once: the first, the others use its read.
      return (await (current === used ? fetched() : cached())).open(state, caller);
    },
  };
}

/** Each backend's shared seal: one per backend, so every server a per-request factory makes reads the key once. */
const SHARED_SEALS = new WeakMap<object, ApprovalSeal>();

/**
 * The middleware's seal when none is given: on a backend that keeps an
 * approval key (RedisBackend), that key, so every replica on the same Redis
 * opens what another sealed; else the per-process one.
 */
export function defaultSeal(governor: Governor): ApprovalSeal {
  const backend = governor.backend;
  if (typeof backend.approvalKey !== "function") return approvalSeal();
  let seal = SHARED_SEALS.get(backend);
  if (seal === undefined) {
    seal = loadedSeal(() => (backend.approvalKey as () => Promise<Uint8Array>).call(backend));
    SHARED_SEALS.set(backend, seal);
  }
  return seal;
}

/** `approvalTimeout` validated (seconds, more than 0, at most a day). */
export function approvalSeconds(timeout: unknown): number {
  if (typeof timeout !== "number" || !(timeout > 0 && timeout <= 86_400)) {
    throw new InvalidInputError("approval_timeout", timeout, "expected seconds, more than 0 and at most 86400");
  }
  return timeout;
}

/**
 * One governed call: identify, check (a refusal throws LimitExceeded and the
 * work never runs; `wait`: seconds a full concurrency cap may hold the call
 * for a slot first), reserve estimates, run, then charge: a completed call is
 * charged its price even past a cap; a failed one its fixed price.
 *
 * A price known before the work runs (`fixed`, with no `estimate`) is charged by
 * the admission itself, in its one round trip (Governor.admitted's `price`, on
 * Redis and in memory): a price that does not fit a limit the check consults
 * refuses the call, and an admitted call has paid, so nothing is charged after
 * the work, whatever it does (Python: flow.governed_call). A hard cap's estimates
 * are reserved by the admission the same way (`hold`): one round trip to admit
 * and reserve, one to settle.
 *
 * `estimate` (`{limit: amount}`) makes the call a hard cap: the estimates are
 * reserved after the check, all or nothing in one round trip (refused whole when
 * one does not fit, so two calls near their caps cannot each hold part and refuse
 * the other), and settled afterwards together, to what the call is charged; a
 * limit the charges do not name keeps its estimate.
 *
 * `ask(decision)` is asked when the check refuses by an OnExceed.ASK limit:
 * true admits the call over that limit (the ledger records the approval),
 * false refuses it as usual. A breaker never asks. `approved`: OnExceed.ASK
 * limits the user already let this call go over (an answer from an earlier
 * round, the 2026-07-28 protocol's `input_required`), and `approval` that
 * answer's one-time approval, spent with the admission (approval.ts).
 */
export async function governedCall<R>(
  governor: Governor,
  ctx: Context,
  work: () => Promise<R>,
  fixed: Charges | null,
  estimate: Charges | null,
  wait = 0,
  ask: Ask | null = null,
  signal?: AbortSignal,
  approved: readonly string[] = [],
  approval: Approval | null = null,
): Promise<R> {
  const caller = await governor.identified(ctx);
  const over = [...approved];
  // Cancelled before its check: nothing reached the counters, nothing to pay.
  if (signal?.aborted) throw signal.reason;
  const price = fixed !== null && Object.keys(fixed).length && !(estimate !== null && Object.keys(estimate).length) ? fixed : null;
  for (;;) {
    // A hard cap's estimates, reserved by the admission too (one round trip), but not
    // on a limit the user let this call go over: holding it there would refuse it again.
    const wanted = held(estimate, over);
    // admitted() hands back the decision, refused or not; a refused one holds no lease.
    const outcome = await governor.admitted(
      caller,
      async (decision, paid): Promise<{ refused: Decision } | { result: R }> => {
        if (!decision.admitted) return { refused: decision };
        const taken = decision.held !== null && wanted !== null ? Reservations.taken(governor, wanted, caller, decision) : null;
        // Paid with the admission: nothing is left to charge, whatever the work does.
        return { result: await run(governor, caller, work, paid ? null : fixed, wanted, taken, signal) };
      },
      { wait, approved: over, approval, price, hold: price === null ? wanted : null, ...(signal !== undefined && { signal }) },
    );
    if ("result" in outcome) return outcome.result;
    const decision = outcome.refused;
    const limit = ask === null ? null : askable(governor, decision, over);
    if (ask === null || limit === null || !(await ask(decision))) throw new (decision.refusalType())(decision);
    over.push(limit); // a refused check charged nothing: check again
  }
}

/** The estimates a call holds: the non-zero ones not on an approved limit (`estimate` itself when that is all of them); null for none. */
function held(estimate: Charges | null, approved: readonly string[]): Charges | null {
  if (estimate === null) return null;
  const wanted = Object.entries(estimate).filter(([limit, amount]) => amount !== 0 && !approved.includes(limit));
  if (!wanted.length) return null;
  return wanted.length === Object.keys(estimate).length ? estimate : Object.fromEntries(wanted);
}

/**
 * The admitted part of governedCall: reserve the estimates (one charge) unless the
 * admission did (`taken`), run, charge.
 * An admission always runs to its end (nothing interrupts a promise); a call whose
 * signal aborted meanwhile does not start its work and pays as one cancelled while
 * it ran (its fixed price, its reservation kept or settled to it), its slot given
 * back by admitted() at once (Python: governed_call).
 */
async function run<R>(
  governor: Governor,
  caller: Context,
  work: () => Promise<R>,
  fixed: Charges | null,
  wanted: Charges | null,
  taken: Reservations | null,
  signal?: AbortSignal,
): Promise<R> {
  // After the check: a reservation that fills its limit to the cap exactly must not
  // make that check refuse the very call it holds.
  const held: Reservations | null = taken ?? (wanted !== null ? await governor.reserveAll(wanted, caller) : null);
  const charge = async (): Promise<void> => {
    const rest: Charges = { ...(fixed ?? {}) };
    if (held !== null) {
      for (const name of held.limitNames) {
        if (name in rest) held.actual[name] = rest[name] ?? 0;
        delete rest[name];
      }
      await held.finish();
    }
    // Only the write is awaited: the reply comes off the response's path.
    if (Object.keys(rest).length) await governor.meterBehind(rest, caller);
  };
  let result: R;
  try {
    if (signal?.aborted) throw signal.reason; // cancelled during the admission
    result = await work();
  } catch (err) {
    await charge();
    throw err;
  }
  await charge();
  return result;
}

export function isRefusal(err: unknown): err is LimitExceeded {
  return err instanceof LimitExceeded;
}
