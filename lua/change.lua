-- Run-time changes written directly (no ledger): caps, plan assignments, grants,
-- resets, all in one step, through the same apply_change the projection uses.
--
-- KEYS     the keys the changes write (caps hashes, the plans hash, counters)
-- ARGV[1]  the changes, space-separated tokens, per change: kind, key position,
--          field ('-' for none), amount, until, plan ('-' for none), why (caps.why_token)
-- ARGV[2]  the caller's clock, epoch ms (lib.lua caller_ms): a grant or reset
--          whose bucket has ended changes nothing
-- Every key is checked first: a counter key or a change key, else nothing is written.
for i = 1, #KEYS do
  if not (change_key_ok(KEYS[i]) or string.find(KEYS[i], '^mcpbg:v1:%w[%w_.%-]*:[^:]+:[^:]+$')) then
    return redis.error_reply('mcpbg change: refused: ' .. KEYS[i] .. ' is no key a change writes')
  end
end
local now = math.floor(caller_ms() / 1000)
local token = string.gmatch(ARGV[1], '%S+')
local n = 0
while true do
  local kind = token()
  if not kind then break end
  local pos, field, amount, untl, plan, why = token(), token(), token(), token(), token(), token()
  apply_change(kind, KEYS[tonumber(pos)], field, amount, untl, plan, why, now)
  n = n + 1
end
return n
