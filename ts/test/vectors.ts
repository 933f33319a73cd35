// The conformance vectors the Python implementation generated (../conformance/vectors.json).
import { readFileSync } from "node:fs";

import { context, type Context } from "../src/context.js";

// eslint-disable-next-line @typescript-eslint/no-explicit-any
export type Json = any;

export const VECTORS: Json = JSON.parse(readFileSync(new URL("../../conformance/vectors.json", import.meta.url), "utf8"));

/** A Python context dict (snake_case) as a TypeScript Context. */
export function ctxOf(c: Record<string, string | null>): Context {
  const fields: Record<string, string> = {};
  for (const [k, v] of Object.entries(c)) if (v !== null) fields[k === "session_root" ? "sessionRoot" : k] = v;
  return context(fields);
}

/** A Python limit dict (the vectors' shape) as LimitOptions. */
export function limitOptions(l: Json): Json {
  return {
    cap: l.cap,
    window: l.window,
    scope: l.scope,
    unit: l.unit,
    gated: l.gated,
    breaker: l.breaker,
    failMode: l.fail_mode,
    localFallback: l.local_fallback,
    status: l.status,
    onExceed: l.on_exceed,
    alertAt: l.alert_at,
    anchorDay: l.anchor_day,
    anchors: Object.fromEntries(Object.entries(l.anchors).map(([k, v]) => [decodeURIComponent(k.replace(/^\w+=/, "")), v])),
    caps: l.caps,
  };
}
