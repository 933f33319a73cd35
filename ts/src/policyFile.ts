/**
 * Policies written as TOML files, in the Python package's format (Python:
 * policy_file.py): every key must be known, money caps are written in dollars
 * (`cap_usd = "25.00"`, never a float), and each error names the file, the
 * line, the key path and the value.
 *
 * @example
 * const policy = loadPolicyFile("policy.toml");
 * const same = parsePolicy('[[limits]]\nname = "burst"\ncap = 30\nwindow = "minute"\nscope = "user"\n');
 */
import { readFileSync } from "node:fs";

import { parse, TomlError } from "smol-toml";

import { InvalidInputError, PolicyError, PolicyFileError } from "./errors.js";
import { Unit, usd } from "./money.js";
import { Limit, Plan, Policy, type LimitOptions, type PolicyOptions } from "./policy.js";
import type { ScopeName } from "./context.js";
import type { Window } from "./windows.js";

/** Keys of a `[[limits]]` table: the fields of Python's Limit, plus `cap_usd`. */
export const LIMIT_KEYS = [
  "name",
  "cap",
  "window",
  "scope",
  "unit",
  "breaker",
  "gated",
  "fail_mode",
  "local_fallback",
  "status",
  "on_exceed",
  "alert_at",
  "anchor_day",
  "anchors",
  "caps",
  "tools",
  "cap_usd",
] as const;
const TOP_KEYS = ["limits", "timezone", "anonymous", "plans", "assign"] as const;
const DOLLARS = /^[0-9]+(\.[0-9]{1,6})?$/;

type Path = (string | number)[];

function dotted(path: Path): string {
  let out = "";
  for (const part of path) out += typeof part === "number" ? `[${part}]` : out ? `.${part}` : part;
  return out || "policy";
}

const EMPTY_SCOPE = 'an empty list names no dimension: write scope = "global" for one counter for everyone, or name the dimensions (scope = ["tenant"])';

class Builder {
  private readonly lines: string[];
  constructor(
    private readonly source: string,
    text: string,
  ) {
    this.lines = text.split(/\r?\n/);
  }

  /** The line a key path is written on (limits[i].key, top-level keys, plans.x.y). */
  line(path: Path): number | null {
    const keyLine = (from: number, to: number, key: string): number | null => {
      const re = new RegExp(`^\\s*"?${key.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")}"?\\s*=`);
      for (let i = from; i < to; i++) if (re.test(this.lines[i] ?? "")) return i + 1;
      return null;
    };
    const headers = (re: RegExp): number[] => this.lines.flatMap((l, i) => (re.test(l) ? [i] : []));
    if (path[0] === "limits" && typeof path[1] === "number") {
      const starts = headers(/^\s*\[\[\s*limits\s*\]\]/);
      const start = starts[path[1]];
      if (start === undefined) return null;
      const end = headers(/^\s*\[/).find((i) => i > start) ?? this.lines.length;
      if (typeof path[2] === "string") return keyLine(start + 1, end, path[2]) ?? start + 1;
      return start + 1;
    }
    if (typeof path[0] === "string" && path.length >= 1) {
      const first = headers(/^\s*\[/)[0] ?? this.lines.length;
      return keyLine(0, first, path[0]);
    }
    return null;
  }

  error(path: Path, value: unknown, problem: string): PolicyFileError {
    return new PolicyFileError(this.source, this.line(path), dotted(path), value, problem);
  }

  dollars(path: Path, value: unknown): number {
    if (typeof value === "number" && !Number.isInteger(value)) {
      throw this.error(path, value, 'write dollars as a string, e.g. "25.00": a float cannot hold money exactly');
    }
    if (typeof value !== "string" && typeof value !== "number" && typeof value !== "bigint") {
      throw this.error(path, value, 'expected dollars, e.g. "25.00"');
    }
    if (typeof value === "string") {
      if (value.trim().startsWith("-")) throw this.error(path, value, "must not be negative");
      if (!DOLLARS.test(value)) {
        throw this.error(path, value, 'expected dollars as digits with at most six decimals, e.g. "25.00"');
      }
    } else if (value < 0) throw this.error(path, value, "must not be negative");
    try {
      return usd(value);
    } catch (err) {
      if (err instanceof InvalidInputError) throw this.error(path, value, err.problem);
      throw err;
    }
  }

  amount(path: Path, value: unknown, unit: Unit): number {
    if (unit === Unit.USD_MICROS) return this.dollars(path, value);
    if (typeof value !== "number" && typeof value !== "bigint") throw this.error(path, value, "expected a whole number");
    const n = Number(value);
    if (!Number.isInteger(n)) throw this.error(path, value, "expected a whole number");
    if (n < 0) throw this.error(path, value, "must not be negative");
    return n;
  }

  unknown(path: Path, known: readonly string[]): PolicyFileError {
    const key = String(path[path.length - 1]);
    const close = known.find((k) => similar(k, key));
    const hint = close !== undefined ? `did you mean '${close}'?` : `known keys: ${known.join(", ")}`;
    return this.error(path, key, `unknown key (${hint})`);
  }

  translate(err: PolicyError, index: number | null): PolicyFileError {
    const { field, value } = err;
    const m = /^Policy\.limits\[(\d+)\]\.(\w+)$/.exec(field);
    if (m) return this.error(["limits", Number(m[1]), m[2] ?? ""], value, err.problem);
    if (index !== null) {
      const key = field.replace(/^Limit(\(.*?\))?\./, "");
      const entry = /^caps\['(.*)'\]$/.exec(key);
      if (entry) return this.error(["limits", index, "caps", entry[1] ?? ""], value, err.problem);
      let problem = err.problem;
      if (key === "cap" && typeof value === "string") problem = 'expected a whole number (for money write cap_usd = "25.00")';
      const at = key.indexOf(".");
      return this.error(["limits", index, ...(at < 0 ? [key] : [key.slice(0, at), key.slice(at + 1)])], value, problem);
    }
    if (field.startsWith("Policy.")) return this.error([field.slice("Policy.".length)], value, err.problem);
    return this.error([], value, `${field}: ${err.problem}`);
  }

  limit(i: number, entry: unknown): Limit {
    const here: Path = ["limits", i];
    if (entry === null || typeof entry !== "object" || Array.isArray(entry)) {
      throw this.error(here, entry, "expected a table of limit settings");
    }
    const fields = { ...(entry as Record<string, unknown>) };
    for (const key of Object.keys(fields)) {
      if (!(LIMIT_KEYS as readonly string[]).includes(key)) throw this.unknown([...here, key], LIMIT_KEYS);
    }
    const concurrent = String(fields["unit"] ?? "").toLowerCase() === Unit.CONCURRENT;
    for (const key of ["name", "window"]) {
      if (!(key in fields) && !(key === "window" && concurrent)) throw this.error(here, null, `missing required key '${key}'`);
    }
    if ("cap_usd" in fields) {
      if ("cap" in fields) throw this.error([...here, "cap_usd"], fields["cap_usd"], "give cap or cap_usd, not both");
      fields["cap"] = this.dollars([...here, "cap_usd"], fields["cap_usd"]);
      delete fields["cap_usd"];
      const unit = fields["unit"] ?? Unit.USD_MICROS;
      fields["unit"] = unit;
      if (typeof unit !== "string" || unit.toLowerCase() !== Unit.USD_MICROS) {
        throw this.error([...here, "unit"], unit, "cap_usd is a money cap: unit must be usd_micros (or left out)");
      }
    } else if (!("cap" in fields)) {
      throw this.error(here, null, "missing required key 'cap' (or 'cap_usd' for money)");
    }
    const scope = fields["scope"];
    // Most likely dimensions left out by mistake: it would silently be global (Python: policy_file).
    if (Array.isArray(scope) && scope.length === 0) throw this.error([...here, "scope"], [], EMPTY_SCOPE);
    if (scope === "global") fields["scope"] = null;
    let caps: Record<string, number> | undefined;
    if ("caps" in fields) {
      const raw = fields["caps"];
      if (raw === null || typeof raw !== "object" || Array.isArray(raw)) {
        throw this.error([...here, "caps"], raw, 'expected a table: caps = { acme = "100.00" }');
      }
      const money = "cap_usd" in (entry as Record<string, unknown>);
      caps = {};
      for (const [k, v] of Object.entries(raw as Record<string, unknown>)) {
        caps[k] = this.amount([...here, "caps", k], v, money ? Unit.USD_MICROS : Unit.CALLS);
      }
    }
    const cap = fields["cap"];
    const options: LimitOptions = {
      cap: typeof cap === "bigint" ? Number(cap) : (cap as number),
      window: (fields["window"] ?? null) as Window | null,
      scope: (fields["scope"] ?? null) as ScopeName | ScopeName[] | null,
      ...(fields["unit"] !== undefined && { unit: fields["unit"] as Unit }),
      ...(fields["breaker"] !== undefined && { breaker: fields["breaker"] as boolean }),
      ...(fields["gated"] !== undefined && { gated: fields["gated"] as boolean }),
      ...(fields["fail_mode"] !== undefined && { failMode: fields["fail_mode"] as LimitOptions["failMode"] & string }),
      ...(fields["local_fallback"] !== undefined && { localFallback: fields["local_fallback"] as boolean }),
      ...(fields["status"] !== undefined && { status: Number(fields["status"]) }),
      ...(fields["on_exceed"] !== undefined && { onExceed: fields["on_exceed"] as LimitOptions["onExceed"] & string }),
      ...(fields["alert_at"] !== undefined && { alertAt: (fields["alert_at"] as unknown[]).map(Number) }),
      ...(fields["anchor_day"] !== undefined && { anchorDay: Number(fields["anchor_day"]) }),
      ...(fields["anchors"] !== undefined && {
        anchors: Object.fromEntries(Object.entries(fields["anchors"] as Record<string, unknown>).map(([k, v]) => [k, Number(v)])),
      }),
      ...(caps !== undefined && { caps }),
      ...(fields["tools"] !== undefined && { tools: fields["tools"] as string[] }),
    };
    try {
      return new Limit(fields["name"] as string, options);
    } catch (err) {
      if (err instanceof PolicyError) throw this.translate(err, i);
      throw err;
    }
  }

  policy(doc: Record<string, unknown>): Policy {
    for (const key of Object.keys(doc)) {
      if (!(TOP_KEYS as readonly string[]).includes(key)) throw this.unknown([key], TOP_KEYS);
    }
    if (!("limits" in doc)) throw this.error(["limits"], null, "missing: a policy file needs [[limits]] tables");
    const entries = doc["limits"];
    if (!Array.isArray(entries)) throw this.error(["limits"], entries, "expected an array of tables ([[limits]])");
    const limits = entries.map((e, i) => this.limit(i, e));
    const byName = new Map(limits.map((l) => [l.name, l]));
    const plans: Plan[] = [];
    const plansDoc = doc["plans"] ?? {};
    if (plansDoc === null || typeof plansDoc !== "object" || Array.isArray(plansDoc)) {
      throw this.error(["plans"], plansDoc, "expected tables: [plans.<name>]");
    }
    for (const [name, caps] of Object.entries(plansDoc as Record<string, unknown>)) {
      if (caps === null || typeof caps !== "object" || Array.isArray(caps)) {
        throw this.error(["plans", name], caps, "expected a table of limit = cap");
      }
      const converted: Record<string, number> = {};
      for (const [limit, cap] of Object.entries(caps as Record<string, unknown>)) {
        const lim = byName.get(limit);
        if (lim === undefined) throw this.error(["plans", name, limit], limit, `no such limit (known: ${[...byName.keys()].join(", ")})`);
        converted[limit] = this.amount(["plans", name, limit], cap, lim.unit);
      }
      try {
        plans.push(new Plan(name, converted));
      } catch (err) {
        if (err instanceof PolicyError) throw this.error(["plans", name], err.value, err.problem);
        throw err;
      }
    }
    const assign = doc["assign"] ?? {};
    if (assign === null || typeof assign !== "object" || Array.isArray(assign)) {
      throw this.error(["assign"], assign, 'expected a table: [assign] acme = "pro"');
    }
    for (const [who, plan] of Object.entries(assign as Record<string, unknown>)) {
      if (!plans.some((p) => p.name === plan)) {
        throw this.error(["assign", who], plan, `no such plan (known: ${plans.map((p) => p.name).join(", ") || "none"})`);
      }
    }
    const options: PolicyOptions = {
      timezone: (doc["timezone"] ?? null) as string | null,
      ...(doc["anonymous"] !== undefined && { anonymous: doc["anonymous"] as PolicyOptions["anonymous"] & string }),
      plans,
      assignments: assign as Record<string, string>,
    };
    try {
      return new Policy(limits, options);
    } catch (err) {
      if (err instanceof PolicyError) throw this.translate(err, null);
      throw err;
    }
  }
}

/** difflib-like closeness, enough to suggest a misspelt key. */
function similar(a: string, b: string): boolean {
  const m = a.length;
  const n = b.length;
  const dp = Array.from({ length: m + 1 }, () => new Array<number>(n + 1).fill(0));
  for (let i = 1; i <= m; i++) {
    for (let j = 1; j <= n; j++) {
      const row = dp[i] as number[];
      const prev = dp[i - 1] as number[];
      row[j] = a[i - 1] === b[j - 1] ? (prev[j - 1] ?? 0) + 1 : Math.max(prev[j] ?? 0, row[j - 1] ?? 0);
    }
  }
  return (2 * ((dp[m] as number[])[n] ?? 0)) / (m + n) >= 0.6;
}

/** Validate the TOML policy `text`; `source` names it in errors. */
export function parsePolicy(text: string, source = "<policy>"): Policy {
  let doc: Record<string, unknown>;
  try {
    doc = parse(text) as Record<string, unknown>;
  } catch (err) {
    if (err instanceof TomlError) {
      throw new PolicyFileError(source, err.line, "TOML", "", err.message.split("\n", 1)[0] ?? "invalid TOML");
    }
    throw err;
  }
  return new Builder(source, text).policy(doc);
}

/** Read and validate the policy file at `path` (TOML). */
export function loadPolicyFile(path: string): Policy {
  if (!path.toLowerCase().endsWith(".toml")) throw new InvalidInputError("policy", path, "expected a .toml policy file");
  let text: string;
  try {
    text = readFileSync(path, "utf8");
  } catch {
    throw new InvalidInputError("policy", path, "no such file");
  }
  return parsePolicy(text, path);
}
