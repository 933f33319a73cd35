-- Atomic, all-or-nothing charge over every counter a call touches: check(),
-- reserve, meter and settle all come here, in one round trip.
--
-- ARGV[1]      event id ('' commits inline: no ledger); flagged 'o', the
--              operation id of an inline charge
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

local event_id = ARGV[1]
local flags = ARGV[2]
local first = 1
if string.find(flags, 'e', 1, true) then
  if not epoch_ok(KEYS[1]) then
    return {-1}
  end
  first = 2
end
local op_key = nil
if string.find(flags, 'o', 1, true) then
  op_key = KEYS[first]
  first = first + 1
  event_id = ''
end
local inline = event_id == ''
local sliding = string.find(flags, 's', 1, true) ~= nil
local resolve = string.find(flags, 'c', 1, true) ~= nil
local granted = not resolve and string.find(flags, 'g', 1, true) ~= nil
local width = resolve and 5 or 4
local off = 3
local lease_id, lease_until, ticket, queues, now = nil, 0, '-', 0, 0
if string.find(flags, 'l', 1, true) then
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
local result = {0}
local refused = 0
-- Each counter's amount and default cap are parsed once (tonumber of a 16-digit
-- cap is a strtod), and whether its admitted amount keeps it exact is known from
-- the first pass: the first counter it would not is reported only when nothing
-- refused, as before.
local unexact = 0
local caps, leased, held = {}, {}, {}
local queue_of, q = {}, 0
for i = 1, n do
  local base = off + (i - 1) * width
  local key = KEYS[first + i - 1]
  local amount = tonumber(ARGV[base])
  local c, f, g
  if lease_id and is_lease(key) then
    c, f, g = live_leases(key), 0, 0
    q = q + 1
    queue_of[i] = KEYS[#KEYS - queues + q]
    leased[i] = true
  else
    c, f, g, held[i] = parts_and_grant(key)
    if not stays_exact(c, f, 0, inline) then
      if op_key then redis.call('DEL', op_key) end
      return {-2, i}
    end
    if unexact == 0 and not stays_exact(c, f, amount, inline) then
      unexact = i
    end
  end
  local used = c + f
  result[i + 1] = used
  local cap = tonumber(ARGV[base + 1])
  if resolve then
    local ref = ARGV[base + 4]
    local field, value_cap, file_plan, plan_fields, plan_caps = ref, '', '', '', ''
    local sp = string.find(ref, ' ', 1, true)
    if sp then
      field = string.sub(ref, 1, sp - 1)
      local rest
      value_cap, file_plan, plan_fields, rest = string.match(ref, '^(%S+) (%S+) ?(%S*) ?(.*)$', sp + 1)
      plan_caps = rest or ''
      if value_cap == '-' then value_cap = '' end
      if file_plan == '-' then file_plan = '' end
    end
    cap = effective_cap(KEYS[first + n + i - 1], KEYS[#KEYS - queues], field, cap,
      value_cap, plan_fields, plan_caps, file_plan) + g
    caps[i] = cap
  elseif granted then
    cap = cap + g
    caps[i] = cap
  end
  local waiting = 0
  if queue_of[i] and cap > used then
    waiting = waiters_ahead(queue_of[i], ticket, cap - used, now)
  end
  if refused == 0 and ARGV[base + 2] == '1'
      and not fits(used + waiting, amount, cap) then
    refused = i
  end
end
if resolve or granted then
  for i = 1, n do result[n + i + 1] = caps[i] end
end
if not string.find(flags, 'u', 1, true) then
  result = {0}
end
if refused > 0 then
  if ticket ~= '-' and queue_of[refused] then  -- only a full lease set is worth waiting for
    for i = 1, n do
      if queue_of[i] then join_queue(queue_of[i], ticket, now) end
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
for i = 1, n do
  local base = off + (i - 1) * width
  local amount = ARGV[base]
  local key = KEYS[first + i - 1]
  if leased[i] then
    take_lease(key, lease_id, lease_until)
    if ticket ~= '-' then redis.call('ZREM', queue_of[i], ticket) end
  elseif amount ~= '0' then
    local expire_at = nil  -- a held window counter keeps its expiry (lib.lua add)
    if not held[i] or (sliding and is_session(key)) then expire_at = ARGV[base + 3] end
    add(key, amount, event_id, expire_at)
    wrote = true
  end
end
if op_key and not wrote then
  redis.call('DEL', op_key)
end
return result
