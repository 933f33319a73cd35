-- Atomic, all-or-nothing charge over every counter a call touches: check(),
-- reserve, meter and settle all come here, in one round trip.
--
-- ARGV[1]      event id ('' commits inline: no ledger)
-- ARGV[2]      flags: 'e' when KEYS[1] is the epoch marker and must exist
--              (ledger mode: a Redis that restarted empty must not admit from
--              empty counters); 'u' to reply with every counter's total
-- ARGV[3..]    per counter: amount, cap, enforce ('1' may refuse), expire_at
-- KEYS         the epoch marker first when flagged 'e', then the counters
--
-- Returns {refused} or, flagged 'u', {refused, used...}: refused is 0 when
-- admitted, else the 1-based position of the first refusing counter (nothing
-- was written); -1 when the epoch marker is missing. used holds each
-- counter's total before the charge.

local event_id = ARGV[1]
local flags = ARGV[2]
local first = 1
if string.find(flags, 'e', 1, true) then
  if redis.call('EXISTS', KEYS[1]) == 0 then
    return {-1}
  end
  first = 2
end

local n = #KEYS - first + 1
local result = {0}
local refused = 0
for i = 1, n do
  local base = 3 + (i - 1) * 4
  local used = used_of(KEYS[first + i - 1])
  result[i + 1] = used
  if refused == 0 and ARGV[base + 2] == '1'
      and not fits(used, tonumber(ARGV[base]), tonumber(ARGV[base + 1])) then
    refused = i
  end
end
if not string.find(flags, 'u', 1, true) then
  result = {0}
end
if refused > 0 then
  result[1] = refused
  return result
end

for i = 1, n do
  local base = 3 + (i - 1) * 4
  local amount = ARGV[base]
  if amount ~= '0' then
    add(KEYS[first + i - 1], amount, event_id, ARGV[base + 3])
  end
end
return result
