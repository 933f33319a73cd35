// Run-time changes built in TypeScript match Python's (conformance/vectors.json "changes"):
// the Change, its context, the change.lua command, and the field a bad input names.
import assert from "node:assert/strict";
import { test } from "node:test";

import { capChange, changeCommand, grantChange, planChange, uncapChange } from "../src/admin.js";
import { InvalidInputError } from "../src/errors.js";
import { parsePolicy } from "../src/policyFile.js";
import { VECTORS, ctxOf, type Json } from "./vectors.js";

function build(v: Json): ReturnType<typeof capChange> {
  const policy = parsePolicy(VECTORS.policies.good[v.policy].toml);
  const why = { reason: v.reason, actor: v.actor };
  if (v.reason === undefined) delete why.reason;
  if (v.actor === undefined) delete why.actor;
  switch (v.call) {
    case "set_cap":
      return capChange(policy, v.limit, v.scope, v.cap, v.until ?? null, v.now, why);
    case "unset_cap":
      return uncapChange(policy, v.limit, v.scope, why);
    case "assign_plan":
      return planChange(policy, v.plan, { tenant: v.tenant ?? null, user: v.user ?? null }, why);
    case "grant":
      return grantChange(policy, v.limit, v.scope, v.amount, v.now, null, why);
    default:
      return grantChange(policy, v.limit, v.scope, null, v.now, v.used, why);
  }
}

test("run-time changes match the Python builders", () => {
  assert.ok(VECTORS.changes.length > 10);
  for (const v of VECTORS.changes as Json[]) {
    if (v.error !== undefined) {
      assert.throws(() => build(v), (err: unknown) => err instanceof InvalidInputError && err.field === v.error, JSON.stringify(v));
      continue;
    }
    const [change, ctx] = build(v);
    assert.deepEqual({ ...change }, v.change, v.call);
    assert.deepEqual(ctx, ctxOf(v.context), v.call);
    assert.deepEqual(changeCommand([change], v.now * 1000), v.command, v.call);
  }
});
