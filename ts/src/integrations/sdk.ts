/**
 * Middleware for the official MCP TypeScript SDK (`@modelcontextprotocol/sdk`):
 * every tool call is checked before its handler runs and metered after, with
 * the tool's name as `Context.tool`, the caller from `identify`, the tool's
 * `_meta.mcpbg` price, and a refusal returned as an error result whose text
 * (and status) are those of the Python middleware.
 *
 * @example
 * const server = new McpServer({ name: "my-server", version: "1.0.0" });
 * governTools(server, governor, { identify: (extra) => context({ user: extra.authInfo?.clientId }) });
 * server.registerTool("search", { _meta: { mcpbg: { cost_usd: "0.01", limit: "spend" } } }, handler);
 *
 * For the low-level `Server`, wrap the tools/call handler itself:
 * server.setRequestHandler(CallToolRequestSchema, governedCallTool(governor, handler));
 *
 * A limit with `onExceed: OnExceed.ASK` that refuses a call makes the handler
 * ask the client's user, through MCP elicitation (`elicitation/create`, one
 * boolean), whether this one call may go over it (`approvalTimeout` seconds to
 * answer): approved, the call is admitted and its `admitted` event names the
 * limit in `approved`; declined, unanswered, or a client that cannot elicit:
 * the usual refusal. A breaker never asks.
 */
import { ElicitResultSchema } from "@modelcontextprotocol/sdk/types.js";

import { context, type Context } from "../context.js";
import { BudgetExceeded } from "../errors.js";
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

/** What the SDK passes a handler as its last argument (the parts used here). */
export interface RequestExtra {
  authInfo?: { clientId?: string; extra?: Record<string, unknown> } | undefined;
  sessionId?: string | undefined;
  /** Aborted when the client cancels the request: a call waiting for a slot stops waiting. */
  signal?: AbortSignal | undefined;
  /** The SDK's request to the client (elicitation, for OnExceed.ASK approvals). */
  sendRequest?(request: { method: string; params?: unknown }, resultSchema: typeof ElicitResultSchema, options?: { timeout?: number }): Promise<unknown>;
}

export interface GovernOptions<E = RequestExtra> {
  /** Names the caller; default: the access token's subject (`authInfo.extra.sub`), else its client id. */
  identify?: Identify<E>;
  /** Seconds a call refused by a full concurrency cap waits for a slot (first come, first served); 0: refuse at once. */
  wait?: number;
  /** Seconds the user has to answer an OnExceed.ASK approval (MCP elicitation); unanswered, the call is refused. */
  approvalTimeout?: number;
}

/** Asking the user through the SDK's elicitation; false for no, no answer in time, or a client that cannot be asked. */
function askVia(extra: RequestExtra | undefined, tool: string, timeout: number): Ask {
  return async (decision) => {
    if (typeof extra?.sendRequest !== "function") return false;
    try {
      const params = approvalRequest(decision, tool);
      return approvalGiven(await extra.sendRequest({ method: "elicitation/create", params }, ElicitResultSchema, { timeout: timeout * 1000 }));
    } catch {
      return false; // the client cannot elicit, or did not answer: the normal refusal
    }
  };
}

/** The default identity: the OAuth access token's subject, else its client id, and the MCP session. */
export function callerOf(extra: RequestExtra | undefined): Context {
  const sub = extra?.authInfo?.extra?.["sub"];
  const user = typeof sub === "string" && sub ? sub : extra?.authInfo?.clientId;
  return context({ ...(user ? { user } : {}), ...(extra?.sessionId ? { session: extra.sessionId } : {}) });
}

async function caller<E>(identify: Identify<E> | undefined, extra: E, tool: string): Promise<Context> {
  const found = identify !== undefined ? await identify(extra) : callerOf(extra as RequestExtra);
  return context({ ...(found ?? {}), tool });
}

type Handler = (...args: never[]) => unknown;

/** One tool handler governed: same arguments, same result, or the refusal as an error result. */
export function governHandler<H extends Handler>(
  governor: Governor,
  tool: string,
  handler: H,
  meta: Record<string, unknown> | null | undefined,
  options: GovernOptions = {},
): H {
  const { price, estimate } = toolPrices(governor.policy, tool, meta); // a bad price fails at registration
  const wait = waitSeconds(options.wait ?? 0); // and so does a bad wait
  const timeout = approvalSeconds(options.approvalTimeout ?? APPROVAL_TIMEOUT);
  const wrapped = async (...args: unknown[]): Promise<unknown> => {
    const extra = args[args.length - 1] as RequestExtra;
    try {
      const ctx = await caller(options.identify, extra, tool);
      const work = async (): Promise<unknown> => (handler as unknown as (...a: unknown[]) => unknown)(...args);
      return await governedCall(governor, ctx, work, price, estimate, wait, askVia(extra, tool, timeout), extra?.signal);
    } catch (err) {
      if (err instanceof BudgetExceeded) return refusalResult(err.decision);
      throw err;
    }
  };
  return wrapped as unknown as H;
}

interface McpServerLike {
  registerTool(name: string, config: Record<string, unknown>, cb: Handler): unknown;
  tool?: (...args: never[]) => unknown;
}

/**
 * Govern every tool registered on an `McpServer` from now on (call it right
 * after creating the server): `registerTool` and `tool` wrap each handler.
 */
export function governTools<S extends McpServerLike>(server: S, governor: Governor, options: GovernOptions = {}): S {
  const register = server.registerTool.bind(server);
  server.registerTool = (name: string, config: Record<string, unknown>, cb: Handler) =>
    register(name, config, governHandler(governor, name, cb, config["_meta"] as Record<string, unknown> | undefined, options));
  const legacy = server.tool?.bind(server);
  if (legacy !== undefined) {
    server.tool = ((...args: unknown[]) => {
      const name = args[0] as string;
      const cb = args[args.length - 1] as Handler;
      return (legacy as (...a: unknown[]) => unknown)(...args.slice(0, -1), governHandler(governor, name, cb, null, options));
    }) as NonNullable<S["tool"]>;
  }
  return server;
}

interface CallToolRequest {
  params: { name: string; arguments?: Record<string, unknown> | undefined; _meta?: Record<string, unknown> | undefined };
}

/**
 * The low-level `Server`'s tools/call handler, governed. `meta(name)` gives a
 * tool's `_meta` (its price), e.g. from the list your tools/list handler serves.
 */
export function governedCallTool<Req extends CallToolRequest, E extends RequestExtra, R>(
  governor: Governor,
  handler: (request: Req, extra: E) => Promise<R>,
  options: GovernOptions<E> & { meta?: (tool: string) => Record<string, unknown> | undefined } = {},
): (request: Req, extra: E) => Promise<R | ReturnType<typeof refusalResult>> {
  const wait = waitSeconds(options.wait ?? 0);
  const timeout = approvalSeconds(options.approvalTimeout ?? APPROVAL_TIMEOUT);
  return async (request, extra) => {
    const tool = request.params.name;
    const { price, estimate } = toolPrices(governor.policy, tool, options.meta?.(tool));
    try {
      const ctx = await caller(options.identify, extra, tool);
      return await governedCall(governor, ctx, () => handler(request, extra), price, estimate, wait, askVia(extra, tool, timeout), extra.signal);
    } catch (err) {
      if (err instanceof BudgetExceeded) return refusalResult(err.decision);
      throw err;
    }
  };
}
