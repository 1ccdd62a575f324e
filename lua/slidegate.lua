#!lua
-- slidegate: decide one batch of descriptors atomically, on sliding windows.
--
-- The first line (a Redis 7 shebang, no flags) declares this a script that may write, so Redis
-- refuses to start it when used memory is over `maxmemory` (with `noeviction`) instead of
-- letting it write past the limit (without the declaration its first write is a deletion,
-- which a full Redis allows, and after that nothing inside a script is checked).
--
-- Redis runs a script without interleaving other commands, so trimming, counting, deciding and
-- recording cannot race (three separate commands can: "100 per minute, 130 got through").
-- One call carries one or more requests (requests that reached the store at the same moment),
-- decided one after the other, each as it would be alone: a request's descriptors are admitted
-- all together or not at all. Batching saves Redis a command, a read and a write per request.
-- The script only touches keys passed in KEYS; on Redis Cluster a call's keys share one hash
-- tag, so it runs on any master.
--
-- KEYS, three per descriptor, the requests' descriptors in order (descriptor i of a request
-- whose keys start after KEYS[k]):
--   KEYS[k+3i-2]  the log (sliding_log): a sorted set, score = time in ms, one member per
--               request that recorded, "<cum>:<weight>:<prefix>:<i>", where weight is the
--               request's hits and cum (20 digits, zero-padded) the running total of hits up to
--               and including this entry; the hits in a window are last cum - (cum - weight of
--               the window's first entry), whatever the number of entries
--   KEYS[k+3i-1]  the ban: a string holding the ban's end (ms since the epoch), with a TTL
--   KEYS[k+3i]    the counters (sliding_counter): a hash, field "<bucket_ms>:<bucket>" = hits
-- ARGV:
--   ARGV[1]  the number of requests in this call (>= 1), then per request:
--   now      in ms since the epoch; "" reads Redis TIME instead (one clock for all replicas)
--   prefix   member prefix, unique per request, so members are unique even within one ms
--   mode     1 = final: admit iff every enforcing descriptor fits and, if there are quota
--                descriptors, at least one of them fits; record only if admitted
--            0 = tentative (a request spread over several slots): record if every enforcing
--                descriptor of this call fits; the caller combines the slots' answers and
--                removes the entries again if the request is rejected
--            2 = rejected (another descriptor of the request is known to be over, so the
--                caller did not send it): record nothing but debits, set bans, report
--   n        the number of descriptors
--   then per descriptor: hits, role (0 enforce, 1 shadow, 2 quota), ban_ms (0: no ban),
--   buckets (0: sliding_log; else sliding_counter with that many buckets per window),
--   debit (1: usage already spent, see below), m (>= 1), then m pairs: limit, window_ms
-- Reply: one array per request, in order, either
--   { now, recorded (0/1, anything), then per descriptor: fits (0/1), ban_remaining_ms,
--     ban_set (1 if this request set the ban), recorded (0/1), cum (of the log entry it
--     recorded; 0 if none), m', then m' pairs: count, reset_ms }   (m' = 0 while banned)
--   or { -1, error } when a Redis command of that request failed (a key of another type, say):
--     that request alone failed, and what it wrote before the error stays, as with any script.
--   count    hits in the window after this call
--   reset_ms fitting descriptor: until the oldest counted hit leaves the window (0 if empty);
--            otherwise: until this request's hits would fit (0 if this window has room, the
--            window's length if the hits exceed its limit)
-- sliding_log: an entry with time t is inside a window W at now iff t > now - W.
-- sliding_counter: a window of length W has buckets of floor(W / buckets) ms; every bucket that
-- overlaps (now - W, now] counts in full, so the count is never below the log's. Windows with
-- the same bucket length share their buckets (a hit is added once).
-- debit: a call with hits records them even when they cross the limit, as long as every window
-- still had room for one more hit before it (usage that already happened is charged; once the
-- budget is spent nothing more is charged, so the total never exceeds the limit by more than
-- the call that crossed it). It fits (is answered OK) iff count + max(hits, 1) <= limit in every
-- window, so a check (hits 0) fails once the budget is spent.
-- Logs written by the previous format (one member "<time>:<prefix>:<i>:<j>" per hit) are
-- rewritten in this format, weight 1 each, the first time this script reads them.
-- Bad arguments get an error reply for the whole call, whose code is SLIDEGATE, never a Lua
-- runtime error.

-- Library functions as locals: a local is a register, a global a table lookup, and this body
-- runs for every request. (Loops count with an index for the same reason: `ipairs` is a
-- function call per step.)
local tonumber, format, floor, max, min, call, pcall, type, tostring = tonumber, string.format,
  math.floor, math.max, math.min, redis.call, pcall, type, tostring

local function fail(message)
  return redis.error_reply('SLIDEGATE ' .. message)
end

-- Whole numbers read so far in this call, by their text (false: not a whole number). Turning
-- text into a number costs a strtod, thousands of instructions, and a call's arguments repeat
-- ("0", "1", the same limits and windows, the same ms): a table lookup is far cheaper.
local read = {}
local function whole(text)
  local v = read[text]
  if v == nil then
    v = tonumber(text)
    if v == nil or v < 0 or v % 1 ~= 0 then
      v = false
    end
    if text ~= nil then
      read[text] = v
    end
  end
  return v or nil
end

-- A whole number as text, for arguments built by concatenation. Numbers passed on their own
-- go to redis.call as numbers: Redis 7 writes integral ones exactly, without a printf.
local function ms(v)
  return format('%d', v)
end

-- Redis TIME, read once per call: every request of a call is decided at the same moment.
local time_now = nil
local function redis_now()
  if time_now == nil then
    local t = call('TIME')
    time_now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
  end
  return time_now
end

-- One request read from ARGV[a] on, its keys from KEYS[k + 1] on: the request and where the
-- next one's arguments and keys start, or nil and why not.
local function parse_request(r, a, k)
  -- Messages are built only on failure: turning a number into text costs a printf.
  local function bad(what)
    return nil, 'request ' .. r .. ': ' .. what
  end
  local now
  if ARGV[a] == '' then
    now = redis_now()
  else
    now = whole(ARGV[a])
  end
  if now == nil then
    return bad('now must be a whole number of ms or empty')
  end
  local prefix = ARGV[a + 1]
  if prefix == nil or prefix == '' then
    return bad('member prefix is missing')
  end
  local mode = whole(ARGV[a + 2])
  if mode ~= 0 and mode ~= 1 and mode ~= 2 then
    return bad('mode must be 0, 1 or 2')
  end
  local n = whole(ARGV[a + 3])
  if n == nil or n < 1 then
    return bad('descriptor count must be at least 1')
  end
  if KEYS[k + 3 * n] == nil then
    return bad('expected ' .. k + 3 * n .. ' keys, got ' .. #KEYS)
  end
  a = a + 4
  local items = {}
  for i = 1, n do
    local hits, role, ban_ms = whole(ARGV[a]), whole(ARGV[a + 1]), whole(ARGV[a + 2])
    local buckets, debit, m = whole(ARGV[a + 3]), whole(ARGV[a + 4]), whole(ARGV[a + 5])
    if hits == nil or role == nil or role > 2 or ban_ms == nil or buckets == nil or debit == nil
        or debit > 1 or m == nil or m < 1 then
      return bad('descriptor ' .. i .. ': hits, role (0-2), ban_ms, buckets, debit (0-1) and window count (>= 1) are required')
    end
    a = a + 6
    local windows, longest = {}, 0
    for w = 1, m do
      local limit, length = whole(ARGV[a]), whole(ARGV[a + 1])
      if limit == nil or length == nil or length < 1 then
        return bad('descriptor ' .. i .. ' window ' .. w .. ': limit and window_ms (>= 1) are required')
      end
      -- count, and the window's first entry before this call (cum before it, its time):
      -- filled by the decision.
      local win = { limit = limit, length = length, count = 0, first_before = false, first_time = 0 }
      if buckets > 0 then
        win.size = max(floor(length / buckets), 1)
        win.oldest = floor(max(now - length, 0) / win.size)
      end
      windows[w] = win
      if length > longest then
        longest = length
      end
      a = a + 2
    end
    local base = k + 3 * i
    items[i] = { log = KEYS[base - 2], ban = KEYS[base - 1], cnt = KEYS[base], hits = hits,
                 role = role, ban_ms = ban_ms, buckets = buckets, debit = debit == 1, windows = windows,
                 longest = longest, cum = 0,
                 -- Set by the decision; named here so the table is sized once.
                 fits = false, records = false, banned = 0, ban_set = 0, state = false, st = false }
  end
  return { now = now, prefix = prefix, mode = mode, items = items }, a, k + 3 * n
end

-- The request being decided (set by `decide`; the helpers below read it).
local now, prefix, mode, items

-- === sliding_log: a log of weighted entries with running totals ===

-- cum and weight of a member, or nil for a member of the previous format.
local function parse_member(member)
  local cum, weight = string.match(member, '^(%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d):(%d+):')
  if cum == nil then
    return nil
  end
  return tonumber(cum), tonumber(weight)
end

local function member(cum, weight, i)
  return format('%020d:%d:%s:%d', cum, weight, prefix, i)
end

-- Rewrites a log that holds members of the previous format: every entry keeps its time, an
-- old member weighs 1, and running totals are recomputed in time order.
local function migrate(log)
  local all = call('ZRANGE', log, 0, -1, 'WITHSCORES')
  call('DEL', log)
  local cum, args = 0, {}
  for e = 1, #all, 2 do
    local _, weight = parse_member(all[e])
    weight = weight or 1
    cum = cum + weight
    args[#args + 1] = all[e + 1]
    args[#args + 1] = format('%020d', cum) .. ':' .. ms(weight) .. ':m:' .. ms((e + 1) / 2)
    if #args >= 2000 then
      call('ZADD', log, unpack(args))
      args = {}
    end
  end
  if #args > 0 then
    call('ZADD', log, unpack(args))
  end
end

-- The log's newest entry: its cum and time (0, 0 when empty). Migrates an old log first.
local function last_entry(log)
  local last = call('ZRANGE', log, -1, -1, 'WITHSCORES')
  if last[1] == nil then
    return 0, 0
  end
  local cum = parse_member(last[1])
  if cum == nil then
    migrate(log)
    last = call('ZRANGE', log, -1, -1, 'WITHSCORES')
    cum = parse_member(last[1])
  end
  return cum, tonumber(last[2])
end

-- The first entry inside a window: the cum before it and its time, or false when none.
local function first_inside(log, win)
  local first = call('ZRANGEBYSCORE', log, '(' .. ms(now - win.length), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if first[1] == nil then
    return false, 0
  end
  local cum, weight = parse_member(first[1])
  return cum - weight, tonumber(first[2])
end

-- The time of the first entry of the window whose running total reaches `total`, `need` hits
-- past the total before the window, or nil. Totals grow by at least 1 an entry, so it is at
-- most need - 1 ranks past the window's first entry; when every entry weighs 1 (requests) the
-- first probe there finds it. Otherwise a binary search by rank.
local function time_reaching(log, win, total, need)
  local low = call('ZCOUNT', log, '-inf', now - win.length)
  local high = min(call('ZCARD', log) - 1, low + need - 1)
  local probe = call('ZRANGE', log, high, high, 'WITHSCORES')
  if probe[1] ~= nil and parse_member(probe[1]) == total then
    return tonumber(probe[2])
  end
  local found = nil
  while low <= high do
    local mid = floor((low + high) / 2)
    local entry = call('ZRANGE', log, mid, mid, 'WITHSCORES')
    if entry[1] == nil then
      break
    end
    if parse_member(entry[1]) >= total then
      found = tonumber(entry[2])
      high = mid - 1
    else
      low = mid + 1
    end
  end
  return found
end

-- === sliding_counter: buckets in a hash ===

-- The buckets stored for a descriptor, as { size, index, hits, field }.
local function read_buckets(it)
  local raw = call('HGETALL', it.cnt)
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
  for bi = 1, #buckets do
    local b = buckets[bi]
    if b.size == win.size and b.index >= win.oldest then
      list[#list + 1] = b
    end
  end
  table.sort(list, function(x, y) return x.index < y.index end)
  return list
end

local function drop_stale_buckets(it)
  it.state = read_buckets(it)
  local stale = {}
  for bi = 1, #it.state do
    local b = it.state[bi]
    local keep = false
    for wi = 1, #it.windows do
      local win = it.windows[wi]
      keep = keep or (b.size == win.size and b.index >= win.oldest)
    end
    if not keep then
      stale[#stale + 1] = b.field
    end
  end
  if #stale > 0 then
    call('HDEL', it.cnt, unpack(stale))
  end
end

-- The size a descriptor's fit was judged by: its hits, or 1 for a debit rule's check.
local function size_of(it)
  if it.debit and it.hits == 0 then
    return 1
  end
  return it.hits
end

-- The reset of one window of a sliding_log descriptor, from its count after the call.
local function log_reset(it, win, count)
  local before, time = win.first_before, win.first_time
  if not before then
    -- The window held nothing before this call: its first entry is the first this call
    -- recorded in the log, if any.
    before, time = it.st.first_before, it.st.first_time
  end
  if it.fits then
    return before and (time + win.length - now) or 0
  end
  local size = size_of(it)
  local need = count + size - win.limit
  if need <= 0 then
    return 0
  end
  if size > win.limit then
    return win.length
  end
  local at = time_reaching(it.log, win, (before or 0) + need, need)
  return at and (at + win.length - now) or win.length
end

-- The reset of one window of a sliding_counter descriptor, from its count after the call.
local function counter_reset(it, win, count)
  local wanted = 1
  if not it.fits then
    local size = size_of(it)
    wanted = count + size - win.limit
    if wanted <= 0 then
      return 0
    end
    if size > win.limit then
      return win.length
    end
  end
  for _, bucket in ipairs(counted(it.state, win)) do
    wanted = wanted - bucket.hits
    if bucket.hits > 0 and wanted <= 0 then
      return (bucket.index + 1) * win.size + win.length - now
    end
  end
  return it.fits and 0 or win.length
end

-- Decides one request: its reply.
local function decide(req)
  now, prefix, mode, items = req.now, req.prefix, req.mode, req.items
  -- 1. Count every window, then decide whether each descriptor fits (and, for a debit, whether it
  --    records). Hits of earlier recording descriptors on the same log count as pending, so two
  --    descriptors sharing a log cannot overshoot together.
  -- Per key, what the descriptors of this request that share it need to agree on: the log's
  -- newest entry (read once, moved on by what this request records), hits pending from earlier
  -- descriptors, hits recorded, and the first entry this request recorded.
  local logs = {}
  for i = 1, #items do
    local it = items[i]
    local st = logs[it.log]
    if st == nil then
      st = { read = false, cum = 0, time = 0, pending = 0, recorded = 0, first_before = false, first_time = 0 }
      logs[it.log] = st
    end
    it.st = st
    local ban_end = 0
    if it.ban_ms > 0 then
      ban_end = tonumber(call('GET', it.ban) or '0') or 0
    end
    if ban_end > now then
      it.banned = ban_end - now
      it.fits = false
      it.records = false
    else
      if it.buckets == 0 then
        -- The newest entry first: an empty log, or one whose newest entry is older than a
        -- window, has nothing in that window, so it needs no count (and, for the longest
        -- window, no trim: every entry is stale, and the whole log goes).
        if not st.read then
          st.read = true
          st.cum, st.time = last_entry(it.log)
          if st.cum > 0 then
            if st.time <= now - it.longest then
              call('DEL', it.log)
            else
              call('ZREMRANGEBYSCORE', it.log, '-inf', now - it.longest)
            end
          end
        end
        for w = 1, #it.windows do
          local win = it.windows[w]
          if st.cum > 0 and st.time > now - win.length then
            win.first_before, win.first_time = first_inside(it.log, win)
          end
          win.count = win.first_before and (st.cum - win.first_before) or 0
        end
      else
        drop_stale_buckets(it)
        for w = 1, #it.windows do
          local win = it.windows[w]
          local c = 0
          for _, b in ipairs(counted(it.state, win)) do
            c = c + b.hits
          end
          win.count = c
        end
      end
      local p = st.pending
      local size = it.hits
      if it.debit and size == 0 then
        size = 1
      end
      local ok, has_room = true, true
      for w = 1, #it.windows do
        local win = it.windows[w]
        if win.count + p + size > win.limit then
          ok = false
        end
        if win.count + p >= win.limit then
          has_room = false
        end
      end
      it.fits = ok
      it.records = it.hits > 0 and (ok or (it.debit and has_room))
      if not ok and it.ban_ms > 0 then
        call('SET', it.ban, now + it.ban_ms, 'PX', it.ban_ms)
        it.banned = it.ban_ms
        it.ban_set = 1
        it.records = false
      end
      if it.records then
        st.pending = p + it.hits
      end
    end
  end

  -- 2. Decide.
  local enforced_fit, quota_seen, quota_fit = true, false, false
  for i = 1, #items do
    local it = items[i]
    if it.role == 0 and not it.fits then
      enforced_fit = false
    elseif it.role == 2 then
      quota_seen = true
      quota_fit = quota_fit or it.fits
    end
  end
  local admitted = enforced_fit
  if mode == 1 then
    admitted = enforced_fit and (quota_fit or not quota_seen)
  elseif mode == 2 then
    admitted = false
  end

  -- 3. Record: every fitting descriptor of an admitted call, and every debit that records
  --    whatever the decision. sliding_log: one weighted entry, stamped no earlier than the log's
  --    newest entry (so totals grow with time even if clocks step back: stricter, never looser).
  --    sliding_counter: the hits go into the current bucket of every distinct bucket length.
  local recorded = false
  for i = 1, #items do
    local it = items[i]
    if it.records and (admitted or it.debit) then
      recorded = true
      local st = it.st
      st.recorded = st.recorded + it.hits
      if it.buckets == 0 then
        it.cum = st.cum + it.hits
        local stamp = max(now, st.time)
        call('ZADD', it.log, stamp, member(it.cum, it.hits, i))
        if not st.first_before then
          st.first_before, st.first_time = st.cum, stamp
        end
        st.cum, st.time = it.cum, stamp
      else
        local done = {}
        for wi = 1, #it.windows do
          local win = it.windows[wi]
          if not done[win.size] then
            done[win.size] = true
            call('HINCRBY', it.cnt, ms(win.size) .. ':' .. ms(floor(now / win.size)), it.hits)
          end
        end
      end
    else
      it.records = false
    end
  end

  -- 4. Keep every key as long as its longest window (plus a bucket), whether or not this call
  --    recorded: a key under constant rejection must not expire and reopen. (1 s of slack for
  --    replica clocks.)
  for ii = 1, #items do
    local it = items[ii]
    if it.buckets == 0 then
      call('PEXPIRE', it.log, it.longest + 1000)
    else
      call('PEXPIRE', it.cnt, it.longest + math.ceil(it.longest / it.buckets) + 1000)
    end
  end

  -- 5. Report: each window's count after the call (with every hit this call recorded on the same
  --    key) and its reset.
  -- Made with room for one descriptor of one window (the common reply), so it is not grown
  -- step by step; what a shorter reply leaves over is cleared below.
  local reply, r = { now, recorded and 1 or 0, 0, 0, 0, 0, 0, 0, 0, 0 }, 2
  for i = 1, #items do
    local it = items[i]
    reply[r + 1] = it.fits and 1 or 0
    reply[r + 2] = it.banned
    reply[r + 3] = it.ban_set
    reply[r + 4] = it.records and 1 or 0
    reply[r + 5] = it.cum
    r = r + 5
    if it.banned > 0 then
      reply[r + 1] = 0
      r = r + 1
    else
      local added = it.st.recorded
      if it.buckets > 0 and added > 0 then
        it.state = read_buckets(it)
      end
      reply[r + 1] = #it.windows
      r = r + 1
      for w = 1, #it.windows do
        local win = it.windows[w]
        local c = win.count + added
        local reset
        if it.buckets > 0 then
          c = 0
          for _, b in ipairs(counted(it.state, win)) do
            c = c + b.hits
          end
          reset = counter_reset(it, win, c)
        else
          reset = log_reset(it, win, c)
        end
        reply[r + 1] = c
        reply[r + 2] = reset
        r = r + 2
      end
    end
  end
  for j = r + 1, 10 do
    reply[j] = nil
  end
  return reply
end

local count = whole(ARGV[1])
if count == nil or count < 1 then
  return fail('ARGV[1] (request count) must be at least 1')
end
local requests, a, k = {}, 2, 0
for r = 1, count do
  local req, next_a, next_k = parse_request(r, a, k)
  if req == nil then
    return fail(next_a)
  end
  requests[r], a, k = req, next_a, next_k
end
if ARGV[a] ~= nil then
  return fail('unexpected argument ARGV[' .. a .. ']')
end
if #KEYS ~= k then
  return fail('expected ' .. k .. ' keys, got ' .. #KEYS)
end

-- Each request on its own: a Redis error in one (a key of another type) fails that one only.
local replies = {}
for r = 1, #requests do
  local req = requests[r]
  local ok, out = pcall(decide, req)
  if not ok then
    -- What Redis said (a command's error reply), or a Lua error's text.
    out = { -1, type(out) == 'table' and tostring(out.err) or tostring(out) }
  end
  replies[r] = out
end
return replies
