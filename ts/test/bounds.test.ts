// The bounds table matches Python's (conformance/vectors.json "bounds"): the same rows,
// the same answer to every case, and the door of setCap refusing an `until` past it.
import assert from "node:assert/strict";
import { test } from "node:test";

import { capChange } from "../src/admin.js";
import { BOUNDS, check, problem, sumProblem } from "../src/bounds.js";
import { InvalidInputError } from "../src/errors.js";
import { parsePolicy } from "../src/policyFile.js";
import { VECTORS, type Json } from "./vectors.js";

test("the table is Python's", () => {
  const table = Object.fromEntries(Object.entries(BOUNDS).map(([k, b]) => [k, [b.low, b.high, b.note]]));
  assert.deepEqual(table, VECTORS.bounds.table);
});

test("every case gets Python's answer", () => {
  for (const c of VECTORS.bounds.cases as Json[]) {
    assert.equal(problem(c.kind, c.value), c.problem, JSON.stringify(c));
  }
  for (const c of VECTORS.bounds.sums as Json[]) {
    assert.equal(sumProblem(c.kind, c.total, c.amount), c.problem, JSON.stringify(c));
  }
});

test("a refusal is one line naming the field and the value", () => {
  assert.throws(
    () => check("until", 1e300, "until"),
    (err: unknown) => err instanceof InvalidInputError && err.field === "until" && !err.message.includes("\n"),
  );
});

test("setCap refuses an until past year 9999 at the door", () => {
  const policy = parsePolicy(VECTORS.policies.good.caps_and_plans.toml);
  const late = new Date("9999-12-31T23:59:59-12:00"); // year 10000 in UTC
  for (const until of [1e300, 253_402_300_799, late]) {
    assert.throws(
      () => capChange(policy, "tenant_spend", { tenant: "a" }, 1, until, 1_764_442_477),
      (err: unknown) => err instanceof InvalidInputError && err.field === "until",
    );
  }
});
