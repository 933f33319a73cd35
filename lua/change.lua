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
-- A counter's grants stay within the exact range (counters.grant_problem),
-- checked for every change before the first write: all or none.
local grants = {}
local check = string.gmatch(ARGV[1], '%S+')
while true do
  local kind = check()
  if not kind then break end
  local pos, _, amount, untl = check(), check(), check(), check()
  check()
  check()
  if (kind == 'granted' or kind == 'reset') and tonumber(untl) > now then
    local key = KEYS[tonumber(pos)]
    if grants[key] == nil then grants[key] = tonumber(redis.call('HGET', key, 'g') or '0') end
    local g = tonumber(amount)
    if kind == 'granted' then
      if not (grants[key] + g <= 9007199254740991) then
        return redis.error_reply('mcpbg change: refused: ' .. key .. ': grant '
          .. string.format('%.0f', grants[key]) .. ' + ' .. amount
          .. ' would leave the exact range (at most 9007199254740991)')
      end
      g = grants[key] + g
    end
    grants[key] = g
  end
end
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
