-- Shared helpers, prepended to every script at load time (Redis scripts cannot
-- import one another). They implement the counter model of counters.py:
-- a hash per counter with 'c' (committed), 'f' (in-flight total) and
-- 'e:<event id>' (in-flight amount of one event, moved once by apply).
--
-- Amounts travel as decimal strings and are handed to HINCRBY as given:
-- Lua 5.1 formats large numbers as 1e+15, which HINCRBY would reject.

local function used_of(key)
  local v = redis.call('HMGET', key, 'c', 'f')
  return (tonumber(v[1]) or 0) + (tonumber(v[2]) or 0)
end

-- The one admission rule (counters.fits): a zero charge needs one unit of room.
local function fits(used, amount, cap)
  if amount < 1 then amount = 1 end
  return used + amount <= cap
end

local function negate(amount)
  if string.sub(amount, 1, 1) == '-' then return string.sub(amount, 2) end
  return '-' .. amount
end

-- Add a charge: committed inline when there is no event id, in-flight otherwise.
-- Every write repairs the expiry, so a lost EXPIRE can never make a counter immortal.
local function add(key, amount, event_id, expire_at)
  if event_id == '' then
    redis.call('HINCRBY', key, 'c', amount)
  else
    redis.call('HINCRBY', key, 'f', amount)
    redis.call('HINCRBY', key, 'e:' .. event_id, amount)
  end
  redis.call('EXPIREAT', key, expire_at)
end

-- The exact range (counters.MAX_COUNTER, counters.stays_exact): a counter's
-- committed and in-flight parts and its total stay within +-(2^53 - 1), where
-- Lua's doubles count exactly. A stored part outside it still compares as
-- outside (doubles round monotonically; the bound is representable), so the
-- test itself is exact.
local MAX_EXACT = 9007199254740991

local function exact(v)
  return v >= -MAX_EXACT and v <= MAX_EXACT
end

-- A counter's committed and in-flight parts, as numbers (0 when absent).
local function parts_of(key)
  local v = redis.call('HMGET', key, 'c', 'f')
  return tonumber(v[1]) or 0, tonumber(v[2]) or 0
end

-- Whether the parts are exact and stay so with amount added (to committed when inline).
local function stays_exact(c, f, amount, inline)
  if inline then c = c + amount else f = f + amount end
  return exact(c) and exact(f) and exact(c + f)
end

-- The epoch marker is whole only as a string of the shape keys.EPOCH_VALUE
-- gives it (a test holds the two together): a hash or a set left at its name
-- by a stray write is no proof that the counters are complete.
local function epoch_ok(key)
  if redis.call('TYPE', key).ok ~= 'string' then return false end
  local value = redis.call('GET', key)
  return #value <= 64 and string.find(value, '^[%w][%w_.%-]*$') ~= nil
end
