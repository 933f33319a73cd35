-- Atomic, all-or-nothing charge over every counter a call touches: check(),
-- reserve, meter and settle all come here, in one round trip.
--
-- KEYS[1]      the epoch marker; KEYS[2..] the counters
-- ARGV[1]      event id ('' commits inline: no ledger)
-- ARGV[2]      '1' when the epoch marker must exist (ledger mode: a Redis that
--              restarted empty must not admit from empty counters)
-- ARGV[3..]    per counter: amount, cap, enforce ('1' may refuse), expire_at
--
-- Returns {refused, used...}: refused is 0 when admitted, else the 1-based
-- position of the first refusing counter (nothing was written); -1 when the
-- epoch marker is missing. used holds each counter's total before the charge.

local event_id = ARGV[1]
if ARGV[2] == '1' and redis.call('EXISTS', KEYS[1]) == 0 then
  return {-1}
end

local n = #KEYS - 1
local result = {0}
local refused = 0
for i = 1, n do
  local base = 2 + (i - 1) * 4
  local used = used_of(KEYS[i + 1])
  result[i + 1] = used
  if refused == 0 and ARGV[base + 3] == '1'
      and not fits(used, tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2])) then
    refused = i
  end
end
if refused > 0 then
  result[1] = refused
  return result
end

for i = 1, n do
  local base = 2 + (i - 1) * 4
  local amount = ARGV[base + 1]
  if amount ~= '0' then
    add(KEYS[i + 1], amount, event_id, ARGV[base + 4])
  end
end
return result
