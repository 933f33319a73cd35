/**
 * Middleware for the official MCP TypeScript SDK (`@modelcontextprotocol/sdk`):
 * every tool call is checked before its handler runs (a fixed price charged by
 * that same admission on Redis and in memory; common.ts governedCall), with
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
 * the usual refusal. A breaker never asks. A client on a handshake-era protocol
 * is asked over its back-channel while the call waits (SDK 1.x
 * `extra.sendRequest`, SDK 2.x `ctx.mcpReq.elicitInput`); one on the 2026-07-28
 * protocol (SDK 2.x, `@modelcontextprotocol/server`), which has no back-channel,
 * gets the question as the call's `input_required` result (SEP-2322: an
 * elicitation under the key `mcpbg_approval`, the refusing limit sealed in
 * `requestState`) and is admitted over that limit when it retries the call with
 * the answer accepted, as Python's FastMCP middleware does.
 */
import { ElicitResultSchema, McpError } from "@modelcontextprotocol/sdk/types.js";

import { approvalText, openApproval, type Approval } from "../approval.js";
import { withCall } from "../repeats.js";
import { context, type Context } from "../context.js";
import { rateLimitedError } from "../decision.js";
import { LimitExceeded } from "../errors.js";
import { waitSeconds, type Governor } from "../governor.js";
import { OnExceed } from "../policy.js";
import {
  APPROVAL_TIMEOUT,
  AskInRound,
  MODERN_PROTOCOL,
  answeredYes,
  approvalGiven,
  approvalQuestion,
  approvalRequest,
  approvalSeconds,
  defaultSeal,
  governedCall,
  refusalResult,
  toolPrices,
  type ApprovalQuestion,
  type ApprovalSeal,
  type Ask,
  type Charges,
  type Identify,
} from "./common.js";

export { APPROVAL_REQUEST, approvalSeal, type ApprovalQuestion, type ApprovalSeal } from "./common.js";

type AuthInfo = { clientId?: string; extra?: Record<string, unknown> } | undefined;

/** What the SDK passes a handler as its last argument (the parts used here): SDK 1.x's `extra`, SDK 2.x's `ctx`. */
export interface RequestExtra {
  authInfo?: AuthInfo;
  sessionId?: string | undefined;
  /** Aborted when the client cancels the request: a call waiting for a slot stops waiting. */
  signal?: AbortSignal | undefined;
  /** The SDK's request to the client (elicitation, for OnExceed.ASK approvals). */
  sendRequest?(request: { method: string; params?: unknown }, resultSchema: typeof ElicitResultSchema, options?: { timeout?: number }): Promise<unknown>;
  /** SDK 2.x: the request's envelope (protocol revision, client capabilities) and multi-round-trip state. */
  mcpReq?: {
    envelope?: Record<string, unknown> | undefined;
    inputResponses?: Record<string, unknown> | undefined;
    requestState?: () => unknown;
    signal?: AbortSignal | undefined;
    elicitInput?(params: unknown, options?: { timeout?: number }): Promise<unknown>;
  };
  /** SDK 2.x: the HTTP transport's validated access token. */
  http?: { authInfo?: AuthInfo } | undefined;
}

export interface GovernOptions<E = RequestExtra> {
  /** Names the caller; default: the access token's subject (`authInfo.extra.sub`), else its client id. */
  identify?: Identify<E>;
  /** Seconds a call refused by a full concurrency cap waits for a slot (first come, first served); 0: refuse at once. */
  wait?: number;
  /** Seconds the user has to answer an OnExceed.ASK approval (MCP elicitation); unanswered, the call is refused. */
  approvalTimeout?: number;
  /**
   * Seals the refusing limit into a 2026-07-28 client's `requestState` (see
   * ApprovalSeal), so the client's retry must reach a server holding the same
   * key. Default: on a RedisBackend, a random key kept in that Redis
   * (`mcpbg:v1:_approval`, created by the first replica to need it), so every
   * replica sharing the governor's Redis opens what another sealed; on any other
   * backend, a random key of this process. `approvalSeal(sharedKey)` overrides it.
   */
  approvalSeal?: ApprovalSeal;
  /**
   * Answer a refusal that waiting fixes (429) with the JSON-RPC error of MCP's
   * rate-limit proposal (code -32023, SEP-3304, a draft) instead of an error
   * result, for clients that follow it. Off by default (Python: rate_limit_error).
   * Honoured by governedCallTool (the low-level Server): McpServer turns whatever a
   * tool handler throws into an error result, so under governTools a 429 stays one.
   */
  rateLimitError?: boolean;
}

const ENVELOPE_VERSION = "io.modelcontextprotocol/protocolVersion";
const ENVELOPE_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities";

/** Whether the request is on the 2026-07-28 protocol or later (no back-channel: ask in the result). */
function modern(extra: RequestExtra | undefined): boolean {
  const version = extra?.mcpReq?.envelope?.[ENVELOPE_VERSION];
  return typeof version === "string" && version >= MODERN_PROTOCOL;
}

/** Asking the user through the SDK's elicitation; false for no, no answer in time, or a client that cannot be asked. */
function askVia(extra: RequestExtra | undefined, tool: string, timeout: number, caller: Context, seal: ApprovalSeal): Ask {
  if (modern(extra)) return askInRound(extra as RequestExtra, tool, caller, seal, timeout);
  return async (decision) => {
    const params = approvalRequest(decision, tool);
    const options = { timeout: timeout * 1000 };
    try {
      if (typeof extra?.sendRequest === "function") {
        return approvalGiven(await extra.sendRequest({ method: "elicitation/create", params }, ElicitResultSchema, options));
      }
      const elicit = extra?.mcpReq?.elicitInput;
      if (typeof elicit === "function") return approvalGiven(await elicit.call(extra?.mcpReq, { mode: "form", ...params }, options));
      return false;
    } catch {
      return false; // the client cannot elicit, or did not answer: the normal refusal
    }
  };
}

/**
 * The approval of a 2026-07-28 client (SEP-2322 multi round trip; Python:
 * fastmcp._answered_in_round): a retry that answered our question about this
 * limit was checked with its approval (approvedInRound), so still refused it gets
 * the usual refusal; asked nothing yet, the question goes out as the call's result
 * (throws AskInRound), its state the sealed approvalText (the limit, the caller, a
 * one-time id, `ttl` seconds to answer). A client that declares no elicitation
 * capability in the request is not asked.
 */
function askInRound(extra: RequestExtra, tool: string, caller: Context, seal: ApprovalSeal, ttl: number): Ask {
  return async (decision) => {
    const declared = extra.mcpReq?.envelope?.[ENVELOPE_CAPABILITIES];
    if (declared === null || typeof declared !== "object" || !("elicitation" in declared)) return false;
    const limit = decision.limit ?? "";
    const now = Date.now() / 1000;
    if (extra.mcpReq?.inputResponses !== undefined) {
      // An answer to our question about this limit was tried with the check (spent
      // already, another caller's, lapsed or declined): the usual refusal, not a new
      // question. An answer about another limit (approved over one, refused by the next) is.
      const text = await opened(seal, extra.mcpReq.requestState?.(), caller);
      const previous = text === null ? null : openApproval(text, caller, now);
      if (previous === null || previous.limit === limit) return false;
    }
    let state: string;
    try {
      state = await seal.seal(approvalText(limit, caller, now, ttl), caller);
    } catch {
      return false; // no key to seal with (its Redis unreachable): a question no replica could open, so the normal refusal
    }
    throw new AskInRound(approvalQuestion(decision, tool, state));
  };
}

/**
 * The limit a 2026-07-28 client's retry answers yes for, so the retry is admitted
 * over it at once (one refusal in the ledger, not two; Python:
 * fastmcp._approved_in_round). A limit no longer OnExceed.ASK (a policy replaced
 * since the question) is asked about again, or refuses.
 */
async function approvedInRound(governor: Governor, extra: RequestExtra | undefined, caller: Context, seal: ApprovalSeal): Promise<Approval | null> {
  if (!modern(extra) || extra?.mcpReq?.inputResponses === undefined) return null;
  const text = await opened(seal, extra.mcpReq.requestState?.(), caller);
  const approval = text === null ? null : openApproval(text, caller, Date.now() / 1000);
  if (approval === null) return null; // another caller's, lapsed, or not ours: the usual check
  const { limit } = approval;
  if (!governor.policy.has(limit) || governor.policy.get(limit).onExceed !== OnExceed.ASK) return null;
  return answeredYes(extra.mcpReq.inputResponses) ? approval : null;
}

/**
 * The limit `state` was sealed with, else null; null too when the seal cannot
 * be opened at all (the default seal's key in an unreachable Redis): an answer
 * nobody can verify approves nothing, and the call is checked (and refused, or
 * failed by the limit's fail mode) as any other, never an error.
 */
async function opened(seal: ApprovalSeal, state: unknown, caller: Context): Promise<string | null> {
  try {
    return await seal.open(state, caller);
  } catch {
    return null;
  }
}

/** The default identity: the OAuth access token's subject, else its client id, and the MCP session. */
export function callerOf(extra: RequestExtra | undefined): Context {
  const auth = extra?.authInfo ?? extra?.http?.authInfo;
  const sub = auth?.extra?.["sub"];
  const user = typeof sub === "string" && sub ? sub : auth?.clientId;
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
  const seal = options.approvalSeal ?? defaultSeal(governor);
  const wrapped = async (...args: unknown[]): Promise<unknown> => {
    const extra = args[args.length - 1] as RequestExtra;
    const work = async (): Promise<unknown> => (handler as unknown as (...a: unknown[]) => unknown)(...args);
    const given = args.length >= 2 ? args[0] : {}; // (args, extra), or (extra) for a tool without input
    return governedTool(governor, tool, options.identify, extra, work, price, estimate, wait, timeout, seal, options.rateLimitError === true, given);
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
): (request: Req, extra: E) => Promise<R | ReturnType<typeof refusalResult> | ApprovalQuestion> {
  const wait = waitSeconds(options.wait ?? 0);
  const timeout = approvalSeconds(options.approvalTimeout ?? APPROVAL_TIMEOUT);
  const seal = options.approvalSeal ?? defaultSeal(governor);
  return async (request, extra) => {
    const tool = request.params.name;
    const { price, estimate } = toolPrices(governor.policy, tool, options.meta?.(tool));
    const args = request.params.arguments ?? {};
    return governedTool(governor, tool, options.identify, extra, () => handler(request, extra), price, estimate, wait, timeout, seal, options.rateLimitError === true, args);
  };
}

/** One tool call governed: the refusal as an error result, the approval question as an `input_required` result. */
async function governedTool<E extends RequestExtra | undefined, R>(
  governor: Governor,
  tool: string,
  identify: Identify<E> | undefined,
  extra: E,
  work: () => Promise<R>,
  price: Charges | null,
  estimate: Charges | null,
  wait: number,
  timeout: number,
  seal: ApprovalSeal,
  rateLimitError = false,
  args: unknown = {},
): Promise<R | ReturnType<typeof refusalResult> | ApprovalQuestion> {
  try {
    const ctx = withCall(governor.policy, await caller(identify, extra, tool), tool, args);
    const approval = await approvedInRound(governor, extra, ctx, seal);
    const signal = extra?.signal ?? extra?.mcpReq?.signal;
    const ask = askVia(extra, tool, timeout, ctx, seal);
    return await governedCall(governor, ctx, work, price, estimate, wait, ask, signal, approval ? [approval.limit] : [], approval);
  } catch (err) {
    if (err instanceof LimitExceeded) {
      const error = rateLimitError ? rateLimitedError(err.decision) : null;
      if (error !== null) throw new McpError(error.code, error.message, error.data);
      return refusalResult(err.decision);
    }
    if (err instanceof AskInRound) return err.result; // a 2026-07-28 client: the question is the result
    throw err;
  }
}
