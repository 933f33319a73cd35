/**
 * Middleware for the TypeScript `fastmcp` framework: every tool's `execute`
 * is checked before it runs (a fixed price charged by that same admission on
 * Redis and in memory; common.ts governedCall), with the tool's name as
 * `Context.tool`, the caller from `identify` (default: the session's
 * `authenticate` result when it has a `user`/`id`), the tool's `_meta.mcpbg`
 * price, and a refusal returned as an error result carrying the Python
 * middleware's refusal text, and the refusal as data in its `_meta`
 * (`"dev.mcpbg/refusal"`, refusalMeta).
 * A limit with `onExceed: OnExceed.ASK` that refuses a call asks the client's
 * user through `context.elicit` (MCP elicitation) whether this one call may go
 * over it; declined, unanswered (`approvalTimeout`) or a client that cannot
 * elicit: the usual refusal. A breaker never asks. fastmcp serves the
 * handshake-era protocols only (it is built on SDK 1.x), so it always asks over
 * the back-channel; the 2026-07-28 protocol's in-round question (`input_required`)
 * is the SDK 2.x path of `./sdk` (governTools on `@modelcontextprotocol/server`).
 *
 * @example
 * const server = new FastMCP({ name: "my-server", version: "1.0.0" });
 * governFastMCP(server, governor, { identify: (ctx) => context({ user: ctx.session?.id }) });
 * server.addTool({ name: "search", _meta: { mcpbg: { cost_usd: "0.01", limit: "spend" } }, execute });
 */
import { UserError } from "fastmcp";

import { context, type Context } from "../context.js";
import { withCall } from "../repeats.js";
import { refusalText } from "../decision.js";
import { LimitExceeded } from "../errors.js";
import { waitSeconds, type Governor } from "../governor.js";
import {
  APPROVAL_TIMEOUT,
  approvalGiven,
  approvalRequest,
  approvalSeconds,
  governedCall,
  refusalResult,
  toolPrices,
  type Ask,
  type Identify,
} from "./common.js";

/** What fastmcp passes `execute` as its second argument (the parts used here). */
export interface ToolContext {
  session?: unknown;
  sessionId?: string | undefined;
  /** Aborted when the client cancels the call: a call waiting for a slot stops waiting. */
  signal?: AbortSignal | undefined;
  /** fastmcp's elicitation (OnExceed.ASK approvals). */
  elicit?(params: ReturnType<typeof approvalRequest>, options?: { timeout?: number }): Promise<unknown>;
}

export interface GovernFastMCPOptions<C = ToolContext> {
  identify?: Identify<C>;
  /** Seconds a call refused by a full concurrency cap waits for a slot (first come, first served); 0: refuse at once. */
  wait?: number;
  /** Seconds the user has to answer an OnExceed.ASK approval (MCP elicitation); unanswered, the call is refused. */
  approvalTimeout?: number;
}

/** Asking the user through fastmcp's elicit; false for no, no answer in time, or a client that cannot be asked. */
function askVia(ctx: ToolContext | undefined, tool: string, timeout: number): Ask {
  return async (decision) => {
    if (typeof ctx?.elicit !== "function") return false;
    try {
      return approvalGiven(await ctx.elicit(approvalRequest(decision, tool), { timeout: timeout * 1000 }));
    } catch {
      return false; // the client cannot elicit, or did not answer: the normal refusal
    }
  };
}

/** The default identity: the session's `user`, `sub` or `id` (from `authenticate`), and the MCP session id. */
export function callerOf(ctx: ToolContext | undefined): Context {
  const s = (ctx?.session ?? {}) as Record<string, unknown>;
  const user = [s["user"], s["sub"], s["id"]].find((v): v is string => typeof v === "string" && v !== "");
  return context({ ...(user !== undefined ? { user } : {}), ...(ctx?.sessionId ? { session: ctx.sessionId } : {}) });
}

interface ToolLike {
  name: string;
  _meta?: Record<string, unknown>;
  execute: (args: never, ctx: never) => Promise<unknown>;
}

interface FastMCPLike {
  addTool(tool: never): void;
}

/**
 * The refusal as fastmcp's error, its text the Python middleware's refusal text; kept
 * for code that throws it itself (a governed tool returns the refusal as a result).
 */
export class BudgetToolError extends UserError {
  constructor(readonly refusal: LimitExceeded) {
    super(refusalText(refusal.decision), { mcpbg: { status: refusal.decision.status, reason: refusal.decision.reason } });
  }
}

/** One fastmcp tool, governed. */
export function governTool<T extends ToolLike>(governor: Governor, tool: T, options: GovernFastMCPOptions = {}): T {
  const { price, estimate } = toolPrices(governor.policy, tool.name, tool._meta);
  const wait = waitSeconds(options.wait ?? 0);
  const timeout = approvalSeconds(options.approvalTimeout ?? APPROVAL_TIMEOUT);
  const execute = tool.execute as (args: unknown, ctx: ToolContext) => Promise<unknown>;
  return {
    ...tool,
    execute: async (args: unknown, ctx: ToolContext) => {
      try {
        const found = options.identify !== undefined ? await options.identify(ctx) : callerOf(ctx);
        const caller = withCall(governor.policy, context({ ...(found ?? {}), tool: tool.name }), tool.name, args);
        return await governedCall(governor, caller, () => execute(args, ctx), price, estimate, wait, askVia(ctx, tool.name, timeout), ctx?.signal);
      } catch (err) {
        if (err instanceof LimitExceeded) {
          // The error result Python's middleware gives: the refusal text, and the
          // refusal as data in _meta (REFUSAL_META_KEY).
          const { content, isError, _meta } = refusalResult(err.decision);
          return { content, isError, _meta };
        }
        throw err;
      }
    },
  };
}

/** Govern every tool added to a FastMCP server from now on (call it right after creating the server). */
export function governFastMCP<S extends FastMCPLike>(server: S, governor: Governor, options: GovernFastMCPOptions = {}): S {
  const add = server.addTool.bind(server) as (tool: ToolLike) => void;
  (server as unknown as { addTool: (tool: ToolLike) => void }).addTool = (tool: ToolLike) => add(governTool(governor, tool, options));
  return server;
}
