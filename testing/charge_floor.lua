-- The benchmarks' floor of an admitted check(): the very Redis operations
-- lua/charge.lua makes for an inline charge flagged 'uoc' whose counters all
-- exist (take the operation marker; per counter read its parts and grant and
-- look up its run-time cap; then add each amount) and a reply of the same
-- size, with none of the script's logic: no exactness tests, no cap rules, no
-- refusal. What no script doing that work atomically can go below on this
-- Redis; never registered by production code (tests/test_layout.py).
--
-- Takes charge.lua's KEYS and ARGV as they are: the marker, n counters, n caps
-- hashes and the plans hash; ARGV[3..] five per counter (amount, cap, enforce,
-- expire_at, scope field), the caller clock last.
local n = (#KEYS - 2) / 2
redis.call('SET', KEYS[1], '1', 'NX', 'EX', 900)
local reply = {0}
for i = 1, n do
  local base = 3 + (i - 1) * 5
  local v = redis.call('HMGET', KEYS[1 + i], 'c', 'f', 'g')
  redis.call('HGET', KEYS[1 + n + i], ARGV[base + 4])
  reply[i + 1] = tonumber(v[1]) or 0
  reply[n + i + 1] = ARGV[base + 1] + 0
end
for i = 1, n do
  redis.call('HINCRBY', KEYS[1 + i], 'c', ARGV[3 + (i - 1) * 5])
end
return reply
