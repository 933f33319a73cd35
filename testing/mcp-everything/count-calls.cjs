// Preloaded (NODE_OPTIONS=--require) by tests/test_gateway.py: in the server-everything
// process only, appends one line per tools/call request it reads to $UPSTREAM_CALLS, so the
// test counts the calls the upstream itself saw (not what the proxy says it forwarded).
// Wraps the stdin 'data' handler the server installs rather than adding a listener, which
// would put stdin in flowing mode before the server listens and lose its first messages.
"use strict";
const fs = require("fs");
const out = process.env.UPSTREAM_CALLS;
if (out && /server-everything/.test(process.argv[1] || "")) {
  const on = process.stdin.on;
  process.stdin.on = function (event, handler) {
    if (event !== "data") return on.call(this, event, handler);
    let pending = "";  // a message split across reads
    return on.call(this, event, (chunk) => {
      const lines = (pending + chunk.toString("utf8")).split("\n");
      pending = lines.pop();
      for (const line of lines) {
        const m = /"method"\s*:\s*"tools\/call"[\s\S]*?"name"\s*:\s*"([^"]+)"/.exec(line);
        if (m) fs.appendFileSync(out, `call ${m[1]}\n`);
      }
      handler(chunk);
    });
  };
}
