/**
 * Model prices in USD per million tokens, and the cost of a call in integer
 * micros, rounded up once (Python: prices.py). `PriceTable.builtin()` is the
 * table the Python package builds from genai-prices, exported into the
 * conformance vectors and copied into the package at build time.
 *
 * @example
 * new PriceTable().withPrice("my-model", 3, 15).costMicros("my-model", { inputTokens: 3200, outputTokens: 850 })
 * // 22350
 */
import { readFileSync } from "node:fs";

import { InvalidInputError, UnknownModelError } from "./errors.js";
import { MAX_AMOUNT, checkAmount, ceilScaled, toExact, type Exact } from "./money.js";

type PriceInput = number | string | bigint;

export interface Rates {
  readonly inputPerMtok: Exact;
  readonly outputPerMtok: Exact;
  readonly cacheReadPerMtok: Exact | null;
  readonly cacheWritePerMtok: Exact | null;
}

export interface Tier extends Rates {
  readonly start: number;
}

export interface ModelPrice extends Rates {
  readonly tiers: readonly Tier[];
}

export interface Tokens {
  inputTokens: number;
  outputTokens: number;
  cacheReadTokens?: number;
  cacheWriteTokens?: number;
}

function price(value: unknown, field: string): Exact {
  const p = toExact(value, field);
  if (p.digits < 0n) throw new InvalidInputError(field, value, "must not be negative");
  if (ceilScaled(p, 0) > BigInt(MAX_AMOUNT)) {
    throw new InvalidInputError(field, value, `exceeds the largest amount (${MAX_AMOUNT})`);
  }
  return p;
}

interface RatesJson {
  input_per_mtok: string;
  output_per_mtok: string;
  cache_read_per_mtok: string | null;
  cache_write_per_mtok: string | null;
}

function ratesOf(j: RatesJson): Rates {
  return {
    inputPerMtok: price(j.input_per_mtok, "input_per_mtok"),
    outputPerMtok: price(j.output_per_mtok, "output_per_mtok"),
    cacheReadPerMtok: j.cache_read_per_mtok === null ? null : price(j.cache_read_per_mtok, "cache_read_per_mtok"),
    cacheWritePerMtok: j.cache_write_per_mtok === null ? null : price(j.cache_write_per_mtok, "cache_write_per_mtok"),
  };
}

let builtinTable: PriceTable | undefined;

/** An immutable map from model name to price; lookup tries the exact name, then ignoring case. */
export class PriceTable {
  private readonly folded: ReadonlyMap<string, string>;

  constructor(
    private readonly prices: ReadonlyMap<string, ModelPrice> = new Map(),
    readonly version = "custom",
  ) {
    const folded = new Map<string, string>();
    for (const name of prices.keys()) if (!folded.has(name.toLowerCase())) folded.set(name.toLowerCase(), name);
    this.folded = folded;
  }

  /** The prices the Python package bundles (genai-prices), as exported into the vectors. */
  static builtin(): PriceTable {
    if (builtinTable === undefined) {
      const dir = new URL("../data/", import.meta.url);
      const models = JSON.parse(readFileSync(new URL("prices.json", dir), "utf8")) as Record<
        string,
        RatesJson & { tiers: (RatesJson & { start: number })[] }
      >;
      const { version } = JSON.parse(readFileSync(new URL("prices-version.json", dir), "utf8")) as { version: string };
      const table = new Map<string, ModelPrice>();
      for (const [name, j] of Object.entries(models)) {
        table.set(name, { ...ratesOf(j), tiers: j.tiers.map((t) => ({ start: t.start, ...ratesOf(t) })) });
      }
      builtinTable = new PriceTable(table, version);
    }
    return builtinTable;
  }

  get size(): number {
    return this.prices.size;
  }

  /** A new table with `model` priced as given (USD per million tokens). */
  withPrice(
    model: string,
    inputPerMtok: PriceInput,
    outputPerMtok: PriceInput,
    cacheReadPerMtok: PriceInput | null = null,
    cacheWritePerMtok: PriceInput | null = null,
  ): PriceTable {
    if (typeof model !== "string" || !model.trim()) {
      throw new InvalidInputError("model", model, "expected a non-empty model name");
    }
    const prices = new Map(this.prices);
    prices.set(model, {
      inputPerMtok: price(inputPerMtok, "input_per_mtok"),
      outputPerMtok: price(outputPerMtok, "output_per_mtok"),
      cacheReadPerMtok: cacheReadPerMtok === null ? null : price(cacheReadPerMtok, "cache_read_per_mtok"),
      cacheWritePerMtok: cacheWritePerMtok === null ? null : price(cacheWritePerMtok, "cache_write_per_mtok"),
      tiers: [],
    });
    const version = this.version !== "custom" && !this.version.endsWith("+overrides") ? this.version + "+overrides" : this.version;
    return new PriceTable(prices, version);
  }

  has(model: string): boolean {
    return typeof model === "string" && model.trim() !== "" && this.keyFor(model) !== null;
  }

  private keyFor(model: string): string | null {
    if (this.prices.has(model)) return model;
    return this.folded.get(model.toLowerCase()) ?? null;
  }

  /** The price of `model`; UnknownModelError when it has none (never priced at zero). */
  priceOf(model: string): ModelPrice {
    if (typeof model !== "string" || !model.trim()) {
      throw new InvalidInputError("model", model, "expected a non-empty model name");
    }
    const key = this.keyFor(model);
    const found = key === null ? undefined : this.prices.get(key);
    if (found === undefined) throw new UnknownModelError(model, this.prices.size);
    return found;
  }

  /** Cost of one call in USD micros, rounded up once; `inputTokens` includes the cache tokens. */
  costMicros(model: string, tokens: Tokens): number {
    const prompt = checkAmount(tokens.inputTokens, "input_tokens");
    const output = checkAmount(tokens.outputTokens, "output_tokens");
    const read = checkAmount(tokens.cacheReadTokens ?? 0, "cache_read_tokens");
    const write = checkAmount(tokens.cacheWriteTokens ?? 0, "cache_write_tokens");
    if (read + write > prompt) {
      throw new InvalidInputError(
        "cache_read_tokens + cache_write_tokens",
        read + write,
        `${read} + ${write} exceeds input_tokens (${prompt}), which must include the cache tokens`,
      );
    }
    const base = this.priceOf(model);
    let rates: Rates = base;
    for (let i = base.tiers.length - 1; i >= 0; i--) {
      const tier = base.tiers[i];
      if (tier !== undefined && prompt > tier.start) {
        rates = tier;
        break;
      }
    }
    const terms: [number, Exact][] = [
      [prompt - read - write, rates.inputPerMtok],
      [output, rates.outputPerMtok],
      [read, rates.cacheReadPerMtok ?? rates.inputPerMtok],
      [write, rates.cacheWritePerMtok ?? rates.inputPerMtok],
    ];
    // Exact: every term over the smallest exponent, one rounding up at the end.
    const exponent = Math.min(0, ...terms.map(([, r]) => r.exponent));
    let total = 0n;
    for (const [n, r] of terms) total += BigInt(n) * r.digits * 10n ** BigInt(r.exponent - exponent);
    const micros = ceilScaled({ digits: total, exponent }, 0);
    return checkAmount(Number(micros), "cost_micros");
  }
}
