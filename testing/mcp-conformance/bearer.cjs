// Preloaded into the conformance suite's Node process (NODE_OPTIONS=--require).
// mcpbg proxy names an HTTP caller by bearer token and refuses an unnamed one; the
// suite's client sends no header, so every fetch it makes carries the run's token.
"use strict";
const plainFetch = globalThis.fetch;
globalThis.fetch = (input, init = {}) => {
  const headers = new Headers(init.headers);
  if (!headers.has("authorization")) headers.set("authorization", "Bearer conformance");
  return plainFetch(input, { ...init, headers });
};
