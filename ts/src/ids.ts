/** Time-ordered UUIDv7 ids (the idempotency key of events and inline charges). */
import { randomUUID } from "node:crypto";

let lastMs = 0;
let seq = 0;

/**
 * A UUIDv7: 48 bits of Unix milliseconds, version 7, 12 bits of a counter that
 * keeps ids made in one millisecond ordered, then random bits (from the
 * runtime's cached entropy pool: randomUUID, the fast path).
 */
export function newId(): string {
  let ms = Date.now();
  if (ms > lastMs) {
    lastMs = ms;
    seq = 0;
  } else {
    ms = lastMs;
    seq = (seq + 1) & 0xfff;
    if (seq === 0) ms = ++lastMs;
  }
  const rand = randomUUID(); // xxxxxxxx-xxxx-4xxx-Vxxx-xxxxxxxxxxxx, variant bits already 10
  const t = ms.toString(16).padStart(12, "0");
  return `${t.slice(0, 8)}-${t.slice(8)}-7${seq.toString(16).padStart(3, "0")}${rand.slice(18)}`;
}
