-- Shared helpers (Redis scripts cannot import one another): at load time each
-- script gets this header and the definitions below that it uses, directly or
-- through one another (lua/__init__.py). So every top-level line is a
-- `local function NAME(` ... `end` or a one-line `local NAME = ...`, with its
-- comment just above it. They implement the counter model of counters.py:
-- a hash per counter with 'c' (committed), 'f' (in-flight total) and
-- 'e:<event id>' (in-flight amount of one event, moved once by apply).
--
-- Amounts travel as decimal strings and are handed to HINCRBY as given:
-- Lua 5.1 formats large numbers as 1e+15, which HINCRBY would reject.

-- The clock is the caller's: no script calls TIME (managed services such as
-- some serverless Redis refuse it in scripts). Every script that needs the
-- time takes it as its LAST argument, ARGV[#ARGV], in epoch milliseconds
-- (an integer string); docs/clocks.md bounds what skew between callers does.
local function caller_ms()
  local ms = tonumber(ARGV[#ARGV])
  if ms == nil or ms < 0 or ms ~= math.floor(ms) then
    error({err = 'mcpbg: the last argument must be the caller clock (epoch ms), got '
      .. tostring(ARGV[#ARGV])})
  end
  return ms
end

local function negate(amount)
  if string.sub(amount, 1, 1) == '-' then return string.sub(amount, 2) end
  return '-' .. amount
end

-- Add a charge: committed inline when there is no event id, in-flight otherwise.
-- expire_at, when given, (re)sets the counter's expiry. charge.lua gives it only
-- to a counter it creates (the same atomic script, so the expiry cannot be
-- lost) and to a session counter (whose expiry slides with each write); a
-- window's counter keeps the bucket's end plus grace it was created with.
-- The projection (apply.lua) gives it on every write.
local function add(key, amount, event_id, expire_at)
  if event_id == '' then
    redis.call('HINCRBY', key, 'c', amount)
  else
    redis.call('HINCRBY', key, 'f', amount)
    redis.call('HINCRBY', key, 'e:' .. event_id, amount)
  end
  if expire_at then redis.call('EXPIREAT', key, expire_at) end
end

-- The epoch marker is whole only as a string of the shape keys.EPOCH_VALUE
-- gives it (a test holds the two together): a hash or a set left at its name
-- by a stray write is no proof that the counters are complete.
local function epoch_ok(key)
  if redis.call('TYPE', key).ok ~= 'string' then return false end
  local value = redis.call('GET', key)
  return #value <= 64 and string.find(value, '^[%w][%w_.%-]*$') ~= nil
end

-- The shapes of the keys a run-time change may write (caps.caps_key, caps.PLANS_KEY).
local function change_key_ok(key)
  return string.find(key, '^mcpbg:v1:_caps:%w[%w_.%-]*$') ~= nil or key == 'mcpbg:v1:_plans'
end

-- Apply one run-time change (caps.Change; projections/memory_counters.py _change):
-- cap_set / cap_unset a value cap, plan_assigned (plan '-': unassigned), granted
-- (adds to the counter's grant) and reset (sets it), the last two only while the
-- bucket lives, repairing its expiry. why is the change's actor and reason,
-- percent-encoded (caps.why_token), kept next to the cap ("<cap> <until> <why>")
-- or in the counter's field 'w', for `mcpbg caps list`.
local function apply_change(kind, key, field, amount, untl, plan, why, now)
  if kind == 'cap_set' then
    redis.call('HSET', key, field, amount .. ' ' .. untl .. ' ' .. why)
  elseif kind == 'cap_unset' then
    redis.call('HDEL', key, field)
  elseif kind == 'plan_assigned' then
    if plan == '-' then redis.call('HDEL', key, field) else redis.call('HSET', key, field, plan) end
  elseif tonumber(untl) > now then
    if kind == 'granted' then
      redis.call('HINCRBY', key, 'g', amount)
    else
      redis.call('HSET', key, 'g', amount)
    end
    redis.call('HSET', key, 'w', why)
    redis.call('EXPIREAT', key, untl)
  end
end

-- Leases (concurrency caps): a sorted set per cap and scope value
-- (mcpbg:v1:_lease:<limit>:<scope>), member the lease id, score its expiry in
-- epoch milliseconds of the caller's clock (caller_ms; docs/clocks.md: skew
-- between replicas moves an expiry by at most that skew).
local LEASE_PREFIX = 'mcpbg:v1:_lease:'

local function is_lease(key)
  return string.sub(key, 1, #LEASE_PREFIX) == LEASE_PREFIX
end

local function now_ms()
  return caller_ms()
end

-- The leases still alive: the expired ones (a process that died holding them)
-- are dropped first.
local function live_leases(key)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%.0f', now_ms()))
  return redis.call('ZCARD', key)
end

-- Take (or renew) a lease until 'until' (ms); the set lives as long as its
-- last lease, so an abandoned set disappears by itself. The set's expiry is
-- relative (PEXPIRE: the last lease's time left by the caller's clock), so a
-- caller whose clock is off Redis' own cannot make Redis drop live leases.
local function take_lease(key, lease_id, until_ms)
  local score = string.format('%.0f', until_ms)
  redis.call('ZADD', key, score, lease_id)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  local left = tonumber(last[2]) - caller_ms()
  if left < 1 then left = 1 end
  redis.call('PEXPIRE', key, string.format('%.0f', left))
end

-- Waiting calls (Governor.admitted(wait=)): a queue per lease set
-- (keys.queue_key: mcpbg:v1:_wait:{<lease set>}, the lease set's own cluster
-- slot), member the caller's ticket "<id>/<wait ms>", score its arrival (ms of
-- Redis' clock). A ticket holds its place until arrival + wait; expired ones
-- are dropped as the scan meets them.
local QUEUE_PREFIX = 'mcpbg:v1:_wait:{'

-- How many live waiters come before `ticket` ('-': everyone, the caller waits
-- in no queue), counting at most `room` of them: the caller fits in a lease
-- set with `room` free slots only when fewer than `room` wait ahead of it, so
-- a slot that frees goes to the oldest waiter, whoever polls first.
-- Returns that count and whether the ticket was found among them.
local function waiters_ahead(queue, ticket, room, now)
  local ahead, start, dead = 0, 0, {}
  while ahead < room do
    local batch = redis.call('ZRANGE', queue, start, start + room - 1, 'WITHSCORES')
    if #batch == 0 then break end
    for j = 1, #batch, 2 do
      local member = batch[j]
      local wait_ms = tonumber(string.match(member, '/(%d+)$')) or 0
      if tonumber(batch[j + 1]) + wait_ms <= now then
        dead[#dead + 1] = member
      elseif member == ticket then
        if #dead > 0 then redis.call('ZREM', queue, unpack(dead)) end
        return ahead, true
      else
        ahead = ahead + 1
        if ahead >= room then break end
      end
    end
    start = start + #batch / 2
  end
  if #dead > 0 then redis.call('ZREM', queue, unpack(dead)) end
  return ahead, false
end
