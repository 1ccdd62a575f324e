-- slidegate: decide one batch of descriptors atomically, on sliding windows.
--
-- Redis runs a script without interleaving other commands, so trimming, counting, deciding and
-- recording cannot race (three separate commands can: "100 per minute, 130 got through").
-- The script only touches keys passed in KEYS; all of them share one hash tag, so it runs on
-- any Redis Cluster master.
--
-- KEYS, three per descriptor i = 1..n:
--   KEYS[3i-2]  the log (sliding_log): a sorted set, score = time in ms, one member per hit
--   KEYS[3i-1]  the ban: a string holding the ban's end (ms since the epoch), with a TTL
--   KEYS[3i]    the counters (sliding_counter): a hash, field "<bucket_ms>:<bucket>" = hits
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
--   then per descriptor: hits, role (0 enforce, 1 shadow, 2 quota), ban_ms (0: no ban),
--   buckets (0: sliding_log; else sliding_counter with that many buckets per window), m (>= 1),
--   then m pairs: limit, window_ms
-- Reply: { now, recorded (0/1), then per descriptor: fits (0/1), ban_remaining_ms,
--          ban_set (1 if this call set the ban), m', then m' pairs: count, reset_ms }
--          (m' = 0 while banned)
--   count    hits in the window after this call
--   reset_ms fitting descriptor: until the oldest counted hit leaves the window (0 if empty);
--            otherwise: until this request's hits would fit (0 if this window has room, the
--            window's length if the hits exceed its limit)
-- sliding_log: an entry with time t is inside a window W at now iff t > now - W.
-- sliding_counter: a window of length W has buckets of floor(W / buckets) ms; every bucket that
-- overlaps (now - W, now] counts in full, so the count is never below the log's.
-- Bad arguments get an error reply whose code is SLIDEGATE, never a Lua runtime error.

local function fail(message)
  return redis.error_reply('SLIDEGATE ' .. message)
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
if #KEYS ~= 3 * n then
  return fail('expected ' .. 3 * n .. ' keys, got ' .. #KEYS)
end

local items = {}
local a = 5
for i = 1, n do
  local hits, role, ban_ms = whole(ARGV[a]), whole(ARGV[a + 1]), whole(ARGV[a + 2])
  local buckets, m = whole(ARGV[a + 3]), whole(ARGV[a + 4])
  if hits == nil or role == nil or role > 2 or ban_ms == nil or buckets == nil or m == nil or m < 1 then
    return fail('descriptor ' .. i .. ': hits, role (0-2), ban_ms, buckets and window count (>= 1) are required')
  end
  a = a + 5
  local windows, longest = {}, 0
  for w = 1, m do
    local limit, length = whole(ARGV[a]), whole(ARGV[a + 1])
    if limit == nil or length == nil or length < 1 then
      return fail('descriptor ' .. i .. ' window ' .. w .. ': limit and window_ms (>= 1) are required')
    end
    windows[w] = { limit = limit, length = length }
    if buckets > 0 then
      windows[w].size = math.max(math.floor(length / buckets), 1)
      windows[w].oldest = math.floor(math.max(now - length, 0) / windows[w].size)
    end
    if length > longest then
      longest = length
    end
    a = a + 2
  end
  items[i] = { log = KEYS[3 * i - 2], ban = KEYS[3 * i - 1], cnt = KEYS[3 * i], hits = hits, role = role,
               ban_ms = ban_ms, buckets = buckets, windows = windows, longest = longest, counts = {} }
end
if ARGV[a] ~= nil then
  return fail('unexpected argument ARGV[' .. a .. ']')
end

-- sliding_counter: the buckets stored for a descriptor, as { size, index, hits, field }.
local function read_buckets(it)
  local raw = redis.call('HGETALL', it.cnt)
  local found = {}
  for f = 1, #raw, 2 do
    local size, index = string.match(raw[f], '^(%d+):(%d+)$')
    if size then
      found[#found + 1] = { size = tonumber(size), index = tonumber(index), hits = tonumber(raw[f + 1]) or 0,
                            field = raw[f] }
    end
  end
  return found
end

-- The buckets that count for one window, oldest first.
local function counted(buckets, win)
  local list = {}
  for _, b in ipairs(buckets) do
    if b.size == win.size and b.index >= win.oldest then
      list[#list + 1] = b
    end
  end
  table.sort(list, function(x, y) return x.index < y.index end)
  return list
end

-- The hits of a window (either algorithm), after trimming.
local function count(it, win)
  if it.buckets == 0 then
    return redis.call('ZCOUNT', it.log, '(' .. ms(now - win.length), '+inf')
  end
  local c = 0
  for _, b in ipairs(counted(it.state, win)) do
    c = c + b.hits
  end
  return c
end

-- 1. Does each descriptor fit? Hits of earlier fitting descriptors on the same keys count as
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
    if it.buckets == 0 then
      redis.call('ZREMRANGEBYSCORE', it.log, '-inf', ms(now - it.longest))
    else
      it.state = read_buckets(it)
      local stale = {}
      for _, b in ipairs(it.state) do
        local keep = false
        for _, win in ipairs(it.windows) do
          keep = keep or (b.size == win.size and b.index >= win.oldest)
        end
        if not keep then
          stale[#stale + 1] = b.field
        end
      end
      if #stale > 0 then
        redis.call('HDEL', it.cnt, unpack(stale))
      end
    end
    local p = pending[it.log] or 0
    local ok = true
    for w, win in ipairs(it.windows) do
      it.counts[w] = count(it, win)
      if it.counts[w] + p + it.hits > win.limit then
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

-- 3. Record. sliding_log: one member per hit, in batches under Lua's argument limit.
--    sliding_counter: add the hits to the current bucket of every window.
local stamp = ms(now)
if record then
  for i, it in ipairs(items) do
    if fits[i] and it.hits > 0 then
      if it.buckets == 0 then
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
      else
        for _, win in ipairs(it.windows) do
          redis.call('HINCRBY', it.cnt, ms(win.size) .. ':' .. ms(math.floor(now / win.size)), it.hits)
        end
      end
    end
  end
end

-- 4. Keep every key as long as its longest window (plus a bucket), whether or not this call
--    recorded: a key under constant rejection must not expire and reopen. (1 s of slack for
--    replica clocks.)
for _, it in ipairs(items) do
  if it.buckets == 0 then
    redis.call('PEXPIRE', it.log, ms(it.longest + 1000))
  else
    redis.call('PEXPIRE', it.cnt, ms(it.longest + math.ceil(it.longest / it.buckets) + 1000))
  end
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
    if record and it.buckets > 0 then
      it.state = read_buckets(it)
    end
    reply[#reply + 1] = #it.windows
    for w, win in ipairs(it.windows) do
      local c = it.counts[w]
      if record then
        c = count(it, win)
      end
      local reset = 0
      local need = c + it.hits - win.limit
      if not fits[i] and need > 0 and it.hits > win.limit then
        reset = win.length
      elseif fits[i] or need > 0 then
        -- Fitting: wait for the oldest counted hit to leave (the next capacity freed).
        -- Not fitting: wait until `need` hits have left.
        local wanted = fits[i] and 1 or need
        reset = fits[i] and 0 or win.length
        if it.buckets == 0 then
          local nth = redis.call('ZRANGEBYSCORE', it.log, '(' .. ms(now - win.length), '+inf',
                                 'WITHSCORES', 'LIMIT', wanted - 1, 1)
          if nth[2] then
            reset = tonumber(nth[2]) + win.length - now
          end
        else
          local freed = 0
          for _, bucket in ipairs(counted(it.state, win)) do
            freed = freed + bucket.hits
            if bucket.hits > 0 and freed >= wanted then
              reset = (bucket.index + 1) * win.size + win.length - now
              break
            end
          end
        end
      end
      reply[#reply + 1] = c
      reply[#reply + 1] = reset
    end
  end
end
return reply
