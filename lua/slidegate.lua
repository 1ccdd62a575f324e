-- slidegate: decide one batch of descriptors atomically, on sliding-window logs.
--
-- Redis runs a script without interleaving other commands, so trimming, counting, deciding and
-- recording cannot race (three separate commands can: "100 per minute, 130 got through").
-- The script only touches keys passed in KEYS; all of them share one hash tag, so it runs on
-- any Redis Cluster master.
--
-- KEYS, two per descriptor i = 1..n:
--   KEYS[2i-1]  the log: a sorted set, score = time in ms, one member per admitted hit
--   KEYS[2i]    the ban: a string holding the ban's end (ms since the epoch), with a TTL
-- ARGV:
--   ARGV[1]  now, in ms since the epoch; "" reads Redis TIME instead (one clock for all replicas)
--   ARGV[2]  member prefix, unique per call; members are "<now>:<prefix>:<i>:<j>", unique even
--            within one millisecond
--   ARGV[3]  mode: 1 = final: admit iff every enforcing descriptor fits and, if there are quota
--                  descriptors, at least one of them fits; record only if admitted
--            0 = tentative (a request spread over several slots): record if every enforcing
--                descriptor of this call fits; the caller combines the slots' answers and
--                removes the members again if the request is rejected
--   ARGV[4]  n, the number of descriptors
--   then per descriptor: hits, role (0 enforce, 1 shadow, 2 quota), ban_ms (0: no ban), m (>= 1),
--   then m pairs: limit, window_ms
-- Reply: { now, recorded (0/1), then per descriptor: fits (0/1), ban_remaining_ms,
--          ban_set (1 if this call set the ban), m', then m' pairs: count, reset_ms }
--          (m' = 0 while banned)
--   count    hits in the window after this call
--   reset_ms fitting descriptor: until the oldest entry in the window ages out (0 if empty);
--            otherwise: until this request's hits would fit (0 if this window has room, the
--            window's length if the hits exceed its limit)
-- An entry with time t is inside a window W at now iff t > now - W. Bad arguments get an error
-- reply, never a Lua runtime error.

local function fail(message)
  return redis.error_reply('ERR slidegate: ' .. message)
end

local function whole(text)
  local v = tonumber(text)
  if v == nil or v < 0 or v ~= math.floor(v) then
    return nil
  end
  return v
end

local function ms(v)
  return string.format('%d', v)
end

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
else
  now = whole(ARGV[1])
end
if now == nil then
  return fail('ARGV[1] (now) must be a whole number of ms or empty')
end
local prefix = ARGV[2]
if prefix == nil or prefix == '' then
  return fail('ARGV[2] (member prefix) is missing')
end
local mode = whole(ARGV[3])
if mode ~= 0 and mode ~= 1 then
  return fail('ARGV[3] (mode) must be 0 or 1')
end
local n = whole(ARGV[4])
if n == nil or n < 1 then
  return fail('ARGV[4] (descriptor count) must be at least 1')
end
if #KEYS ~= 2 * n then
  return fail('expected ' .. 2 * n .. ' keys, got ' .. #KEYS)
end

local items = {}
local a = 5
for i = 1, n do
  local hits, role, ban_ms, m = whole(ARGV[a]), whole(ARGV[a + 1]), whole(ARGV[a + 2]), whole(ARGV[a + 3])
  if hits == nil or role == nil or role > 2 or ban_ms == nil or m == nil or m < 1 then
    return fail('descriptor ' .. i .. ': hits, role (0-2), ban_ms and window count (>= 1) are required')
  end
  a = a + 4
  local windows, longest = {}, 0
  for w = 1, m do
    local limit, length = whole(ARGV[a]), whole(ARGV[a + 1])
    if limit == nil or length == nil or length < 1 then
      return fail('descriptor ' .. i .. ' window ' .. w .. ': limit and window_ms (>= 1) are required')
    end
    windows[w] = { limit = limit, length = length }
    if length > longest then
      longest = length
    end
    a = a + 2
  end
  items[i] = { log = KEYS[2 * i - 1], ban = KEYS[2 * i], hits = hits, role = role, ban_ms = ban_ms,
               windows = windows, longest = longest, counts = {} }
end
if ARGV[a] ~= nil then
  return fail('unexpected argument ARGV[' .. a .. ']')
end

-- 1. Does each descriptor fit? Hits of earlier fitting descriptors on the same log count as
--    pending, so two descriptors sharing a log cannot overshoot together.
local fits, banned, ban_set, pending = {}, {}, {}, {}
for i, it in ipairs(items) do
  banned[i] = 0
  ban_set[i] = 0
  local ban_end = tonumber(redis.call('GET', it.ban) or '0') or 0
  if ban_end > now then
    banned[i] = ban_end - now
    fits[i] = false
  else
    redis.call('ZREMRANGEBYSCORE', it.log, '-inf', ms(now - it.longest))
    local p = pending[it.log] or 0
    local ok = true
    for w, win in ipairs(it.windows) do
      local c = redis.call('ZCOUNT', it.log, '(' .. ms(now - win.length), '+inf')
      it.counts[w] = c
      if c + p + it.hits > win.limit then
        ok = false
      end
    end
    fits[i] = ok
    if ok then
      pending[it.log] = p + it.hits
    elseif it.ban_ms > 0 then
      redis.call('SET', it.ban, ms(now + it.ban_ms), 'PX', ms(it.ban_ms))
      banned[i] = it.ban_ms
      ban_set[i] = 1
    end
  end
end

-- 2. Decide.
local enforced_fit, quota_seen, quota_fit = true, false, false
for i, it in ipairs(items) do
  if it.role == 0 and not fits[i] then
    enforced_fit = false
  elseif it.role == 2 then
    quota_seen = true
    quota_fit = quota_fit or fits[i]
  end
end
local record = enforced_fit
if mode == 1 then
  record = enforced_fit and (quota_fit or not quota_seen)
end

-- 3. Record: one member per hit, in batches that stay under Lua's argument limit.
local stamp = ms(now)
if record then
  for i, it in ipairs(items) do
    if fits[i] and it.hits > 0 then
      local args = {}
      for j = 1, it.hits do
        args[#args + 1] = stamp
        args[#args + 1] = stamp .. ':' .. prefix .. ':' .. i .. ':' .. j
        if #args >= 2000 then
          redis.call('ZADD', it.log, unpack(args))
          args = {}
        end
      end
      if #args > 0 then
        redis.call('ZADD', it.log, unpack(args))
      end
    end
  end
end

-- 4. Keep every log as long as its longest window, whether or not this call recorded: a key
--    under constant rejection must not expire and reopen. (1 s of slack for replica clocks.)
for _, it in ipairs(items) do
  redis.call('PEXPIRE', it.log, ms(it.longest + 1000))
end

-- 5. Report.
local reply = { now, record and 1 or 0 }
for i, it in ipairs(items) do
  reply[#reply + 1] = fits[i] and 1 or 0
  reply[#reply + 1] = banned[i]
  reply[#reply + 1] = ban_set[i]
  if banned[i] > 0 then
    reply[#reply + 1] = 0
  else
    reply[#reply + 1] = #it.windows
    for w, win in ipairs(it.windows) do
      local edge = '(' .. ms(now - win.length)
      local count = it.counts[w]
      if record then
        count = redis.call('ZCOUNT', it.log, edge, '+inf')
      end
      local reset = 0
      if fits[i] then
        local oldest = redis.call('ZRANGEBYSCORE', it.log, edge, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
        if oldest[2] then
          reset = tonumber(oldest[2]) + win.length - now
        end
      else
        local need = count + it.hits - win.limit
        if need <= 0 then
          reset = 0
        elseif it.hits > win.limit then
          reset = win.length
        else
          local nth = redis.call('ZRANGEBYSCORE', it.log, edge, '+inf', 'WITHSCORES', 'LIMIT', need - 1, 1)
          if nth[2] then
            reset = tonumber(nth[2]) + win.length - now
          else
            reset = win.length
          end
        end
      end
      reply[#reply + 1] = count
      reply[#reply + 1] = reset
    end
  end
end
return reply
