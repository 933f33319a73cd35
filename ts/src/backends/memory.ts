/**
 * Counters in this process (Python: projections/counters/memory.py): the same
 * counter model as lua/, for one process, tests, and the fail-open fallback.
 * Caps resolve from the policy (value caps, the policy's plan assignments);
 * run-time cap changes live only in a shared store.
 *
 * @example
 * const governor = new Governor(policy, new MemoryBackend());
 */
import { CounterOverflowError } from "../errors.js";
import { LEASE_PREFIX } from "../keys.js";
import { MAX_AMOUNT } from "../money.js";
import { fits, type CounterOp } from "../planning.js";
import type { CapRef } from "../policy.js";
import { ADMITTED_RESULT, splitCost, type Backend, type ChargeOptions, type ChargeResult } from "./types.js";

const OP_HORIZON_SECONDS = 900;

interface Counter {
  c: number;
  f: number;
  g: number;
  events: Map<string, number>;
  expireAt: number;
}

function exact(v: number): boolean {
  return v >= -MAX_AMOUNT && v <= MAX_AMOUNT;
}

function staysExact(c: number, f: number, amount: number, inline: boolean): boolean {
  if (inline) c += amount;
  else f += amount;
  return exact(c) && exact(f) && exact(c + f);
}

function effectiveCap(ref: CapRef | null, fallback: number): number {
  if (ref === null || ref.field === "") return fallback;
  if (ref.valueCap !== null) return ref.valueCap;
  if (ref.filePlan !== null) {
    const hit = ref.planCaps.find(([name]) => name === ref.filePlan);
    if (hit !== undefined) return hit[1];
  }
  return fallback;
}

export class MemoryBackend implements Backend {
  /** One charge may admit a call and charge its fixed price under two event ids (withCost). */
  readonly pricesAtAdmission = true;
  private readonly counters = new Map<string, Counter>();
  private readonly leases = new Map<string, Map<string, number>>();
  private readonly ops = new Map<string, number>();
  /** Lease set key -> waiting ticket -> [arrival, deadline] (epoch s), in arrival
   * order (a Map keeps insertion order): lua/lib.lua's queues. */
  private readonly queues = new Map<string, Map<string, [number, number]>>();

  constructor(private readonly clock: () => number = () => Date.now() / 1000) {}

  private counter(key: string): Counter | undefined {
    const c = this.counters.get(key);
    if (c !== undefined && c.expireAt <= this.clock()) {
      this.counters.delete(key);
      return undefined;
    }
    return c;
  }

  private live(key: string): number {
    const set = this.leases.get(key);
    if (set === undefined) return 0;
    const nowMs = this.clock() * 1000;
    for (const [id, until] of set) if (until <= nowMs) set.delete(id);
    return set.size;
  }

  /** Live waiters before `ticket` (null: all) in the queue of lease set `key`, at
   * most `room` (lib.lua waiters_ahead). */
  private ahead(key: string, ticket: string | null, room: number, now: number): number {
    const queue = this.queues.get(key);
    if (queue === undefined) return 0;
    for (const [t, [, until]] of queue) if (until <= now) queue.delete(t);
    let ahead = 0;
    for (const t of queue.keys()) {
      if (t === ticket || ahead >= room) break;
      ahead++;
    }
    return ahead;
  }

  async charge(ops: readonly CounterOp[], options: ChargeOptions = {}): Promise<ChargeResult> {
    const now = this.clock();
    const opId = options.eventId == null ? (options.opId ?? null) : null;
    if (opId !== null) {
      const seen = this.ops.get(opId);
      if (seen !== undefined && seen > now) return ADMITTED_RESULT;
    }
    const eventId = options.eventId ?? "";
    const inline = eventId === "";
    const used: number[] = [];
    const caps: number[] = [];
    const resolve = ops.some((op) => op.ref !== null);
    let refusedAt = -1;
    const ticket = options.ticket ?? null;
    const queued = ops.map((op) => options.lease != null && op.key.startsWith(LEASE_PREFIX));
    ops.forEach((op, i) => {
      let total: number;
      let cap = op.cap;
      let waiting = 0;
      if (queued[i] === true) {
        total = this.live(op.key);
        if (cap > total) waiting = this.ahead(op.key, ticket, cap - total, now);
      } else {
        const c = this.counter(op.key);
        if (c !== undefined && !staysExact(c.c, c.f, 0, inline)) throw new CounterOverflowError(op.key.split(":")[2] ?? "", op.amount, op.key, MAX_AMOUNT);
        total = c === undefined ? 0 : c.c + c.f;
        if (resolve) cap = effectiveCap(op.ref, op.cap) + (c?.g ?? 0);
      }
      used.push(total);
      caps.push(cap);
      if (refusedAt < 0 && op.enforce && !fits(total + waiting, op.amount, cap)) refusedAt = i;
    });
    const result: ChargeResult = { refused: refusedAt, used: options.wantUsed === false ? [] : used, caps: resolve && options.wantUsed !== false ? caps : [] };
    if (refusedAt >= 0) {
      // Only a full lease set is worth waiting for: then the ticket joins every queue of the call.
      if (ticket !== null && queued[refusedAt] === true) {
        const waitS = Number(ticket.slice(ticket.lastIndexOf("/") + 1)) / 1000;
        ops.forEach((op, i) => {
          if (queued[i] !== true) return;
          let queue = this.queues.get(op.key);
          if (queue === undefined) this.queues.set(op.key, (queue = new Map()));
          if (!queue.has(ticket)) queue.set(ticket, [now, now + waitS]);
        });
      }
      return result;
    }
    for (const op of ops) {
      if (op.key.startsWith(LEASE_PREFIX)) continue;
      const c = this.counter(op.key);
      if (c !== undefined && !staysExact(c.c, c.f, op.amount, inline)) {
        throw new CounterOverflowError(op.key.split(":")[2] ?? "", op.amount, op.key, MAX_AMOUNT);
      }
    }
    let wrote = false;
    // An admission charging the call's price too: counters from costFrom on are the
    // cost event's in-flight amounts (lua/charge.lua, withCost).
    let [owner, costId, costFrom] = [eventId, eventId, ops.length];
    if (eventId.includes(" ")) [owner, costId, costFrom] = splitCost(eventId);
    for (const [i, op] of ops.entries()) {
      if (options.lease != null && op.key.startsWith(LEASE_PREFIX)) {
        let set = this.leases.get(op.key);
        if (set === undefined) this.leases.set(op.key, (set = new Map()));
        set.set(options.lease, now * 1000 + (options.leaseTtl ?? 30) * 1000);
        if (ticket !== null) this.queues.get(op.key)?.delete(ticket);
        continue;
      }
      if (op.amount === 0) continue;
      let c = this.counter(op.key);
      if (c === undefined) this.counters.set(op.key, (c = { c: 0, f: 0, g: 0, events: new Map(), expireAt: op.expireAt }));
      if (inline) c.c += op.amount;
      else {
        c.f += op.amount;
        const id = i >= costFrom ? costId : owner;
        c.events.set(id, (c.events.get(id) ?? 0) + op.amount);
      }
      c.expireAt = op.expireAt;
      wrote = true;
    }
    if (opId !== null && wrote) this.ops.set(opId, now + OP_HORIZON_SECONDS);
    return result;
  }

  async usage(keys: readonly string[]): Promise<number[]> {
    return keys.map((k) => {
      const c = this.counter(k);
      return c === undefined ? 0 : c.c + c.f;
    });
  }

  async release(keys: readonly string[], lease: string): Promise<number> {
    let n = 0;
    for (const k of keys) if (this.leases.get(k)?.delete(lease)) n++;
    return n;
  }

  async renew(keys: readonly string[], lease: string, ttl: number): Promise<number> {
    const nowMs = this.clock() * 1000;
    let n = 0;
    for (const k of keys) {
      const set = this.leases.get(k);
      const until = set?.get(lease);
      if (set !== undefined && until !== undefined && until > nowMs) {
        set.set(lease, nowMs + ttl * 1000);
        n++;
      }
    }
    return n;
  }

  async leave(keys: readonly string[], ticket: string): Promise<number> {
    let n = 0;
    for (const k of keys) if (this.queues.get(k)?.delete(ticket)) n++;
    return n;
  }

  async inProgress(keys: readonly string[]): Promise<number[]> {
    return keys.map((k) => this.live(k));
  }

  async close(): Promise<void> {}
}
