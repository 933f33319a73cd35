/**
 * mcp-budget-governor for TypeScript: the same budgets as the Python package,
 * enforced by the same Lua scripts on the same Redis keys (or the same SQL functions
 * on the same Postgres tables: PostgresBackend).
 *
 * @example
 * import { Governor, Limit, Policy, RedisBackend, Scope, Window, context } from "mcp-budget-governor";
 * const governor = new Governor(
 *   Policy.of(new Limit("burst", { cap: 30, window: Window.MINUTE, scope: Scope.USER })),
 *   RedisBackend.fromUrl("redis://127.0.0.1:6379/0"),
 * );
 * (await governor.check(context({ user: "u_42" }))).raiseForStatus();
 */
export { Governor, MAX_WAIT, Reservation, Reservations, type CheckOptions, type GovernorOptions } from "./governor.js";
export {
  Decision,
  ADMITTED,
  RATE_LIMITED,
  REFUSAL_META_KEY,
  rateLimitedError,
  refusalText,
  refusalBody,
  refusalMeta,
  type MeterResult,
  type Lease,
} from "./decision.js";
export { Policy, Limit, Plan, FailMode, OnExceed, Anonymous, type LimitOptions, type PolicyOptions } from "./policy.js";
export { parsePolicy, loadPolicyFile } from "./policyFile.js";
export { Scope, context, EMPTY, type Context, type ScopeName } from "./context.js";
export { callHash, canonicalJson, countsCalls, withCall, isRepeat } from "./repeats.js";
export { Window, bucketFor, zone, Bucket } from "./windows.js";
export { Unit, usd, formatUsd, MAX_AMOUNT } from "./money.js";
export { PriceTable, type Tokens } from "./prices.js";
export { escape, counterKey, scopeSegment, leaseKey, KeyBuilder, SEPARATORS, PREFIX } from "./keys.js";
export { RedisBackend, chargeCommand } from "./backends/redis.js";
export { MemoryBackend } from "./backends/memory.js";
export { PostgresBackend, chargeParams, type PostgresBackendOptions } from "./backends/postgres.js";
export type { Backend, ChargeResult, ChargeOptions } from "./backends/types.js";
export { script, SCRIPTS } from "./scripts.js";
export * from "./ledger/index.js";
export {
  GovernorError,
  InvalidInputError,
  PolicyError,
  PolicyFileError,
  UnknownModelError,
  BackendUnavailableError,
  BackendBusyError,
  CounterOverflowError,
  BudgetExceeded,
  LimitExceeded,
  BudgetUnavailable,
} from "./errors.js";
export { setCap, unsetCap, assignPlan, grant, reset, capChange, uncapChange, planChange, grantChange, changeCommand, whyToken, type Change } from "./admin.js";
