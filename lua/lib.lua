-- Shared helpers, prepended to every script at load time (Redis scripts cannot
-- import one another). They implement the counter model of counters.py:
-- a hash per counter with 'c' (committed), 'f' (in-flight total) and
-- 'e:<event id>' (in-flight amount of one event, moved once by apply).
--
-- Amounts travel as decimal strings and are handed to HINCRBY as given:
-- Lua 5.1 formats large numbers as 1e+15, which HINCRBY would reject.
--
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

-- A session counter's key ends with the session bucket (windows.SESSION_BUCKET;
-- scope values are escaped, so no other key can end so).
local SESSION_SUFFIX = ':session'

local function is_session(key)
  return string.sub(key, -#SESSION_SUFFIX) == SESSION_SUFFIX
end

-- The exact range (counters.MAX_COUNTER, counters.stays_exact): a counter's
-- committed and in-flight parts and its total stay within +-(2^53 - 1), where
-- Lua's doubles count exactly. A stored part outside it still compares as
-- outside (doubles round monotonically; the bound is representable), so the
-- test itself is exact.
local MAX_EXACT = 9007199254740991

-- A counter's committed and in-flight parts, as numbers (0 when absent).
local function parts_of(key)
  local v = redis.call('HMGET', key, 'c', 'f')
  return tonumber(v[1]) or 0, tonumber(v[2]) or 0
end

-- Whether the parts are exact and stay so with amount added (to committed when inline).
local function stays_exact(c, f, amount, inline)
  if inline then c = c + amount else f = f + amount end
  local t = c + f  -- compared inline: a Lua call per bound costs more than the test
  return c >= -MAX_EXACT and c <= MAX_EXACT and f >= -MAX_EXACT and f <= MAX_EXACT
    and t >= -MAX_EXACT and t <= MAX_EXACT
end

-- The epoch marker is whole only as a string of the shape keys.EPOCH_VALUE
-- gives it (a test holds the two together): a hash or a set left at its name
-- by a stray write is no proof that the counters are complete.
local function epoch_ok(key)
  if redis.call('TYPE', key).ok ~= 'string' then return false end
  local value = redis.call('GET', key)
  return #value <= 64 and string.find(value, '^[%w][%w_.%-]*$') ~= nil
end

-- A counter's committed and in-flight parts and its grant (field 'g': extra room
-- this bucket, not spend), in one read, and whether the counter holds any of them.
local function parts_and_grant(key)
  local v = redis.call('HMGET', key, 'c', 'f', 'g')
  return tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0,
    (v[1] or v[2] or v[3]) ~= false
end

-- The effective cap of one counter: caps.resolve / caps.effective, step for step
-- (default: the policy's cap, a number).
-- field '' means no run-time lookup (a global limit). A run-time value cap is
-- "<cap> <until>" in the limit's caps hash and holds while now < until (0: for
-- good); then the policy's value cap; then the plan assigned at run time to the
-- first of plan_fields (comma-separated) found in the plans hash, else file_plan, when plan_caps
-- ("<plan> <cap> ...", the plans that cap this limit) names it; else the default.
-- One call's counters share their user and tenant, so each plan assignment and
-- the caller's clock (seconds) are read once per script call, not once per counter.
local assigned_plan = {}
local clock_s = nil

local function effective_cap(caps_key, plans_key, field, default, value_cap,
                             plan_fields, plan_caps, file_plan)
  if field == '' then return default end
  local rt = redis.call('HGET', caps_key, field)
  if rt then
    local cap, untl = string.match(rt, '^(%d+) (%d+)')
    if cap then
      untl = tonumber(untl)
      if untl ~= 0 and clock_s == nil then clock_s = math.floor(caller_ms() / 1000) end
      if untl == 0 or clock_s < untl then return tonumber(cap) end
    end
  end
  if value_cap ~= '' then return tonumber(value_cap) end
  if plan_caps == '' then return default end
  local plan = false
  for f in string.gmatch(plan_fields, '[^,]+') do
    plan = assigned_plan[f]
    if plan == nil then
      plan = redis.call('HGET', plans_key, f)
      assigned_plan[f] = plan
    end
    if plan then break end
  end
  if not plan then plan = file_plan end
  if plan ~= '' then
    for name, cap in string.gmatch(plan_caps, '(%S+) (%S+)') do
      if name == plan then return tonumber(cap) end
    end
  end
  return default
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
--
-- How many live waiters come before `ticket` ('-': everyone, the caller waits
-- in no queue), counting at most `room` of them: the caller fits in a lease
-- set with `room` free slots only when fewer than `room` wait ahead of it, so
-- a slot that frees goes to the oldest waiter, whoever polls first.
-- Returns that count and whether the ticket was found among them.
local QUEUE_PREFIX = 'mcpbg:v1:_wait:{'

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

-- Join a queue (a refused waiting call; a ticket already queued keeps its place).
local function join_queue(queue, ticket, now)
  local wait_ms = tonumber(string.match(ticket, '/(%d+)$')) or 0
  redis.call('ZADD', queue, 'NX', string.format('%.0f', now), ticket)
  if redis.call('PTTL', queue) < wait_ms then
    redis.call('PEXPIRE', queue, wait_ms)
  end
end
