-- Projection of ledger events into committed counters, exactly once.
--
-- KEYS[1]    the watermark hash (partition -> last applied offset)
-- KEYS[2]    the epoch marker
-- KEYS[3..]  the counters and seen-id sets the batch touches
-- ARGV[1]    the partition field; ARGV[2] the number of events; ARGV[3] '1' when
--            the epoch marker must exist (a Redis that restarted empty has lost
--            every counter: the worker must rebuild, not add to empty ones);
-- ARGV[4]    the events, as one string of space-separated tokens, per event:
--            offset, event id, position in KEYS of the seen-id set of the
--            event's day, that set's expire_at, number of charges, and per
--            charge: key position in KEYS, amount, expire_at. One argument
--            rather than ~11 per event: packing thousands of arguments was
--            the client's largest cost per event (benchmarks/README.md).
--
-- Two guards make delivery at-least-once yet counting exactly-once:
-- an offset at or below the watermark was applied before (redelivery), and an
-- event id already in its day's seen set was applied from another offset (a
-- producer retry that reached the broker twice). For a fresh event, each
-- charge's in-flight entry (written by the hot path under the same event id)
-- is removed and the ledger's amount committed; the watermark moves in the
-- same script. A charge whose counter has already expired is dropped: its
-- window is over. Returns the number of events applied, or -1 (nothing
-- applied) when the epoch marker is required and missing.

if ARGV[3] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then
  return -1
end
local wm_raw = redis.call('HGET', KEYS[1], ARGV[1])
local wm = tonumber(wm_raw or '-1')
local now = tonumber(redis.call('TIME')[1])
local token = string.gmatch(ARGV[4], '%S+')
local applied = 0
for _ = 1, tonumber(ARGV[2]) do
  local offset_raw = token()
  local offset = tonumber(offset_raw)
  local event_id = token()
  local seen = KEYS[tonumber(token())]
  local seen_expire_at = token()
  local charges = tonumber(token())
  local fresh = offset > wm
  if fresh then
    wm = offset
    wm_raw = offset_raw
    fresh = redis.call('SADD', seen, event_id) == 1
    if fresh then
      redis.call('EXPIREAT', seen, seen_expire_at)
    end
  end
  for _ = 1, charges do
    local key_pos, amount, expire_at = token(), token(), token()
    if fresh then
      local key = KEYS[tonumber(key_pos)]
      local pending = redis.call('HGET', key, 'e:' .. event_id)
      if pending then
        if pending ~= '0' then redis.call('HINCRBY', key, 'f', negate(pending)) end
        redis.call('HDEL', key, 'e:' .. event_id)
      end
      if tonumber(expire_at) > now then
        add(key, amount, '', expire_at)
      end
    end
  end
  if fresh then
    applied = applied + 1
  end
end
if wm_raw then
  redis.call('HSET', KEYS[1], ARGV[1], wm_raw)
end
return applied
