/**
 * The Governor: check before the work, meter after it (Python: governor.py, holds.py).
 *
 * @example
 * const governor = new Governor(
 *   Policy.of(new Limit("burst", { cap: 2, window: Window.MINUTE, scope: Scope.USER })),
 *   new MemoryBackend(),
 * );
 * (await governor.check(context({ user: "u_42" }))).status  // 200, 200, then 429
 */
import { spendOp, type Approval } from "./approval.js";
import { MemoryBackend } from "./backends/memory.js";
import { withCost, type Backend, type ChargeResult } from "./backends/types.js";
import { EMPTY, cacheable, context as makeContext, contextKey, type Context } from "./context.js";
import { ADMITTED, Decision, NOTHING_METERED, type MeterResult } from "./decision.js";
import {
  BackendBusyError,
  BackendUnavailableError,
  LimitExceeded,
  CounterOverflowError,
  GovernorError,
  InvalidInputError,
} from "./errors.js";
import { newId } from "./ledger/events.js";
import { EntryType, type Ledger, type LedgerCharge, type LedgerEntry, type TokenUsage } from "./ledger/types.js";
import { FailMode, OnExceed, type Limit, type Policy } from "./policy.js";
import { Unit, checkAmount } from "./money.js";
import * as planning from "./planning.js";
import type { CounterOp, Plan, Slot } from "./planning.js";
import type { PriceTable, Tokens } from "./prices.js";

export interface GovernorOptions {
  /** null/undefined commits every charge inline, in the same script that checks it. */
  ledger?: Ledger | null;
  /** Needed by meterTokens on USD limits. */
  prices?: PriceTable | null;
  /** Epoch seconds. */
  clock?: () => number;
  /** After the backend fails, how long (seconds) to use the fail modes before trying again. */
  retryInterval?: number;
  /** How long (seconds) a concurrency-cap lease outlives a process that died holding it. */
  leaseTtl?: number;
  maxPending?: number;
}

/** The longest `wait` (seconds) a call may wait for a concurrency slot (Python: MAX_WAIT). */
export const MAX_WAIT = 3600;

/** What check() and admitted() take besides the context. */
export interface CheckOptions {
  /** How many calls this one counts as on gated CALLS limits. */
  amount?: number;
  /** OnExceed.ASK limits the user let this call go over (the ledger records the approval). */
  approved?: readonly string[];
  /**
   * The one-time approval of an `approved` limit (approval.ts): spent with the
   * admission, in the same atomic charge; one spent already, or lapsed, and the
   * call is checked as if unapproved.
   */
  approval?: Approval | null;
  /**
   * Seconds a call refused by a full concurrency cap waits for a slot, first
   * come, first served across replicas and languages (lua/lib.lua
   * waiters_ahead); past it, the refusal (429, retry hint). 0: refuse at once.
   */
  wait?: number;
  /**
   * Aborted while the call waits for a slot (e.g. the MCP request was
   * cancelled): the call gives its place in the queue back at once and the
   * check throws the signal's reason.
   */
  signal?: AbortSignal;
}

/** What admitted() takes besides CheckOptions. */
export interface AdmittedOptions extends CheckOptions {
  /**
   * `{limit: amount}`: the call's fixed price, charged by the admission itself, in
   * the same round trip and all or nothing, when the backend can
   * (Backend.pricesAtAdmission; then `work` is told so). The ledger still gets two
   * events, the admission and a `metered` cost event with the price. A limit the
   * check consults refuses a price that does not fit (so concurrent calls never
   * take it past its cap); a metered-only limit is charged as a meter would. Once
   * admitted, the price is paid, whatever the call does next.
   */
  price?: Readonly<Record<string, number>> | null;
  /**
   * `{limit: amount}`, instead of `price`: a hard cap's estimates, reserved by the
   * admission in the same round trip (a `reserved` event after the admission's),
   * refused when one does not fit; the decision's `held` is then the reservation,
   * which the caller settles (Reservations.taken).
   */
  hold?: Readonly<Record<string, number>> | null;
}

/** What an admission charges beyond the check, validated once (its limits resolved), and its plan cache key. */
interface Price {
  readonly pairs: readonly (readonly [Limit, number])[];
  readonly key: string;
  /** A hard cap's estimates to reserve, not a price. */
  readonly hold: boolean;
}

/** @internal `wait` validated: seconds from 0 to MAX_WAIT, else the error naming it. */
export function waitSeconds(wait: unknown): number {
  if (typeof wait !== "number" || !(wait >= 0 && wait <= MAX_WAIT)) {
    throw new InvalidInputError("wait", wait, `expected seconds from 0 to ${MAX_WAIT}`);
  }
  return wait;
}

/** Sleep `ms`, or less when `signal` aborts meanwhile. */
function sleep(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve) => {
    const done = (): void => {
      clearTimeout(timer);
      signal?.removeEventListener("abort", done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    signal?.addEventListener("abort", done, { once: true });
  });
}

function local(limit: Limit): boolean {
  return limit.failMode === FailMode.OPEN && limit.localFallback;
}

/** An estimate held on a limit while work runs (Governor.reserve / reserved). */
export class Reservation {
  actual: number | null = null;
  decision: Decision | null = null;
  id: string | null = null;
  private slot: Slot | null = null;
  private released = false;
  private done = false;

  constructor(
    private readonly gov: Governor,
    readonly limit: Limit,
    readonly estimate: number,
    readonly ctx: Context,
  ) {}

  get settled(): boolean {
    return this.done;
  }

  /** Return the whole reservation when it ends (the work did not happen). */
  release(): void {
    this.released = true;
  }

  /** @internal */
  async enter(): Promise<this> {
    const [decision, eventId, slots] = await hold(this.gov, this.ctx, [[this.limit, this.estimate]]);
    this.decision = decision;
    if (!decision.admitted) throw new (decision.refusalType())(decision);
    this.slot = slots[0] ?? null;
    if (this.slot !== null) this.id = eventId;
    return this;
  }

  /** Settle to `actual` now; reports the limit's total. A reservation settles once. */
  async settle(actual: number): Promise<MeterResult> {
    if (!this.done) this.actual = checkAmount(actual, "actual");
    return this.finish(true);
  }

  /** @internal */
  async finish(report: boolean): Promise<MeterResult> {
    if (this.slot === null || this.done) return NOTHING_METERED;
    let final: number;
    let kind: EntryType;
    if (this.released) [final, kind] = [0, EntryType.RELEASED];
    else if (this.actual === null) [final, kind] = [this.estimate, EntryType.SETTLED]; // the estimate stands
    else [final, kind] = [checkAmount(this.actual, "actual"), EntryType.SETTLED];
    this.done = true;
    const s = planning.withAmount(this.slot, final - this.estimate);
    // Every reservation ends with one closing event, so the ledger can tell a closed
    // one from an open one; a zero delta with no ledger has nothing to do.
    if (s.amount === 0 && this.gov.ledger === null && !report) return NOTHING_METERED;
    const [before, degraded, cap] = await this.gov.record([s], this.ctx, kind, null, this.gov.now(), this.id, report);
    return planning.metered(s, before, degraded, cap);
  }
}

/**
 * Estimates held on several limits at once, for one call's hard caps
 * (Python: holds.Reservations; Governor.reserveAll).
 *
 * Entering reserves every estimate in one charge, all or nothing, as one
 * `reserved` event (throwing the refusal when one does not fit: nothing is
 * held then, so two calls near their caps cannot each hold part and refuse the
 * other). `actual[limit]` is what the call cost on that limit (a limit left out
 * keeps its estimate); finishing settles every limit in one charge and one
 * closing event naming the reservation, `settled` with the non-zero deltas
 * (none: no charges), or `released` after release().
 */
export class Reservations {
  readonly estimates: Readonly<Record<string, number>>;
  readonly actual: Record<string, number> = {};
  decision: Decision | null = null;
  id: string | null = null;
  private slots: readonly Slot[] = [];
  private released = false;
  private done = false;

  constructor(
    private readonly gov: Governor,
    estimates: Readonly<Record<string, number>>,
    readonly ctx: Context,
  ) {
    const checked: Record<string, number> = {};
    for (const [name, amount] of Object.entries(estimates)) checked[name] = checkAmount(amount, `estimate for '${name}'`);
    this.estimates = checked;
  }

  /**
   * The reservation an admission made with `hold` (`decision.held`): held
   * already, settled by finish() like one entered here (Python: Reservations.taken).
   */
  static taken(gov: Governor, estimates: Readonly<Record<string, number>>, ctx: Context, decision: Decision): Reservations {
    const held = new Reservations(gov, estimates, ctx);
    held.decision = decision;
    held.id = decision.held?.id ?? null;
    held.slots = decision.held?.slots ?? [];
    return held;
  }

  get limitNames(): ReadonlySet<string> {
    return new Set(Object.keys(this.estimates));
  }

  get settled(): boolean {
    return this.done;
  }

  /** Return every estimate when it ends (the work did not happen). */
  release(): void {
    this.released = true;
  }

  /** @internal */
  async enter(): Promise<this> {
    const policy = this.gov.policy;
    const wanted = Object.entries(this.estimates).map(([name, estimate]) => [planning.meteredLimit(policy, name), estimate] as const);
    const [decision, eventId, slots] = await hold(this.gov, this.ctx, wanted);
    this.decision = decision;
    if (!decision.admitted) throw new (decision.refusalType())(decision);
    this.slots = slots;
    this.id = eventId;
    return this;
  }

  /** Settle (or release) every limit, once, in one charge and one closing event. */
  async finish(): Promise<void> {
    if (!this.slots.length || this.done) return;
    this.done = true;
    const kind = this.released ? EntryType.RELEASED : EntryType.SETTLED;
    const deltas: Slot[] = [];
    for (const s of this.slots) {
      const name = s.limit.name;
      const final = this.released ? 0 : (this.actual[name] ?? s.amount);
      const delta = checkAmount(final, `actual for '${name}'`) - s.amount;
      if (delta) deltas.push(planning.withAmount(s, delta));
    }
    const gov = this.gov;
    if (!deltas.length && gov.ledger === null) return; // every estimate stands and nothing records the close
    // After the call, off its response's path: the charge is written at once on the
    // shared connection (this process's next command reaches the store after it) and
    // its reply awaited in the background; the ledger event is appended before this
    // returns (the durable point), as meterBehind does (Python: holds.Reservations).
    await gov.record(deltas, this.ctx, kind, null, gov.now(), this.id, false, true);
  }
}

/**
 * Reserve each [limit, estimate] of `wanted` that applies to `ctx` in one charge,
 * all or nothing, as one `reserved` event (Python: holds._hold): the decision, the
 * event's id and the slots held (none when refused, or when no limit applies).
 */
async function hold(
  gov: Governor,
  ctx: Context,
  wanted: readonly (readonly [Limit, number])[],
): Promise<[Decision, string | null, readonly Slot[]]> {
  const now = gov.now();
  const slots: Slot[] = [];
  for (const [limit, estimate] of wanted) {
    const s = planning.slot(limit, ctx, now, gov.policy.tz, estimate, planning.enforces(limit), gov.policy);
    if (s !== null) slots.push(s);
  }
  if (!slots.length) return [ADMITTED, null, []];
  const [decision, eventId] = await gov.admit(planning.planOf(slots), ctx, now, EntryType.RESERVED);
  return [decision, eventId, decision.admitted ? slots : []];
}

/** Enforces a Policy on shared counters. */
export class Governor {
  readonly ledger: Ledger | null;
  readonly prices: PriceTable | null;
  readonly leaseTtl: number;
  private readonly clock: () => number;
  private readonly retryInterval: number;
  private readonly fallback: MemoryBackend;
  private readonly pending: [string, CounterOp[]][] = [];
  private readonly maxPending: number;
  private downUntil = 0;
  private readonly detached = new Set<Promise<void>>();
  private flushing: Promise<void> | null = null;
  private plans = new Map<string, Plan>();
  private byObject = new WeakMap<Context, { minute: number; calls: number; price: Price | null; plan: Plan }>();
  private validPrices = new WeakMap<object, Price | null>();
  private validHolds = new WeakMap<object, Price | null>();
  policy: Policy;
  readonly backend: Backend;

  constructor(policy: Policy, backend: Backend | null = null, options: GovernorOptions = {}) {
    if (policy === null || typeof policy !== "object" || typeof (policy as Policy).capRef !== "function") {
      throw new InvalidInputError("policy", policy, "expected a Policy (use Policy.of(...))");
    }
    const ttl = options.leaseTtl ?? 30;
    if (typeof ttl !== "number" || !(ttl >= 0.01 && ttl <= 86_400)) {
      throw new InvalidInputError("lease_ttl", ttl, "expected seconds from 0.01 to 86400");
    }
    this.policy = policy;
    this.clock = options.clock ?? (() => Date.now() / 1000);
    this.backend = backend ?? new MemoryBackend(this.clock);
    this.ledger = options.ledger ?? null;
    this.prices = options.prices ?? null;
    this.leaseTtl = ttl;
    this.retryInterval = options.retryInterval ?? 1;
    this.maxPending = options.maxPending ?? 100_000;
    this.fallback = new MemoryBackend(this.clock);
  }

  /** @internal The governor's clock (epoch seconds). */
  now(): number {
    return this.clock();
  }

  /** Govern every call from now on by `policy`; returns the old one. */
  replacePolicy(policy: Policy): Policy {
    const old = this.policy;
    this.policy = policy;
    this.plans = new Map();
    this.byObject = new WeakMap();
    this.validPrices = new WeakMap();
    this.validHolds = new WeakMap();
    return old;
  }

  // -- the hot path ---------------------------------------------------------

  /**
   * Admit or refuse a call, charging every gated limit all or nothing, in one
   * round trip however many limits apply. A refusal charges nothing anywhere.
   * `wait`: see CheckOptions; use it through admitted(), which gives the slot back.
   */
  async check(ctx: Context | null = null, options: CheckOptions = {}): Promise<Decision> {
    return this.checked(ctx, options, null);
  }

  /** check(), charging `price` too when it is not null. */
  private async checked(ctx: Context | null, options: CheckOptions, price: Price | null): Promise<Decision> {
    const amount = options.amount ?? 1;
    if (amount !== 1) checkAmount(amount, "amount");
    const c = ctx ?? EMPTY;
    const approved = options.approved ?? [];
    const allowed = approved.length ? this.approvable(approved) : null;
    const approval = options.approval ?? null;
    if (options.wait !== undefined && waitSeconds(options.wait) > 0) return this.checkWaiting(c, amount, allowed, options.wait, options.signal, approval, price);
    const now = this.clock();
    if (allowed !== null) {
      const plan = spending(this.freshPlan(c, now, amount, allowed, price), approval, now);
      const decision = plan === null ? SPENT : (await this.admit(plan, c, now, EntryType.ADMITTED, [...allowed].sort()))[0];
      // Used already, or lapsed: the call as if unapproved.
      return decision === SPENT ? this.checked(c, { amount }, price) : decision;
    }
    const plan = this.plan(c, now, amount, price);
    if (this.ledger === null && !plan.slots.length) return ADMITTED;
    return (await this.admit(plan, c, now, EntryType.ADMITTED))[0];
  }

  private approvable(approved: readonly string[]): Set<string> {
    for (const name of approved) {
      if (this.policy.get(name).onExceed !== OnExceed.ASK) {
        throw new InvalidInputError("approved", name, "only an on_exceed=ASK limit can be approved");
      }
    }
    return new Set(approved);
  }

  /**
   * check() retried while a concurrency cap refuses, holding a place in the
   * caps' queues (Python: admission._waiting): a slot that frees goes to
   * the oldest waiter on every replica, whatever its language, because
   * lua/charge.lua admits nobody else while it waits ahead. The retries back
   * off from 5 ms to 100 ms; only the outcome reaches the ledger.
   */
  private async checkWaiting(
    ctx: Context,
    amount: number,
    allowed: Set<string> | null,
    wait: number,
    signal: AbortSignal | undefined,
    approval: Approval | null = null,
    price: Price | null = null,
  ): Promise<Decision> {
    const ticket = `${newId()}/${Math.ceil(wait * 1000)}`;
    const deadline = performance.now() + wait * 1000;
    const approved = allowed === null ? [] : [...allowed].sort();
    let delay = 5;
    let queued: readonly string[] = [];
    for (;;) {
      if (signal?.aborted) {
        await this.leave(queued, ticket); // a cancelled call holds nobody back
        throw signal.reason;
      }
      const now = this.clock();
      const plan = allowed !== null ? spending(this.freshPlan(ctx, now, amount, allowed, price), approval, now) : this.plan(ctx, now, amount, price);
      const left0 = Math.max((deadline - performance.now()) / 1000, 0.001);
      if (plan === null) return this.checkWaiting(ctx, amount, null, left0, signal, null, price); // lapsed: as if unapproved
      const [decision, eventId] = await this.admit(plan, ctx, now, EntryType.ADMITTED, approved, plan.leases.length ? ticket : null, false);
      if (decision === SPENT) {
        await this.leave(plan.leases, ticket);
        return this.checkWaiting(ctx, amount, null, left0, signal, null, price); // used already: wait as if unapproved
      }
      if (decision.admitted) return decision;
      queued = plan.leases;
      const left = deadline - performance.now();
      const full = decision.limit !== null && this.policy.get(decision.limit).concurrent;
      if (left <= 0 || !plan.leases.length || !full || decision.status === 503) {
        await this.leave(plan.leases, ticket);
        if (eventId !== null) await this.logAdmission(eventId, EntryType.ADMITTED, now, ctx, plan, decision, []);
        return decision;
      }
      await sleep(Math.min(delay, left), signal);
      delay = Math.min(delay * 2, 100);
    }
  }

  /** Take a waiting call that gives up out of the queues (else its place holds until its wait ends). */
  private async leave(leases: readonly string[], ticket: string): Promise<void> {
    if (!leases.length) return;
    await this.fallback.leave(leases, ticket);
    try {
      await this.backend.leave(leases, ticket);
    } catch (err) {
      if (!storeFailed(err)) throw err;
    }
  }

  /**
   * check() for the duration of `work(decision)` (Python: Governor.admitted): the
   * decision is what check() returns, refused or admitted, never thrown for a
   * refusal, so `work` starts with `decision.raiseForStatus()` or tests
   * `decision.admitted`. Admitted, its concurrency-cap leases are renewed every
   * third of leaseTtl while `work` runs and given back however it ends (a refused
   * decision holds none). `options.wait`: seconds to wait for a concurrency slot
   * (see CheckOptions). `options.price`: the call's fixed price, charged with
   * the admission when the backend can (see AdmittedOptions); `work`'s second
   * argument says whether it was (then nothing is left to charge for it).
   */
  async admitted<R>(
    ctx: Context | null,
    work: (decision: Decision, priceCharged: boolean) => Promise<R>,
    options: AdmittedOptions = {},
  ): Promise<R> {
    let price: Price | null = null;
    if (this.pricesAtAdmission) {
      if (options.price) price = this.validPrice(options.price, false);
      else if (options.hold) price = this.validPrice(options.hold, true);
    }
    const decision = await this.checked(ctx, options, price);
    let timer: NodeJS.Timeout | undefined;
    if (decision.lease !== null) {
      timer = setInterval(() => {
        this.renew(decision).catch(() => undefined);
      }, (this.leaseTtl * 1000) / 3);
      timer.unref();
    }
    try {
      return await work(decision, price !== null && !price.hold && decision.admitted);
    } finally {
      if (timer !== undefined) clearInterval(timer);
      await this.release(decision);
    }
  }

  /**
   * Whether admitted() charges a fixed price in its admission's round trip (the
   * backend writes one charge under two event ids, lua/charge.lua); else the
   * integrations meter it after the call.
   */
  get pricesAtAdmission(): boolean {
    return this.backend.pricesAtAdmission === true;
  }

  /** `price` validated whole before anything is charged (an unknown limit throws), its zeros left out; null when nothing is left. */
  private validPrice(price: Readonly<Record<string, number>>, hold: boolean): Price | null {
    const seen = hold ? this.validHolds : this.validPrices;
    let valid = seen.get(price);
    if (valid === undefined) {
      const field = hold ? "hold" : "price";
      const pairs = Object.entries(price)
        .map(([name, amount]) => [planning.meteredLimit(this.policy, name), checkAmount(amount, `${field}['${name}']`)] as const)
        .filter(([, amount]) => amount !== 0);
      valid = pairs.length ? { pairs, key: `${field}:${pairs.map(([l, n]) => `${l.name}=${n}`).join(",")}`, hold } : null;
      seen.set(price, valid);
    }
    return valid;
  }

  /** Give back the concurrency-cap leases of an admitted decision (never throws for an outage). */
  async release(decision: Decision): Promise<void> {
    const lease = decision.lease;
    if (lease === null) return;
    await this.fallback.release(lease.keys, lease.id);
    try {
      await this.backend.release(lease.keys, lease.id);
    } catch (err) {
      if (!storeFailed(err)) throw err;
    }
  }

  /** Extend the leases of `decision` by leaseTtl; false when one had expired. */
  async renew(decision: Decision): Promise<boolean> {
    const lease = decision.lease;
    if (lease === null) return true;
    await this.fallback.renew(lease.keys, lease.id, this.leaseTtl);
    try {
      return (await this.backend.renew(lease.keys, lease.id, this.leaseTtl)) === lease.keys.length;
    } catch (err) {
      if (storeFailed(err)) return false;
      throw err;
    }
  }

  /** Policy.identified for a caller, with a refusal recorded in the ledger. */
  async identified(ctx: Context): Promise<Context> {
    try {
      return this.policy.identified(ctx);
    } catch (err) {
      if (err instanceof LimitExceeded && this.ledger !== null) {
        const d = err.decision;
        await this.append(newId(), EntryType.REJECTED, this.clock(), ctx, [], { limit: d.limit, status: d.status, over: d.over });
      }
      throw err;
    }
  }

  /** Hold `estimate` on `limit` until settle(); throws the refusal when it does not fit. */
  async reserve(limit: string, estimate: number, ctx: Context | null = null): Promise<Reservation> {
    const r = new Reservation(this, planning.meteredLimit(this.policy, limit), checkAmount(estimate, "estimate"), ctx ?? EMPTY);
    return r.enter();
  }

  /**
   * Hold `{limit: estimate}` on several limits at once, all or nothing in one round
   * trip, until `finish()`; throws the refusal when one does not fit (nothing held).
   */
  async reserveAll(estimates: Readonly<Record<string, number>>, ctx: Context | null = null): Promise<Reservations> {
    return new Reservations(this, estimates, ctx ?? EMPTY).enter();
  }

  /**
   * Reserve `estimate` on `limit` while `work(reservation)` runs; settles on exit
   * to `reservation.actual` (left unset, the estimate stands).
   */
  async reserved<R>(limit: string, estimate: number, ctx: Context | null, work: (r: Reservation) => Promise<R>): Promise<R> {
    const r = await this.reserve(limit, estimate, ctx);
    try {
      return await work(r);
    } finally {
      await r.finish(false);
    }
  }

  /** Settle `reservation` to the real cost (never refused: the money is spent). */
  async settle(reservation: Reservation, actual: number): Promise<MeterResult> {
    return reservation.settle(actual);
  }

  /** Charge `amount` to one limit (or several: one event), never refused. */
  async meter(limit: string | readonly string[], amount: number, ctx: Context | null = null): Promise<MeterResult> {
    const limits = planning.namedLimits(this.policy, limit);
    checkAmount(amount, "amount");
    return this.meterPairs(limits.map((l) => [l, amount] as const), ctx ?? EMPTY, null);
  }

  /**
   * meterCharges() without waiting for the counters' reply (Python:
   * Governor.meter_behind): the charge is written on the backend's shared
   * connection before this returns (so the next check of this process reaches
   * the store after it and sees it), and the ledger event is appended as usual;
   * only the reply is awaited in the background, a failure counted locally and
   * kept for later as a waited one would be. A backend that cannot write at once
   * (Postgres, memory, not connected, marked down) is awaited. close() waits for
   * the replies.
   */
  async meterBehind(charges: Readonly<Record<string, number>>, ctx: Context | null = null): Promise<void> {
    const pairs = Object.entries(charges).map(
      ([name, amount]) => [planning.meteredLimit(this.policy, name), checkAmount(amount, `charges['${name}']`)] as const,
    );
    const c = ctx ?? EMPTY;
    const now = this.clock();
    const slots = planning.meterSlots(pairs, c, now, this.policy);
    if (slots.length) await this.record(slots, c, EntryType.METERED, null, now, null, false, true);
  }

  /** Charge several limits as one event: `{limit: amount}`. */
  async meterCharges(charges: Readonly<Record<string, number>>, ctx: Context | null = null): Promise<void> {
    const pairs = Object.entries(charges).map(
      ([name, amount]) => [planning.meteredLimit(this.policy, name), checkAmount(amount, `charges['${name}']`)] as const,
    );
    await this.meterPairs(pairs, ctx ?? EMPTY, null);
  }

  /** Price a model call (USD limits) or count its tokens (TOKENS limits) and meter it. */
  async meterTokens(limit: string | readonly string[], model: string, tokens: Tokens, ctx: Context | null = null): Promise<MeterResult> {
    const limits = planning.namedLimits(this.policy, limit);
    const t = {
      inputTokens: checkAmount(tokens.inputTokens, "input_tokens"),
      outputTokens: checkAmount(tokens.outputTokens, "output_tokens"),
      cacheReadTokens: checkAmount(tokens.cacheReadTokens ?? 0, "cache_read_tokens"),
      cacheWriteTokens: checkAmount(tokens.cacheWriteTokens ?? 0, "cache_write_tokens"),
    };
    let cost = 0;
    let priceVersion: string | null = null;
    // Priced first unless every limit counts tokens: a CALLS limit is refused below,
    // after a missing table or an unknown model (the order Python checks in).
    if (limits.some((l) => l.unit !== Unit.TOKENS)) {
      if (this.prices === null) {
        throw new GovernorError(
          "prices: meterTokens needs a price table to price a model call: prices: PriceTable.builtin() or new PriceTable().withPrice(...)",
        );
      }
      cost = this.prices.costMicros(model, t);
      priceVersion = this.prices.version;
    }
    for (const lim of limits) {
      if (lim.unit !== Unit.USD_MICROS && lim.unit !== Unit.TOKENS) {
        throw new InvalidInputError("limit", lim.name, "meter_tokens needs a TOKENS or USD_MICROS limit, not CALLS");
      }
    }
    const count = limits.some((l) => l.unit === Unit.TOKENS) ? checkAmount(t.inputTokens + t.outputTokens, "input_tokens + output_tokens") : 0;
    const usage: TokenUsage = { model, ...t, priceVersion };
    return this.meterPairs(
      limits.map((l) => [l, l.unit === Unit.USD_MICROS ? cost : count] as const),
      ctx ?? EMPTY,
      usage,
    );
  }

  /** What `limit` has counted in the current window for `ctx` (committed + in-flight). */
  async usage(limit: string, ctx: Context | null = null): Promise<number> {
    const c = ctx ?? EMPTY;
    const lim = this.policy.get(limit);
    const s = planning.slot(lim, c, this.clock(), this.policy.tz, 0, false, this.policy);
    if (s === null) {
      const missing = lim.dimensions.filter((d) => (d === "session" ? c.session : c[d]) == null);
      throw new InvalidInputError("ctx", c, `lacks ${missing.join("+")} for limit '${limit}'`);
    }
    await this.flushPending();
    if (lim.concurrent) return (await this.backend.inProgress([s.key]))[0] ?? 0;
    return (await this.backend.usage([s.key]))[0] ?? 0;
  }

  /** Flush what can be flushed and close the backend and ledger. */
  async close(): Promise<void> {
    await Promise.allSettled([...this.detached]); // meterBehind's replies
    try {
      await this.flushPending();
    } catch (err) {
      if (!storeFailed(err)) throw err;
    }
    if (this.ledger !== null) await this.ledger.close();
    await this.backend.close();
  }

  // -- internals ------------------------------------------------------------

  private plan(ctx: Context, now: number, calls: number, price: Price | null = null): Plan {
    const minute = Math.floor(now / 60);
    // A caller reusing its context object (a frozen value) skips even the cache key.
    const mine = this.byObject.get(ctx);
    if (mine !== undefined && mine.minute === minute && mine.calls === calls && mine.price === price) return mine.plan;
    const plan = this.planByKey(ctx, now, calls, minute, price);
    this.byObject.set(ctx, { minute, calls, price, plan });
    return plan;
  }

  private planByKey(ctx: Context, now: number, calls: number, minute: number, price: Price | null): Plan {
    const key = `${contextKey(ctx)}|${minute}|${calls}${price === null ? "" : `|${price.key}`}`;
    let plan = this.plans.get(key);
    if (plan === undefined) {
      plan = this.freshPlan(ctx, now, calls, new Set(), price);
      if (cacheable(ctx)) {
        if (this.plans.size >= 4096) this.plans.clear();
        this.plans.set(key, plan);
      }
    }
    return plan;
  }

  /** The check's plan, charging `price` too (planning.withPrice). */
  private freshPlan(ctx: Context, now: number, calls: number, allowed: ReadonlySet<string>, price: Price | null): Plan {
    const plan = planning.checkPlan(this.policy, ctx, now, calls, allowed);
    return price === null ? plan : planning.withPrice(plan, planning.meterSlots(price.pairs, ctx, now, this.policy), price.hold);
  }

  /**
   * @internal The admission step of check() and reserve(), one round trip.
   * `ticket`: a waiting call's place in the concurrency caps' queues; not
   * `recordRefusal`, only an admission goes to the ledger (the waiting call
   * records its one refusal when it gives up).
   */
  async admit(
    plan: Plan,
    ctx: Context,
    now: number,
    kind: EntryType,
    approved: readonly string[] = [],
    ticket: string | null = null,
    recordRefusal = true,
  ): Promise<[Decision, string | null]> {
    if (this.ledger !== null && this.ledger.accepting === false) return [planning.ledgerFull(this.retryInterval), null];
    const eventId = this.ledger !== null ? newId() : null;
    const opId = eventId === null ? newId() : null;
    const lease = plan.leases.length ? newId() : null;
    // A fixed price charged with the admission: its in-flight amounts belong to the
    // cost event (its own id), so the projection moves each exactly once.
    const costId = eventId !== null && plan.cost ? newId() : null;
    const charged = eventId !== null && costId !== null ? withCost(eventId, costId, plan.slots.length - plan.cost) : eventId;
    let decision: Decision;
    const n = plan.slots.length;
    try {
      let result = await this.charge(plan.ops, charged, true, opId, lease, ticket);
      if (plan.ops.length > n) {
        // An approval's marker came last: refused there, the approval was spent already.
        if (result.refused >= n) return [SPENT, null];
        result = { refused: result.refused, used: result.used.slice(0, n), caps: result.caps.slice(0, n) };
      }
      decision = result.refused < 0 ? planning.admitted(plan.slots, result.used, false, result.caps) : this.decide(plan.slots, result, now);
    } catch (err) {
      // Busy is overload, not an outage: refused, never decided by the fail mode (an
      // approval stays unspent: nothing was charged).
      if (err instanceof BackendBusyError) decision = planning.busy(err.store, this.retryInterval);
      else {
        if (!(err instanceof BackendUnavailableError)) throw err;
        if (plan.ops.length > n) return [SPENT, null]; // an approval is spent only where it is counted
        decision = await this.degradedCheck(plan.slots, now, opId, lease, ticket);
      }
    }
    if (plan.cost && decision.over.length) decision = notOverOnPrice(plan, decision);
    if (lease !== null && decision.admitted) decision = decision.with({ lease: { id: lease, keys: plan.leases } });
    if (eventId !== null && (recordRefusal || decision.admitted)) await this.logAdmission(eventId, kind, now, ctx, plan, decision, approved);
    if (costId !== null && decision.admitted) {
      // The price's (or the reservation's) own event, after the admission's.
      await this.append(costId, plan.holds ? EntryType.RESERVED : EntryType.METERED, now, ctx, plan.costCharges, { degraded: decision.degraded });
    }
    if (plan.holds && decision.admitted) decision = decision.with({ held: { id: costId, slots: plan.slots.slice(plan.slots.length - plan.cost) } });
    return [decision, eventId];
  }

  /** The ledger entry of an admission step: `kind`, or a rejection. */
  private async logAdmission(
    eventId: string,
    kind: EntryType,
    now: number,
    ctx: Context,
    plan: Plan,
    decision: Decision,
    approved: readonly string[],
  ): Promise<void> {
    if (this.ledger === null) return;
    const ok = decision.admitted;
    await this.ledger.append(
      entry(eventId, ok ? kind : EntryType.REJECTED, now, ctx, ok ? plan.charges : [], {
        limit: decision.limit,
        status: decision.status,
        over: decision.over,
        degraded: decision.degraded,
        approved: ok ? approved : [],
        // The projection marks it spent (Python: events.Spent), as the marker above.
        spent: ok && plan.spends !== undefined && approved.includes(plan.spends.limit) ? [plan.spends] : [],
      }),
    );
  }

  private decide(slots: readonly Slot[], result: ChargeResult, now: number): Decision {
    const remaining = result.used.length ? planning.headroom(slots, result.used, false, result.caps) : {};
    const s = slots[result.refused];
    if (s === undefined) throw new GovernorError(`backend refused op ${result.refused} of ${slots.length}`);
    return planning.refused(s, now, false, remaining);
  }

  private async charge(
    ops: readonly CounterOp[],
    eventId: string | null,
    wantUsed: boolean,
    opId: string | null,
    lease: string | null = null,
    ticket: string | null = null,
  ): Promise<ChargeResult> {
    if (this.downUntil) {
      if (this.clock() < this.downUntil) throw new BackendUnavailableError("backend marked down; retrying later");
      await this.flushPending();
    } else if (this.pending.length) await this.flushPending(); // kept while the store was busy
    try {
      return await this.backend.charge(ops, { eventId, wantUsed, opId, lease, leaseTtl: this.leaseTtl, ticket });
    } catch (err) {
      if (err instanceof BackendUnavailableError) this.markDown();
      throw err;
    }
  }

  private markDown(): void {
    this.downUntil = this.clock() + this.retryInterval;
  }

  /**
   * Replay the charges kept while the store was away, each once: concurrent
   * callers share one flush (each shifting the head after its own replay would
   * drop charges never replayed).
   */
  private flushPending(): Promise<void> {
    this.flushing ??= this.flushOnce().finally(() => {
      this.flushing = null;
    });
    return this.flushing;
  }

  private async flushOnce(): Promise<void> {
    while (this.pending.length) {
      const [opId, ops] = this.pending[0] ?? ["", []];
      try {
        await this.backend.charge(ops, { wantUsed: false, opId });
      } catch (err) {
        if (err instanceof BackendUnavailableError) {
          this.markDown();
          throw err;
        }
        if (!(err instanceof CounterOverflowError)) throw err;
      }
      this.pending.shift();
    }
    this.downUntil = 0;
  }

  private keepForLater(slots: readonly Slot[], opId: string | null): void {
    if (this.ledger !== null || opId === null) return;
    const ops = slots
      .filter((s) => s.amount && !s.limit.concurrent)
      .map((s) => ({ key: s.key, amount: s.amount, cap: s.limit.cap, enforce: false, expireAt: s.expireAt, ref: null }));
    if (!ops.length) return;
    if (this.pending.length >= this.maxPending) this.pending.shift();
    this.pending.push([opId, ops]);
  }

  private async degradedCheck(
    slots: readonly Slot[],
    now: number,
    opId: string | null,
    lease: string | null,
    ticket: string | null = null,
  ): Promise<Decision> {
    for (const s of slots) {
      if (s.enforce && s.limit.failMode === FailMode.CLOSED) return planning.unavailable(s, this.retryInterval);
    }
    const localSlots = slots.filter((s) => local(s.limit));
    const result = await this.fallback.charge(localSlots.map(planning.opOf), { lease, leaseTtl: this.leaseTtl, ticket });
    if (result.refused >= 0) {
      const s = localSlots[result.refused];
      if (s !== undefined) {
        return planning.refused(s, now, true, planning.headroom(localSlots, result.used, false));
      }
    }
    this.keepForLater(slots, opId);
    return planning.admitted(localSlots, result.used, true);
  }

  private async meterPairs(charges: readonly (readonly [Limit, number])[], ctx: Context, usage: TokenUsage | null): Promise<MeterResult> {
    const now = this.clock();
    const slots = planning.meterSlots(charges, ctx, now, this.policy);
    const first = slots[0];
    if (first === undefined) return NOTHING_METERED;
    const [before, degraded, cap] = await this.record(slots, ctx, EntryType.METERED, usage, now, null, true);
    return planning.metered(first, before, degraded, cap);
  }

  /** @internal Charge `slots` in one call and append them as one ledger event. */
  async record(
    slots: readonly Slot[],
    ctx: Context,
    kind: EntryType,
    usage: TokenUsage | null,
    now: number,
    reservation: string | null,
    wantUsed: boolean,
    detach = false,
  ): Promise<[number | null, boolean, number | null]> {
    let cap: number | null = null;
    const eventId = this.ledger !== null ? newId() : null;
    const opId = eventId === null ? newId() : null;
    let degraded = false;
    let before: number | null = null;
    // Nothing to count or read (a settlement's zero delta): no round trip.
    const idle = !wantUsed && slots.every((s) => s.amount === 0);
    const sent = detach && !idle ? this.sent(slots, eventId, opId) : null;
    if (sent !== null) {
      const reply: Promise<void> = sent.then(
        () => undefined,
        (err: unknown) => this.detachedFailed(err, slots, opId),
      );
      this.detached.add(reply);
      void reply.finally(() => this.detached.delete(reply));
    } else if (!idle) {
      try {
        const result = await this.charge(slots.map(planning.opOf), eventId, wantUsed, opId);
        if (wantUsed && result.used.length) {
          before = result.used[0] ?? null;
          cap = result.caps.length ? (result.caps[0] ?? null) : null;
        }
      } catch (err) {
        if (!storeFailed(err)) throw err;
        degraded = true;
        const localOps = slots.filter((s) => local(s.limit)).map(planning.opOf);
        if (localOps.length) {
          const fb = await this.fallback.charge(localOps);
          if (slots[0] !== undefined && local(slots[0].limit)) before = fb.used[0] ?? null;
        }
        this.keepForLater(slots, opId);
      }
    }
    if (eventId !== null) {
      await this.append(eventId, kind, now, ctx, planning.ledgerCharges(slots), { usage, degraded, reservation });
    }
    return [before, degraded, cap];
  }

  /** The charge written at once, its reply not awaited (Backend.chargeSent), or null. */
  private sent(slots: readonly Slot[], eventId: string | null, opId: string | null): Promise<ChargeResult> | null {
    if (this.downUntil || this.pending.length || typeof this.backend.chargeSent !== "function") return null;
    return this.backend.chargeSent(slots.map(planning.opOf), { eventId, wantUsed: false, opId });
  }

  /** The reply of a charge nobody waits for failed: it goes where a waited one's failure would. */
  private async detachedFailed(err: unknown, slots: readonly Slot[], opId: string | null): Promise<void> {
    if (!storeFailed(err)) {
      process.emitWarning(`mcp-budget-governor: a charge metered without waiting failed: ${String(err)}`);
      return;
    }
    if (err instanceof BackendUnavailableError) this.markDown();
    const localOps = slots.filter((s) => local(s.limit)).map(planning.opOf);
    if (localOps.length) await this.fallback.charge(localOps);
    this.keepForLater(slots, opId);
  }

  private async append(
    id: string,
    kind: EntryType,
    now: number,
    ctx: Context,
    charges: readonly LedgerCharge[],
    extra: Partial<LedgerEntry>,
  ): Promise<void> {
    if (this.ledger === null) return;
    await this.ledger.append(entry(id, kind, now, ctx, charges, extra));
  }
}

function entry(
  id: string,
  type: EntryType,
  time: number,
  ctx: Context,
  charges: readonly LedgerCharge[],
  extra: Partial<LedgerEntry>,
): LedgerEntry {
  return {
    id,
    type,
    time,
    context: ctx,
    charges,
    limit: extra.limit ?? null,
    status: extra.status ?? 200,
    over: extra.over ?? [],
    usage: extra.usage ?? null,
    degraded: extra.degraded ?? false,
    reservation: extra.reservation ?? null,
    change: null,
    approved: extra.approved ?? [],
    spent: extra.spent ?? [],
  };
}

/**
 * `decision` without the metered-only limits its price went over: `over` names
 * shadow limits of the check; a price past a metered-only cap is charged, as a
 * meter charges it (Python: admission._not_over_on_price).
 */
function notOverOnPrice(plan: Plan, decision: Decision): Decision {
  const meteredOnly = new Set(plan.slots.slice(plan.slots.length - plan.cost).filter((s) => !(s.limit.gated || s.limit.breaker)).map((s) => s.limit.name));
  const over = decision.over.filter((name) => !meteredOnly.has(name));
  return over.length === decision.over.length ? decision : decision.with({ over });
}

/** What admit() answers when the approval it was to spend was spent already (or
 * cannot be spent: the counters unreachable); nothing was charged. */
const SPENT = new Decision({ admitted: false, reason: "approval_spent" });

/**
 * `plan` that also spends `approval` (approval.ts spendOp) in the same atomic
 * charge, its marker last; null when it has lapsed (in real time, whatever the
 * governor's clock `now`, which the store's expiries follow).
 */
function spending(plan: Plan, approval: Approval | null, now: number): Plan | null {
  if (approval === null) return plan;
  const wall = Date.now() / 1000;
  if (approval.until <= wall) return null;
  const spends = { limit: approval.limit, once: approval.once, until: approval.until };
  return { ...plan, ops: [...plan.ops, spendOp(approval, now - wall)], spends };
}

export { makeContext as context };

/** The store could not do it now: unreachable, or up but busy (neither is a bug). */
function storeFailed(err: unknown): boolean {
  return err instanceof BackendUnavailableError || err instanceof BackendBusyError;
}
