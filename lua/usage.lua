-- committed and in-flight of each counter in KEYS, read in one round trip.
-- Returned as the stored decimal strings, two per key, so the caller can add
-- them exactly even past 2^53, where Lua's doubles would round.
local out = {}
for i = 1, #KEYS do
  local v = redis.call('HMGET', KEYS[i], 'c', 'f')
  out[2 * i - 1] = v[1] or '0'
  out[2 * i] = v[2] or '0'
end
return out
