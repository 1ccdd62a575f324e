-- === compact_log: a compact log read into a table, for every path ===
--
-- While a request decides on a compact log, its state is a table `lg`: s, its text as read,
-- with what this request appended (false: no log); o, the length of its head; W, the slot
-- width; base and total (as in the head, total less what the trim dropped and plus what was
-- appended); weighted; f, the first slot kept (the trim drops slots before it); n, the number
-- of slots in s; newest, the newest entry's time (0: none); changed, whether it must be
-- written; moved, whether this request moved its base (and so its slots). A log is written
-- whole (one SET, which keeps a string exactly its length where APPEND and SETRANGE leave room
-- to grow) when a call trims or records, and its expiry with it.
do
  -- The value of slot i (from 0) of a log read into a table. (`slot_at`'s arithmetic in line:
  -- it runs for every slot a weighted log's count reads, and a call per slot cost a weighted
  -- request 2% more of Redis's instructions, docs/performance.md.)
  local function slot(lg, i)
    local W = lg.W
    local p = lg.o + 1 + i * W
    if W == 4 then
      local a, b, c, d = byte(lg.s, p, p + 3)
      return ((a * 256 + b) * 256 + c) * 256 + d
    end
    local a, b, c, d, e, f = byte(lg.s, p, p + 5)
    return ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
  end

  -- Reads the compact log `key` into lg (`rule`: the rule that reads it). A sorted set there
  -- is rewritten in this format first, whole, so that nothing it counted is lost.
  open_log = function(lg, key, rule)
    local s = redis.pcall('GET', key)
    if type(s) == 'table' then
      if find(tostring(s.err), 'WRONGTYPE', 1, true) then
        s = sorted_to_compact(key, rule)
      else
        error(s)
      end
    end
    lg.changed, lg.newest, lg.f, lg.moved = false, 0, 0, false
    if not s then
      lg.s, lg.W, lg.base, lg.total, lg.weighted, lg.n = false, rule.width, 0, 0, false, 0
      return
    end
    local len, tag = #s, byte(s, 1)
    local W = tag and tag % 16
    local weighted = tag and tag >= 16
    local head = weighted and HEAD or PLAIN
    if len < head or (W ~= 4 and W ~= 6) or tag >= 32 or (len - head) % W ~= 0 then
      foreign(key)
    end
    local n = (len - head) / W
    lg.s, lg.o, lg.W, lg.weighted, lg.n, lg.total = s, head, W, weighted, n, n
    local b1, b2, b3, b4, b5, b6 = byte(s, 2, PLAIN)
    local base = ((((b1 * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6
    lg.base = base
    if weighted then
      local t1, t2, t3, t4, t5, t6 = byte(s, PLAIN + 1, HEAD)
      lg.total = ((((t1 * 256 + t2) * 256 + t3) * 256 + t4) * 256 + t5) * 256 + t6
    end
    if n > 0 then
      local last = n - 1
      if n > 1 and slot(lg, n - 2) >= TOP[W] then
        last = n - 2
      end
      lg.newest = base + slot(lg, last) % TOP[W]
    end
  end

  -- The entry whose first slot is i: its time, its weight and the slot after it.
  entry_at = function(lg, i)
    local v, top = slot(lg, i), TOP[lg.W]
    if v >= top then
      return lg.base + v - top, slot(lg, i + 1), i + 2
    end
    return lg.base + v, 1, i + 1
  end

  -- The first slot of the first entry kept whose time is after `bound` (lg.n: none), by
  -- binary search: a slot that is a weight stands for the entry before it.
  local function first_after(lg, bound)
    local lo, hi = lg.f, lg.n
    local top, base = TOP[lg.W], lg.base
    while lo < hi do
      local h = (lo + hi - (lo + hi) % 2) / 2
      if h > lo and slot(lg, h - 1) >= top then
        h = h - 1
      end
      local v = slot(lg, h)
      if v >= top then
        if base + v - top > bound then hi = h else lo = h + 2 end
      elseif base + v > bound then
        hi = h
      else
        lo = h + 1
      end
    end
    return lo
  end

  -- The weight of the entries from slot i to slot j (each the first slot of an entry, or
  -- j = lg.n).
  local function weight_of(lg, i, j)
    if not lg.weighted then
      return j - i
    end
    local sum, t, w = 0, 0, 0
    while i < j do
      t, w, i = entry_at(lg, i)
      sum = sum + w
    end
    return sum
  end

  -- Drops the entries at or before `bound`.
  trim_log = function(lg, bound)
    if lg.n > lg.f and entry_at(lg, lg.f) <= bound then
      local first = first_after(lg, bound)
      if first > lg.f then
        lg.total = lg.total - weight_of(lg, lg.f, first)
        lg.f, lg.changed = first, true
      end
    end
  end

  -- The hits after `bound`, and the first slot of the first entry after it and its time
  -- (nil: none).
  count_after = function(lg, bound)
    if lg.f == lg.n then
      return 0, lg.f, nil
    end
    local time = entry_at(lg, lg.f)
    if time > bound then
      -- Every entry kept is inside (the window the log was trimmed to).
      return lg.total, lg.f, time
    end
    local first = first_after(lg, bound)
    time = first < lg.n and entry_at(lg, first) or nil
    if first - lg.f <= lg.n - first then
      return lg.total - weight_of(lg, lg.f, first), first, time
    end
    return weight_of(lg, first, lg.n), first, time
  end

  -- The reset of a window of `limit` and `length` ms for a descriptor that must fit `size`
  -- hits, from its count after the call and the window's first entry (its slot and time, nil:
  -- none).
  compact_reset = function(lg, limit, length, fits, count, size, first, time)
    if fits then
      return time and (time + length - now) or 0
    end
    if lg.moved or first == nil then
      -- The request moved the log's base, and its slots with it.
      first = first_after(lg, now - length)
    end
    local need, reset = hits_to_leave(limit, length, count, size)
    if need == nil then
      return reset
    end
    if not lg.weighted then
      -- One slot an entry: the entry that takes the window's count down by `need` is
      -- need - 1 entries past its first.
      local i = first + need - 1
      return i < lg.n and (entry_at(lg, i) + length - now) or length
    end
    local i, t, w = first, 0, 0
    while i < lg.n do
      t, w, i = entry_at(lg, i)
      need = need - w
      if need <= 0 then
        return t + length - now
      end
    end
    return length
  end

  -- Re-encodes the entries kept with width W from base `base`: when an entry would lie
  -- further from the base than a slot holds (the base is kept until the log empties: a log
  -- busy for weeks), or a rule with a longer window writes a log of one with a shorter.
  local function reencode(lg, W, base)
    local parts, i, t, w = {}, lg.f, 0, 0
    local top = TOP[W]
    while i < lg.n do
      t, w, i = entry_at(lg, i)
      if w == 1 then
        parts[#parts + 1] = bytes(t - base, W)
      else
        parts[#parts + 1] = bytes(t - base + top, W) .. bytes(w, W)
      end
    end
    lg.s = table.concat(parts)
    lg.o, lg.W, lg.base, lg.f, lg.n, lg.moved = 0, W, base, 0, #lg.s / W, true
  end

  -- Appends an entry of `hits` at time `stamp` (no earlier than the newest) for `rule`;
  -- answers its slot.
  append_entry = function(lg, rule, hits, stamp)
    if lg.n == lg.f then
      lg.s, lg.o, lg.W, lg.base, lg.f, lg.n, lg.total, lg.weighted =
        '', 0, rule.width, stamp, 0, 0, 0, false
    end
    local W = lg.W
    if stamp - lg.base >= TOP[W] or W < rule.width then
      W = max(W, rule.width)
      local oldest = entry_at(lg, lg.f)
      if stamp - oldest >= TOP[W] then
        W = 6
      end
      reencode(lg, W, oldest)
    end
    local v, top, at = stamp - lg.base, TOP[W], lg.n
    if hits == 1 then
      lg.s = lg.s .. bytes(v, W)
    else
      -- A weight must stay below the top bit: larger hits go as several entries of one time.
      local left, parts = hits, {}
      while left > 0 do
        local w = math.min(left, top - 1)
        parts[#parts + 1] = bytes(v + top, W) .. bytes(w, W)
        left = left - w
      end
      lg.s = lg.s .. table.concat(parts)
      lg.weighted = true
    end
    lg.n = (#lg.s - lg.o) / W
    lg.total, lg.newest, lg.changed = lg.total + hits, stamp, true
    return at
  end

  -- Takes `weight` hits at `time` out of the log: entries of that time and weight, newest
  -- first (above a slot's top bit, hits were recorded as several entries of one time). Entries
  -- of one time and weight count alike and leave every window together, so whichever goes,
  -- the counts are as if those hits had never been recorded. Answers the hits taken out.
  remove_entry = function(lg, time, weight)
    local top, at = TOP[lg.W], {}
    local i, t, w = lg.f, 0, 0
    while i < lg.n do
      at[#at + 1] = i
      t, w, i = entry_at(lg, i)
    end
    local gone, left = {}, weight
    while left > 0 do
      local want, found = math.min(left, top - 1), nil
      for e = #at, 1, -1 do
        t, w = entry_at(lg, at[e])
        if not gone[e] and t == time and w == want then
          found = e
          break
        end
      end
      if found == nil then
        break
      end
      gone[found], left = true, left - want
    end
    if left == weight then
      return 0
    end
    local kept, W = {}, lg.W
    for e = 1, #at do
      if not gone[e] then
        local _, _, after = entry_at(lg, at[e])
        kept[#kept + 1] = string.sub(lg.s, lg.o + 1 + at[e] * W, lg.o + after * W)
      end
    end
    lg.s = table.concat(kept)
    lg.o, lg.f, lg.n = 0, 0, #lg.s / W
    lg.total, lg.changed = lg.total - (weight - left), true
    return weight - left
  end

  -- The log's text as it is stored: its head, then the slots kept.
  log_text = function(lg)
    local W = lg.W
    if lg.o == PLAIN and not lg.weighted then
      -- Read as a log of unweighted entries, and still one: its head (base) as it was.
      if lg.f == 0 then
        return lg.s
      end
      return string.sub(lg.s, 1, PLAIN) .. string.sub(lg.s, PLAIN + 1 + lg.f * W)
    end
    local slots = string.sub(lg.s, lg.o + 1 + lg.f * W)
    if lg.weighted then
      return char(W + 16) .. bytes(lg.base, 6) .. bytes(lg.total, 6) .. slots
    end
    return char(W) .. bytes(lg.base, 6) .. slots
  end

  -- Writes the log if the request changed it: emptied, the key goes; else one SET with its
  -- expiry `ttl` (ms, as text), or the one it has where `ttl` is nil.
  write_log = function(lg, key, ttl)
    if not lg.changed then
      return
    end
    if lg.n == lg.f then
      call('DEL', key)
    elseif ttl == nil then
      call('SET', key, log_text(lg), 'KEEPTTL')
    else
      call('SET', key, log_text(lg), 'PX', ttl)
    end
  end
end
