-- Atomic, all-or-nothing charge over every counter a call touches: check(),
-- reserve, meter and settle all come here, in one round trip.
--
-- ARGV[1]      event id ('' commits inline: no ledger); flagged 'o', the
--              operation id of an inline charge. "<admission id> <cost id> <j>"
--              (a space: ids hold none) when the call's fixed price is charged
--              with its admission: counters j.. hold in-flight amounts of the
--              cost event, the ones before of the admission (two ledger events,
--              one round trip)
-- ARGV[2]      flags: 'e' when KEYS[1] is the epoch marker and must be whole (epoch_ok)
--              (ledger mode: a Redis that restarted empty must not admit from
--              empty counters); 'u' to reply with every counter's total;
--              'o' when the next key is the marker of operation ARGV[1]
--              'c' when each counter's effective cap is resolved here (caps.py)
--              'g' when each counter's cap is already its effective cap (resolved by
--              the caller: Redis Cluster, whose caps and plans hashes live in other
--              slots) and only its grant is added here; the reply as flagged 'c'
--              's' when some counters are session counters (keys.slides), whose
--              expiry every write moves; a window's counter keeps the expiry
--              its first write gave it (lib.lua add)
--              'l' when some counters are lease sets (keys.lease_key): then
--              ARGV[3] is the lease id, ARGV[4] its time to live (ms), ARGV[5]
--              the waiting call's ticket ('-': not waiting; lib.lua
--              waiters_ahead), ARGV[6] how many lease sets (each one's queue
--              key comes last in KEYS, in counter order), and the counters'
--              arguments start at ARGV[7]
-- ARGV[3..]    per counter: amount, cap, enforce ('1' may refuse), expire_at;
--              flagged 'c', one more: the scope field ('' for none), then only
--              when the policy has them, space-separated: the policy's value cap
--              ('-' for none), the policy's plan ('-'), the plan fields
--              (comma-separated) and per plan capping the limit "<plan> <cap>"
--              (caps.CapRef; one argument: the common case costs one short string)
-- ARGV[#ARGV]  last, after the counters: the caller's clock, epoch ms (lib.lua
--              caller_ms; read only for a run-time cap with an until and for leases)
-- KEYS         the epoch marker first when flagged 'e', then the operation
--              marker when flagged 'o', then the counters; flagged 'c', then
--              each counter's caps hash (mcpbg:v1:_caps:<limit>) and last the
--              plans hash (mcpbg:v1:_plans); flagged 'l', last the queue of
--              each lease set (keys.queue_key)
--
-- Flagged 'c' (or 'g'), a counter is compared with its effective cap plus its grant
-- (field 'g' of the counter: room for this bucket, not spend), and the reply
-- flagged 'u' also carries those caps: {refused, used..., caps...}.
--
-- Returns {refused} or, flagged 'u', {refused, used...}: refused is 0 when
-- admitted, else the 1-based position of the first refusing counter (nothing
-- was written); -1 when the epoch marker is missing or not whole (epoch_ok);
-- {-2, i} when counter i is outside the exact range, or an admitted charge would take it out
-- (stays_exact; nothing was written). used holds
-- each counter's total before the charge.
--
-- A lease set (a concurrency cap) counts its live leases: expired ones are
-- pruned (ZREMRANGEBYSCORE up to the caller's clock), the rest counted (ZCARD) and
-- compared with the cap like any counter (amount 1); admitted, the lease id is
-- added scored by its expiry. No grant, no in-flight part, nothing for the ledger.
-- Calls waiting for a slot come first: a lease set with r free slots admits
-- only a caller with fewer than r live waiters ahead of it (lib.lua
-- waiters_ahead); a refused waiting call joins the queue of every lease set of
-- the call, and an admitted one leaves them.
--
-- An operation marker makes an inline charge idempotent: a charge replayed
-- after its reply came too late finds the marker and changes nothing ({0}).
-- The marker lives OP_HORIZON seconds (keys.OP_HORIZON_SECONDS): long enough
-- for the replay that follows an outage, short of holding a bucket's every id.
local OP_HORIZON = 900

-- The exact range (counters.MAX_COUNTER, counters.stays_exact): a counter's
-- committed and in-flight parts and its total stay within +-(2^53 - 1), where
-- Lua's doubles count exactly. A stored part outside it still compares as
-- outside (doubles round monotonically; the bound is representable), so the
-- test itself is exact. The tests below are written out where they are made
-- (a Lua call per counter costs more than the test) and in the positive form,
-- so that a part read as nan is outside too.
local MAX_EXACT = 9007199254740991

-- A session counter's key ends with the session bucket (windows.SESSION_BUCKET;
-- scope values are escaped, so no other key can end so).
local SESSION_SUFFIX = ':session'

-- The effective cap of one counter: caps.resolve / caps.effective, step for step
-- (default: the policy's cap, a number). ref is the counter's cap argument
-- (ARGV flagged 'c'): the scope field, '' meaning no run-time lookup (a global
-- limit), then only when the policy has them, space-separated: the policy's
-- value cap ('-' none), its plan ('-'), the plan fields (comma-separated) and
-- "<plan> <cap>" per plan capping the limit. A run-time value cap is
-- "<cap> <until>" in the limit's caps hash and holds while now < until (0: for
-- good); then the policy's value cap; then the plan assigned at run time to the
-- first of the plan fields found in the plans hash, else the policy's plan,
-- when the plan caps name it; else the default.
-- One call's counters share their user and tenant, so each plan assignment and
-- the caller's clock (seconds) are read once per script call, not once per counter.
local assigned_plan = nil
local clock_s = nil

local function effective_cap(caps_key, plans_key, ref, default)
  local field, rest = ref, nil
  local sp = string.find(ref, ' ', 1, true)
  if sp then
    field = string.sub(ref, 1, sp - 1)
    rest = string.sub(ref, sp + 1)
  end
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
  if not rest then return default end
  local value_cap, file_plan, plan_fields, plan_caps = string.match(rest, '^(%S+) (%S+) ?(%S*) ?(.*)$')
  if value_cap ~= '-' then return tonumber(value_cap) end
  if (plan_caps or '') == '' then return default end
  if file_plan == '-' then file_plan = '' end
  if assigned_plan == nil then assigned_plan = {} end
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

local event_id = ARGV[1]
local flags = ARGV[2]
-- The cost event's id and its first counter, when ARGV[1] names two events.
local cost_id, cost_from = nil, 0
if string.find(event_id, ' ', 1, true) then
  local a, b, j = string.match(event_id, '^(%S+) (%S+) (%d+)$')
  if not a then
    return redis.error_reply('mcpbg charge: expected "<event id> <cost id> <counter>", got '
      .. event_id)
  end
  event_id, cost_id, cost_from = a, b, tonumber(j)
end
-- The flags, read in one pass (a string.find per flag costs more).
local f_e, f_o, f_u, f_c, f_g, f_s, f_l = false, false, false, false, false, false, false
for j = 1, #flags do
  local ch = string.sub(flags, j, j)
  if ch == 'u' then f_u = true
  elseif ch == 'o' then f_o = true
  elseif ch == 'c' then f_c = true
  elseif ch == 'e' then f_e = true
  elseif ch == 'g' then f_g = true
  elseif ch == 's' then f_s = true
  elseif ch == 'l' then f_l = true
  end
end
local first = 1
if f_e then
  if not epoch_ok(KEYS[1]) then
    return {-1}
  end
  first = 2
end
local op_key = nil
if f_o then
  op_key = KEYS[first]
  first = first + 1
  event_id = ''
end
local inline = event_id == ''
local resolve = f_c
local granted = not resolve and f_g
local width = resolve and 5 or 4
local off = 3
local lease_id, lease_until, ticket, queues, now = nil, 0, '-', 0, 0
if f_l then
  lease_id = ARGV[3]
  now = now_ms()
  lease_until = now + tonumber(ARGV[4])
  ticket = ARGV[5]
  queues = tonumber(ARGV[6])
  off = 7
end

-- Exactness first (a counter read inexactly cannot be compared), then the
-- refusal, then whether the admitted amounts keep every counter exact.
local n = #KEYS - first + 1 - queues
if resolve then n = (n - 1) / 2 end
if #ARGV ~= off + n * width then
  return redis.error_reply('mcpbg charge: expected ' .. (off + n * width)
    .. ' arguments (the last the caller clock, epoch ms), got ' .. #ARGV)
end
if op_key then
  -- The marker is taken before anything is read (one call where EXISTS then SET
  -- were two) and given back by every outcome that writes nothing, so a refused
  -- charge leaves none. Past the argument count, nothing below raises on what
  -- the clients build (the conformance vectors hold their arguments).
  if not redis.call('SET', op_key, '1', 'NX', 'EX', OP_HORIZON) then
    return {0}
  end
end
-- {refused, used..., caps...}, each counter's total and cap written as it is read.
-- The tables are made with room for three counters (the nils size them), so
-- a call of up to three grows none of them: growing a table costs more than
-- filling it. The reply ends at the first nil.
local result = {0, nil, nil, nil, nil, nil, nil}
local refused = 0
-- Each counter's amount and default cap are parsed once, by arithmetic (one
-- strtod each, where tonumber makes two and a call; the clients send numbers
-- there, so it never meets a string that tonumber would turn into nil), and
-- whether its admitted amount keeps it exact is known from the first pass: the
-- first counter it would not is reported only when nothing refused, as before.
local unexact = 0
-- Per counter: whether it held anything (a window's counter then keeps the
-- expiry its first write gave it), or a lease set's queue (a string).
local kind = {nil, nil, nil}
local q = 0
local plans_key = KEYS[#KEYS - queues]  -- the lease queues, when any, come after it
local base = off
for i = 1, n do
  local key = KEYS[first + i - 1]
  local amount = ARGV[base] + 0
  local used, g, queue = 0, 0, nil
  if lease_id and is_lease(key) then
    used = live_leases(key)
    q = q + 1
    queue = KEYS[#KEYS - queues + q]
    kind[i] = queue
  else
    -- The committed and in-flight parts and the grant (field 'g': extra room
    -- this bucket, not spend), in one read.
    local v = redis.call('HMGET', key, 'c', 'f', 'g')
    local vc, vf, vg = v[1], v[2], v[3]
    local c = vc and tonumber(vc) or 0
    local f = vf and tonumber(vf) or 0
    used = c + f
    if not (c >= -MAX_EXACT and c <= MAX_EXACT and f >= -MAX_EXACT and f <= MAX_EXACT
        and used >= -MAX_EXACT and used <= MAX_EXACT) then
      if op_key then redis.call('DEL', op_key) end
      return {-2, i}
    end
    if unexact == 0 then  -- the parts with amount added (to committed when inline)
      if inline then c = c + amount else f = f + amount end
      local t = c + f
      if not (c >= -MAX_EXACT and c <= MAX_EXACT and f >= -MAX_EXACT and f <= MAX_EXACT
          and t >= -MAX_EXACT and t <= MAX_EXACT) then
        unexact = i
      end
    end
    if vg then g = tonumber(vg) or 0 end
    kind[i] = (vc or vf or vg) ~= false
  end
  result[i + 1] = used
  local cap = ARGV[base + 1] + 0
  if resolve then
    cap = effective_cap(KEYS[first + n + i - 1], plans_key, ARGV[base + 4], cap) + g
    result[n + i + 1] = cap
  elseif granted then
    cap = cap + g
    result[n + i + 1] = cap
  end
  local waiting = 0
  if queue and cap > used then
    waiting = waiters_ahead(queue, ticket, cap - used, now)
  end
  -- The one admission rule (counters.fits): a zero charge needs one unit of room.
  if refused == 0 and ARGV[base + 2] == '1' then
    if amount < 1 then amount = 1 end
    if not (used + waiting + amount <= cap) then refused = i end
  end
  base = base + width
end
if not f_u then
  result = {0}
end
if refused > 0 then
  if ticket ~= '-' and type(kind[refused]) == 'string' then  -- only a full lease set is worth waiting for
    -- A refused waiting call joins every queue of the call (a ticket already
    -- queued keeps its place); a queue lives as long as its longest wait.
    local wait_ms = tonumber(string.match(ticket, '/(%d+)$')) or 0
    for i = 1, n do
      local queue = kind[i]
      if type(queue) == 'string' then
        redis.call('ZADD', queue, 'NX', string.format('%.0f', now), ticket)
        if redis.call('PTTL', queue) < wait_ms then
          redis.call('PEXPIRE', queue, wait_ms)
        end
      end
    end
  end
  result[1] = refused
  if op_key then redis.call('DEL', op_key) end
  return result
end
if unexact > 0 then
  if op_key then redis.call('DEL', op_key) end
  return {-2, unexact}
end

local wrote = false
base = off
for i = 1, n do
  local amount = ARGV[base]
  local key = KEYS[first + i - 1]
  local held = kind[i]
  if held == true or held == false then
    if amount ~= '0' then
      -- A held window counter keeps its expiry; a session counter's slides.
      local expire_at = nil
      if not held or (f_s and string.sub(key, -#SESSION_SUFFIX) == SESSION_SUFFIX) then
        expire_at = ARGV[base + 3]
      end
      if inline then  -- lib.lua add, written out: a Lua call per counter costs more
        redis.call('HINCRBY', key, 'c', amount)
        if expire_at then redis.call('EXPIREAT', key, expire_at) end
      elseif cost_id and i >= cost_from then
        add(key, amount, cost_id, expire_at)
      else
        add(key, amount, event_id, expire_at)
      end
      wrote = true
    end
  else
    take_lease(key, lease_id, lease_until)
    if ticket ~= '-' then redis.call('ZREM', held, ticket) end
  end
  base = base + width
end
if op_key and not wrote then
  redis.call('DEL', op_key)
end
return result
