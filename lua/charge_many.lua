-- Several charges in one script call: the checks of one coalesced write
-- (projections/counters/autopipe.py, Batched), each decided by charge.lua itself,
-- in arrival order, as if each were its own EVALSHA. Not loaded on its own:
-- mcp_budget_governor.lua.many_source puts charge.lua's whole source (prelude
-- and body) where the line CHARGE_LUA stands, so charge.lua stays the one
-- home of the admission rule; tests/test_charge_many.py holds the two to the
-- same replies and the same counters.
--
-- KEYS   each charge's keys, one charge after another
-- ARGV   per charge: its number of keys, its number of arguments, then its
--        arguments (charge.lua's ARGV, the caller's clock last)
--
-- Returns one reply per charge, in order: charge.lua's reply, or an error
-- reply where charge.lua would have raised (that charge alone).
--
-- What it saves is Redis' own work per charge: a counter is read once (HMGET)
-- and written once (HSET of its parts' final values, exact where their sum
-- of changes might not be) per script call, and a caps or plans field read
-- once; the operation markers and everything else go to Redis as charge.lua
-- makes them. An expiry is set when charge.lua sets it, the counter's parts
-- written first and read again after (an expiry already past deletes it). A
-- stored part or an amount that HINCRBY would refuse goes to HINCRBY as
-- charge.lua sends it, so its error reaches the charge that met it, no other.

local real = redis
-- Per counter key: {committed, in flight, grant, {part = true: changed}}; the
-- parts as HMGET gave them until a charge adds to them, numbers after.
local held, order, fields = {}, {}, {}

-- What HINCRBY takes as an integer (Redis' string2ll): no sign '+', no leading
-- zero, no '-0'. Anything longer than 2^53 is refused as inexact before a write.
local function integer(v)
  return v == false or type(v) == 'number' or v == '0'
    or string.find(v, '^%-?[1-9]%d*$') ~= nil
end

local PARTS = {'c', 'f'}

-- The changed parts of a held counter, written.
local function write(key, e)
  local changed = e[4]
  for part = 1, 2 do
    if changed[part] then
      real.call('HSET', key, PARTS[part], string.format('%.0f', e[part]))
    end
  end
  held[key] = nil
end

-- redis.call as charge.lua sees it: its counter reads and writes (HMGET c f g,
-- HINCRBY c or f, EXPIREAT) and its caps and plans reads (HGET) are answered
-- here; anything else is Redis' own.
local function call(cmd, key, ...)
  if cmd == 'HMGET' then
    local e = held[key]
    if e == nil then
      local v = real.call('HMGET', key, ...)  -- charge.lua asks for 'c', 'f', 'g'
      e = {v[1], v[2], v[3], {}}
      held[key] = e
      order[#order + 1] = key
    end
    return {e[1], e[2], e[3]}
  elseif cmd == 'HINCRBY' then
    local field, amount = ...
    local e = held[key]
    local part = field == 'c' and 1 or field == 'f' and 2 or nil
    if e == nil or part == nil or not integer(e[part]) or not integer(amount) then
      return real.call('HINCRBY', key, field, amount)
    end
    e[part] = (tonumber(e[part]) or 0) + tonumber(amount)
    e[4][part] = true
    return e[part]
  elseif cmd == 'EXPIREAT' then
    local e = held[key]
    if e then write(key, e) end
    return real.call(cmd, key, ...)
  elseif cmd == 'HGET' then
    local field = ...
    local id = key .. '\0' .. field
    local v = fields[id]
    if v == nil then
      v = real.call('HGET', key, field)
      fields[id] = v
    end
    return v
  end
  return real.call(cmd, key, ...)
end
local shim = setmetatable({call = call}, {__index = real})

local function charge(KEYS, ARGV, redis)
CHARGE_LUA
end

local replies = {}
local k, a = 1, 1
while a <= #ARGV do
  local nk, na = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local ok, reply = pcall(charge, {unpack(KEYS, k, k + nk - 1)}, {unpack(ARGV, a + 2, a + 1 + na)}, shim)
  if not ok then
    reply = real.error_reply(type(reply) == 'table' and reply.err or tostring(reply))
  end
  replies[#replies + 1] = reply
  k, a = k + nk, a + 2 + na
end
for _, key in ipairs(order) do
  local e = held[key]
  if e then write(key, e) end
end
return replies
