-- Give back or renew one call's leases (concurrency caps), or count live ones.
--
-- ARGV[1]  'r' release: remove lease ARGV[2] from every set in KEYS;
--          'n' renew: push lease ARGV[2] of every set that still holds it to
--              now + ARGV[3] ms (a lease already expired is not revived: its
--              slot may have gone to another call); 'c' count live leases;
--          'q' leave: remove ticket ARGV[2] from every queue in KEYS (a
--              waiting call that gave up; lib.lua waiters_ahead)
-- ARGV[#ARGV] last: the caller's clock, epoch ms (lib.lua caller_ms)
-- KEYS     the lease sets (keys.lease_key); mode 'q': their queues (keys.queue_key)
--
-- Returns per key: 'r' 1 if the lease was there ('q' the ticket), 'n' 1 if renewed, 'c' the count.
local mode = ARGV[1]
local out = {}
for i, key in ipairs(KEYS) do
  if mode == 'q' then
    if string.sub(key, 1, #QUEUE_PREFIX) ~= QUEUE_PREFIX then
      return redis.error_reply('mcpbg lease: not a queue: ' .. key)
    end
  elseif not is_lease(key) then
    return redis.error_reply('mcpbg lease: not a lease set: ' .. key)
  end
  if mode == 'r' or mode == 'q' then
    out[i] = redis.call('ZREM', key, ARGV[2])
  elseif mode == 'n' then
    local now = now_ms()
    local score = redis.call('ZSCORE', key, ARGV[2])
    if score and tonumber(score) > now then
      take_lease(key, ARGV[2], now + tonumber(ARGV[3]))
      out[i] = 1
    else
      out[i] = 0
    end
  else
    out[i] = live_leases(key)
  end
end
return out
