-- Projection of ledger events into committed counters, exactly once.
--
-- KEYS[1]    the watermark hash (partition -> last applied offset)
-- KEYS[2]    the epoch marker
--            (on Redis Cluster these and the seen sets carry the hash tag of
--            the slot the batch's counters share: one call per slot group)
-- KEYS[3..]  the seen-id sets the batch touches (ARGV[5] of them), the reservation
--            hashes (ARGV[9] of them), the approvals' spent markers (ARGV[10] of
--            them), then its counters
-- ARGV[1]    the partition field; ARGV[2] the number of events; ARGV[3] '1' when
--            the epoch marker must be whole (a Redis that restarted empty has lost
--            every counter: the worker must rebuild, not add to empty ones);
-- ARGV[4]    the events, as one string of space-separated tokens, per event:
--            offset, event id, position of the seen-id set of the event's day
--            among the seen sets, that set's expire_at, its reservation role ('-'
--            none, 'o<n>' opens the n-th reservation hash, 'c<n>' draws on and
--            closes it, 'c0' draws on one it does not name), the approvals it spends
--            ('-' none, else '<n>:<lapses at>,...' per marker), number of charges, and
--            per charge: key position among the counters, amount, expire_at; then
--            the number of run-time changes and per change (lib.lua apply_change):
--            kind, key position among the counters, field ('-'), amount, until,
--            plan ('-'), why ('-'). The counters section also holds the caps hashes and the
--            plans hash changes write (of their own shapes, see change_key_ok).
--            One argument rather than ~11 per event: packing thousands of
--            arguments was the client's largest cost per event (benchmarks/README.md).
-- ARGV[5]    how many seen-id sets KEYS holds
-- ARGV[6]    the batch's last offset: the watermark reaches it even when the
--            records after the last event were dead letters (-1: none), so a
--            restart does not read, and dead-letter, them again
-- ARGV[7]    what spares most batches the exact check of their sums (surely_fits)
-- ARGV[8]    the caller's clock, epoch ms (lib.lua caller_ms): a charge whose
--            counter expired before it is dropped
-- ARGV[9]    how many reservation hashes KEYS holds (mcpbg:v1:_res:<reserved event id>,
--            counter key -> estimate, until its counters expire; counters.Holds)
-- ARGV[10]   how many spent markers KEYS holds (mcpbg:v1:_spent:<one-time id>,
--            approval.spend_op's): an admission marks its approvals spent, committed,
--            and one spent already (committed) refuses the event
--
-- Two guards make delivery at-least-once yet counting exactly-once:
-- an offset at or below the watermark was applied before (redelivery), and an
-- event id already in its day's seen set was applied from another offset (a
-- producer retry that reached the broker twice). For a fresh event, each
-- charge's in-flight entry (written by the hot path under the same event id)
-- is removed and the ledger's amount committed; the watermark moves in the
-- same script. A charge whose counter has already expired is dropped: its
-- window is over. Returns the number of events applied, or -1 (nothing
-- applied) when the epoch marker is required and not whole (see epoch_ok).
--
-- Every key is checked before anything is written: the client validates each
-- event (mcp_budget_governor.provenance), and a key that is neither a seen set
-- nor of the counter shape mcpbg:v1:<limit>:<scope>:<bucket> (a limit never
-- starts with '_', the mark of the projection's own keys) refuses the whole
-- batch, so a client bug can never write to the watermarks or the marker.

if ARGV[3] == '1' and not epoch_ok(KEYS[2]) then
  return -1
end
local seen_sets = tonumber(ARGV[5])
local holds = 2 + seen_sets
local markers = holds + tonumber(ARGV[9] or '0')
local counters = markers + tonumber(ARGV[10] or '0')
for i = 3, #KEYS do
  local shape = '^mcpbg:v1:%w[%w_.%-]*:[^:]+:[^:]+$'
  -- A seen set may carry a hash tag (Redis Cluster: the slot of its counters).
  if i <= holds then shape = '^mcpbg:v1:_seen:%d+$' end
  if i > holds and i <= markers then shape = '^mcpbg:v1:_res:[%x%-]+$' end
  if i > markers and i <= counters then shape = '^mcpbg:v1:_spent:%x+$' end
  if not string.find(KEYS[i], shape) and not (i <= holds
      and string.find(KEYS[i], '^mcpbg:v1:_seen:%d+{%x+}$'))
      and not (i > holds and i <= markers
      and string.find(KEYS[i], '^mcpbg:v1:_res:[%x%-]+{%x+}$'))
      and (i <= counters or not change_key_ok(KEYS[i])) then
    return redis.error_reply('mcpbg apply: refused the batch: ' .. KEYS[i] .. ' is not a '
      .. (i <= holds and 'seen-id set' or (i <= markers and 'reservation hash'
      or (i <= counters and 'spent marker' or 'counter key'))))
  end
end
local wm_raw = redis.call('HGET', KEYS[1], ARGV[1])
local wm = tonumber(wm_raw or '-1')
local now = math.floor(caller_ms() / 1000)

-- Every fresh event's sums are checked before the first write (all or none,
-- counters.apply_problem and grant_problem): a committed part stays within the
-- exact range, a refund never takes a counter's spend below zero, a counter's
-- grants stay within the exact range. The first event that fails refuses the
-- batch, naming its offset; the client dead-letters it and applies the rest.
--
-- The exact check reads every counter, in-flight entry and seen set the batch
-- touches; ARGV[7] lets most batches skip it: "0" when the batch holds no
-- refund and no grant, then per counter its position and the sum of the
-- batch's amounts on it. Those sums are bounds (a redelivery is counted too),
-- so when every committed part plus its sum stays in range, nothing can fail.
local MAX_EXACT = 9007199254740991
local function surely_fits()
  local it = string.gmatch(ARGV[7], '%S+')
  if it() ~= '0' then return false end
  while true do
    local pos = it()
    if not pos then return true end
    local sum = tonumber(it())
    local c = tonumber(redis.call('HGET', KEYS[counters + tonumber(pos)], 'c') or '0')
    if not (c + sum <= MAX_EXACT) then return false end
  end
end

-- An event's reservation role token: ('-'|'o'|'c', position among the hashes or 0).
local function hold_role(tok)
  if tok == '-' then return '-', 0 end
  return string.sub(tok, 1, 1), tonumber(string.sub(tok, 2))
end

-- The spent markers of an event's token: a list of {KEYS position, lapses at}.
local function spent_of(tok)
  local out = {}
  if tok == '-' then return out end
  for pos, untl in string.gmatch(tok, '(%d+):(%d+)') do
    out[#out + 1] = {markers + tonumber(pos), tonumber(untl)}
  end
  return out
end

-- The reservation hash at rpos as counter key -> estimate, or false (none held).
local function held(rpos)
  if rpos == 0 then return false end
  local flat = redis.call('HGETALL', KEYS[holds + rpos])
  if #flat == 0 then return false end
  local out = {}
  for i = 1, #flat, 2 do out[flat[i]] = tonumber(flat[i + 1]) end
  return out
end

-- counters.hold_problem: why an event opening ('o') or closing ('c') reservation rpos
-- is refused, or nil; res_of holds what the batch opened and closed before it.
local function hold_refusal(role, rpos, cs, res_of)
  local live = {}
  for _, ch in ipairs(cs) do
    if tonumber(ch[3]) > now then live[#live + 1] = ch end
  end
  if role == 'o' then
    if #live > 0 then
      local est = {}
      for _, ch in ipairs(live) do est[KEYS[counters + tonumber(ch[1])]] = tonumber(ch[2]) end
      res_of[rpos] = est
    end
    return nil
  end
  local name = rpos > 0 and string.sub(KEYS[holds + rpos], 15) or ''
  name = string.gsub(name, '{%x+}$', '')
  local h = res_of[rpos]
  if h == nil then h = held(rpos) end
  if rpos > 0 then res_of[rpos] = false end
  if #live == 0 then return nil end
  if rpos == 0 then
    return 'data.reservation: names no reservation (its money moves only against one)'
  end
  if not h then
    return 'reservation ' .. name .. ': not one the ledger holds (never made, closed'
      .. ' already or expired)'
  end
  for _, ch in ipairs(live) do
    local a = tonumber(ch[2])
    if a < 0 then
      local key = KEYS[counters + tonumber(ch[1])]
      local est = h[key]
      if est == nil then
        return key .. ': reservation ' .. name .. ' holds no estimate on this counter'
      end
      if -a > est then
        return key .. ': refund ' .. string.sub(ch[2], 2) .. ' is more than reservation '
          .. name .. "'s estimate (" .. string.format('%.0f', est) .. ')'
      end
    end
  end
  return nil
end

-- (offset, reason) of the first event refused, or nil.
local function refusal()
  local c_of, f_of, g_of, ids, moved, res_of, spent_b = {}, {}, {}, {}, {}, {}, {}
  local mark = wm
  local token = string.gmatch(ARGV[4], '%S+')
  for _ = 1, tonumber(ARGV[2]) do
    local offset_raw = token()
    local offset = tonumber(offset_raw)
    local event_id = token()
    local seen = KEYS[2 + tonumber(token())]
    token()
    local role, rpos = hold_role(token())
    local marks = spent_of(token())
    local fresh = offset > mark
    if fresh then
      mark = offset
      fresh = not ids[event_id] and redis.call('SISMEMBER', seen, event_id) == 0
      ids[event_id] = true
    end
    local cs = {}
    for _ = 1, tonumber(token()) do
      cs[#cs + 1] = {token(), token(), token()}
    end
    if fresh and role ~= '-' then
      local why = hold_refusal(role, rpos, cs, res_of)
      if why then return offset_raw, why end
    end
    if fresh then
      for _, m in ipairs(marks) do
        local key = KEYS[m[1]]
        if spent_b[key] or tonumber(redis.call('HGET', key, 'c') or '0') >= 1 then
          return offset_raw, 'approval ' .. string.sub(key, 17) .. ': spent already'
        end
        spent_b[key] = true
      end
    end
    for _, ch in ipairs(cs) do
      local key_pos, amount, expire_at = ch[1], ch[2], ch[3]
      if fresh then
        local key = KEYS[counters + tonumber(key_pos)]
        if c_of[key] == nil then
          local v = redis.call('HMGET', key, 'c', 'f')
          c_of[key], f_of[key] = tonumber(v[1] or '0'), tonumber(v[2] or '0')
        end
        local a = tonumber(amount)
        if a < 0 then
          -- Only a refund needs the in-flight part: without the entries the batch moves
          -- before it (read now, once) and without its own.
          local before = moved[key]
          if before then
            for _, id in ipairs(before) do
              local p = redis.call('HGET', key, 'e:' .. id)
              if p then f_of[key] = f_of[key] - tonumber(p) end
            end
            moved[key] = nil
          end
          local pending = redis.call('HGET', key, 'e:' .. event_id)
          if pending then f_of[key] = f_of[key] - tonumber(pending) end
        else
          local ids_of = moved[key]
          if not ids_of then ids_of = {}; moved[key] = ids_of end
          ids_of[#ids_of + 1] = event_id
        end
        if tonumber(expire_at) > now then
          local c = c_of[key] + a
          if not (c >= -MAX_EXACT and c <= MAX_EXACT) then
            return offset_raw, key .. ': committed ' .. string.format('%.0f', c_of[key])
              .. ' + ' .. amount .. ' would leave the exact range (at most 9007199254740991)'
          end
          if a < 0 and c + f_of[key] < 0 then
            return offset_raw, key .. ': ' .. amount .. ' would take its spend ('
              .. string.format('%.0f', c_of[key] + f_of[key]) .. ') below zero'
          end
          c_of[key] = c
        end
      end
    end
    for _ = 1, tonumber(token()) do
      local pos, kind, _, amount, untl = token(), token(), token(), token(), token()
      token()
      token()
      if fresh and (kind == 'granted' or kind == 'reset') and tonumber(untl) > now then
        local key = KEYS[counters + tonumber(pos)]
        if g_of[key] == nil then g_of[key] = tonumber(redis.call('HGET', key, 'g') or '0') end
        local g = tonumber(amount)
        if kind == 'granted' then
          if not (g_of[key] + g <= MAX_EXACT) then
            return offset_raw, key .. ': grant ' .. string.format('%.0f', g_of[key])
              .. ' + ' .. amount .. ' would leave the exact range (at most 9007199254740991)'
          end
          g = g_of[key] + g
        end
        g_of[key] = g
      end
    end
  end
  return nil
end

if not surely_fits() then
  local offset, why = refusal()
  if offset then
    return redis.error_reply('mcpbg apply: refused event at offset ' .. offset .. ': ' .. why)
  end
end
local token = string.gmatch(ARGV[4], '%S+')
local applied = 0
for _ = 1, tonumber(ARGV[2]) do
  local offset_raw = token()
  local offset = tonumber(offset_raw)
  local event_id = token()
  local seen = KEYS[2 + tonumber(token())]
  local seen_expire_at = token()
  local role, rpos = hold_role(token())
  local marks = spent_of(token())
  local charges = tonumber(token())
  local opened = 0
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
      local key = KEYS[counters + tonumber(key_pos)]
      local pending = redis.call('HGET', key, 'e:' .. event_id)
      if pending then
        if pending ~= '0' then redis.call('HINCRBY', key, 'f', negate(pending)) end
        redis.call('HDEL', key, 'e:' .. event_id)
      end
      if tonumber(expire_at) > now then
        add(key, amount, '', expire_at)
        if role == 'o' then
          redis.call('HSET', KEYS[holds + rpos], key, amount)
          if tonumber(expire_at) > opened then opened = tonumber(expire_at) end
        end
      end
    end
  end
  if fresh then
    for _, m in ipairs(marks) do
      local key = KEYS[m[1]]
      local pending = redis.call('HGET', key, 'e:' .. event_id)
      if pending then
        if pending ~= '0' then redis.call('HINCRBY', key, 'f', negate(pending)) end
        redis.call('HDEL', key, 'e:' .. event_id)
      end
      if m[2] + 1 > now then
        redis.call('HINCRBY', key, 'c', 1)
        redis.call('EXPIREAT', key, m[2] + 1)
      end
    end
  end
  if fresh and opened > 0 then
    redis.call('EXPIREAT', KEYS[holds + rpos], opened)
  elseif fresh and role == 'c' and rpos > 0 then
    redis.call('DEL', KEYS[holds + rpos])
  end
  for _ = 1, tonumber(token()) do
    local pos, kind, field, amount, untl = token(), token(), token(), token(), token()
    local plan, why = token(), token()
    if fresh then
      apply_change(kind, KEYS[counters + tonumber(pos)], field, amount, untl, plan, why, now)
    end
  end
  if fresh then
    applied = applied + 1
  end
end
if tonumber(ARGV[6]) > wm then
  wm_raw = ARGV[6]
end
if wm_raw then
  redis.call('HSET', KEYS[1], ARGV[1], wm_raw)
end
return applied
