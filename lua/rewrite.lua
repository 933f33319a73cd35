-- Rewrite counters from the ledger (mcpbg replay / reconcile --fix), refused
-- if the projection moved since the caller read it.
--
-- KEYS[1]    the watermark hash
-- KEYS[2..]  the counters to rewrite
-- ARGV[1]    'set' (committed := amount) or 'add' (committed += amount, a
--            correction that stays right whatever a projector applies)
-- ARGV[2]    number of expected watermark fields, then field, offset pairs:
--            the hash as the caller read it; any difference (a projector
--            applied meanwhile) returns -1 and writes nothing. -1: no check
-- then per counter (in KEYS order): amount, expire_at (0: leave the expiry
--            as it is), number of in-flight event ids to drop, and those ids
-- then       number of watermark fields to set, then field, offset pairs
--
-- Amounts are decimal strings handed to HSET/HINCRBY untouched (no double
-- rounding); each dropped in-flight entry is
-- removed and its stored amount taken off the in-flight total, exactly as
-- apply.lua moves it. Returns the number of counters written.

local adding = ARGV[1] == 'add'
local expected = tonumber(ARGV[2])
local pos = 3
if expected >= 0 then
  local marks = redis.call('HGETALL', KEYS[1])
  if #marks ~= 2 * expected then
    return -1
  end
  local want = {}
  for _ = 1, expected do
    want[ARGV[pos]] = ARGV[pos + 1]
    pos = pos + 2
  end
  for i = 1, #marks, 2 do
    if want[marks[i]] ~= marks[i + 1] then
      return -1
    end
  end
end
for k = 2, #KEYS do
  local key = KEYS[k]
  if adding then
    if ARGV[pos] ~= '0' then redis.call('HINCRBY', key, 'c', ARGV[pos]) end
  else
    redis.call('HSET', key, 'c', ARGV[pos])
  end
  local expire_at = ARGV[pos + 1]
  local drops = tonumber(ARGV[pos + 2])
  pos = pos + 3
  for _ = 1, drops do
    local field = 'e:' .. ARGV[pos]
    local pending = redis.call('HGET', key, field)
    if pending then
      if pending ~= '0' then redis.call('HINCRBY', key, 'f', negate(pending)) end
      redis.call('HDEL', key, field)
    end
    pos = pos + 1
  end
  if expire_at ~= '0' then redis.call('EXPIREAT', key, expire_at) end
end
local sets = tonumber(ARGV[pos])
pos = pos + 1
for _ = 1, sets do
  redis.call('HSET', KEYS[1], ARGV[pos], ARGV[pos + 1])
  pos = pos + 2
end
return #KEYS - 1
