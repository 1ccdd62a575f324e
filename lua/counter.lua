-- === counter: the sliding counter, buckets in a hash ===
--
-- A window of length W has buckets of floor(W / buckets) ms, field "<bucket_ms>:<bucket>" =
-- hits; every bucket that overlaps (now - W, now] counts in full. The functions take a
-- descriptor's decision state `d` (request.lua): its rule, key, size, whether it fits, and
-- the buckets read (d.buckets).
do
  -- The buckets stored in a hash, as { size, index, hits, field }.
  read_buckets = function(key)
    local raw = call('HGETALL', key)
    local found = {}
    for f = 1, #raw, 2 do
      local size, index = string.match(raw[f], '^(%d+):(%d+)$')
      if size then
        found[#found + 1] = { size = tonumber(size), index = tonumber(index),
                              hits = tonumber(raw[f + 1]) or 0, field = raw[f] }
      end
    end
    return found
  end

  -- The first bucket that counts for window w of a rule: every bucket that overlaps the
  -- window.
  local function oldest(rule, w)
    return math.floor(max(now - rule[3 * w - 1], 0) / rule[3 * w])
  end

  -- The buckets that count for window w of descriptor d, oldest first.
  local function buckets_in_window(d, w)
    local size, first, list = d.rule[3 * w], oldest(d.rule, w), {}
    for bi = 1, #d.buckets do
      local b = d.buckets[bi]
      if b.size == size and b.index >= first then
        list[#list + 1] = b
      end
    end
    table.sort(list, function(x, y) return x.index < y.index end)
    return list
  end

  counted_hits = function(d, w)
    local c, list = 0, buckets_in_window(d, w)
    for bi = 1, #list do
      c = c + list[bi].hits
    end
    return c
  end

  -- Reads d's buckets, and deletes those no window of its rule counts any more.
  drop_stale_buckets = function(d)
    local rule = d.rule
    d.buckets = read_buckets(d.key)
    local stale = {}
    for bi = 1, #d.buckets do
      local b = d.buckets[bi]
      local keep = false
      for w = 1, rule.m do
        keep = keep or (b.size == rule[3 * w] and b.index >= oldest(rule, w))
      end
      if not keep then
        stale[#stale + 1] = b.field
      end
    end
    if #stale > 0 then
      call('HDEL', d.key, unpack(stale))
    end
  end

  -- Adds d's hits to the current bucket of every distinct bucket length of its rule.
  record_counter = function(d)
    local rule = d.rule
    for w = 1, rule.m do
      local size, seen = rule[3 * w], false
      for v = 1, w - 1 do
        seen = seen or rule[3 * v] == size
      end
      if not seen then
        call('HINCRBY', d.key, ms(size) .. ':' .. ms(math.floor(now / size)), ms(d.hits))
      end
    end
  end

  -- The reset of window w of descriptor d, from its count after the call.
  counter_reset = function(d, w, count)
    local length, limit, size_w = d.rule[3 * w - 1], d.rule[3 * w - 2], d.rule[3 * w]
    local wanted = 1
    if not d.fits then
      local need, reset = hits_to_leave(limit, length, count, d.size)
      if need == nil then
        return reset
      end
      wanted = need
    end
    local list = buckets_in_window(d, w)
    for bi = 1, #list do
      local bucket = list[bi]
      wanted = wanted - bucket.hits
      if bucket.hits > 0 and wanted <= 0 then
        return (bucket.index + 1) * size_w + length - now
      end
    end
    return d.fits and 0 or length
  end
end
