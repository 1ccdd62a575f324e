-- === compact_in_place: a compact log of unweighted entries, read where it lies ===
--
-- The straight-line paths' reading of the compact log: one hit or none on a log of unweighted
-- entries, read in the string itself (no table of its state), for the requests most calls
-- carry. Any other log goes through compact_log.lua.
do
  -- Reads the log `key` of a one-window rule of `length` ms if it holds unweighted entries
  -- only (or is absent), and finds its trim: answers its text (false: none), slot width, base,
  -- number of slots n, the first slot inside the window f (n: none), that slot's time, and
  -- the newest entry's time (0: none). nil for any other log: a weighted one, an empty one, a
  -- sorted set, a key of another type, a text slidegate did not write (the general path reads
  -- it, and tells why), or one whose next entry would lie further from its base than a slot
  -- holds (the general path moves the base).
  plain_log = function(key, rule, length)
    local s = redis.pcall('GET', key)
    if not s then
      return false, rule.width, 0, 0, 0, 0, 0
    end
    if type(s) ~= 'string' then
      return nil
    end
    local W, len = byte(s, 1), #s
    if (W ~= 4 and W ~= 6) or len <= PLAIN or (len - PLAIN) % W ~= 0 then
      return nil
    end
    local n = (len - PLAIN) / W
    local b1, b2, b3, b4, b5, b6 = byte(s, 2, PLAIN)
    local base = ((((b1 * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6
    local newest = base + slot_at(s, PLAIN + 1 + (n - 1) * W, W)
    local bound = now - length
    if newest <= bound then
      return s, W, base, n, n, 0, newest
    end
    if max(now, newest) - base >= TOP[W] then
      return nil
    end
    local first = base + slot_at(s, PLAIN + 1, W)
    if first > bound then
      return s, W, base, n, 0, first, newest
    end
    -- Slot 0 is at or before the bound, slot n - 1 after it: the first after it, by bisection.
    local lo, hi = 1, n - 1
    while lo < hi do
      local mid = (lo + hi - (lo + hi) % 2) / 2
      if base + slot_at(s, PLAIN + 1 + mid * W, W) > bound then
        hi = mid
      else
        lo = mid + 1
      end
    end
    return s, W, base, n, lo, base + slot_at(s, PLAIN + 1 + lo * W, W), newest
  end

  -- Writes a log read by `plain_log` after the request: trimmed to slot f, with an entry at
  -- `stamp` when the request recorded one (false: none); nothing when neither. Its expiry, a
  -- window, a period (a quarter window) and 1 s, is set as `expiry_due` has it for a sorted
  -- set: when the entry recorded is the first of its period (time cut into periods) or the
  -- log is new, so that it outlasts every entry of that period by the window and 1 s, and a
  -- busy log sets it about once a period; other writes keep it (KEEPTTL), since it outlasts
  -- the newest entry kept.
  plain_write = function(key, rule, s, W, base, n, f, stamp, newest)
    if stamp then
      local text
      if f == n then
        -- New, or emptied by the trim: a fresh base.
        W = rule.width
        text = char(W) .. bytes(stamp, 6) .. bytes(0, W)
      elseif f == 0 then
        text = s .. bytes(stamp - base, W)
      else
        text = string.sub(s, 1, PLAIN) .. string.sub(s, PLAIN + 1 + f * W) .. bytes(stamp - base, W)
      end
      local period = rule.period
      if f == n or stamp - stamp % period ~= newest - newest % period then
        call('SET', key, text, 'PX', rule.compact_ttl)
      else
        call('SET', key, text, 'KEEPTTL')
      end
    elseif f == n then
      if s then
        call('DEL', key)
      end
    elseif f > 0 then
      call('SET', key, string.sub(s, 1, PLAIN) .. string.sub(s, PLAIN + 1 + f * W), 'KEEPTTL')
    end
  end

  -- The reset of a log read by `plain_log` (as `compact_reset`), from its window's first slot
  -- f and that slot's time, the entry the request recorded at `stamp` (false: none) and the
  -- count after the request.
  plain_reset = function(s, W, base, n, f, first, stamp, limit, length, fits, count, size)
    if fits then
      if f < n then
        return first + length - now
      end
      return stamp and (stamp + length - now) or 0
    end
    local need, reset = hits_to_leave(limit, length, count, size)
    if need == nil then
      return reset
    end
    -- One slot an entry: the entry that takes the count down by `need` is need - 1 past f.
    local i = f + need - 1
    if i < n then
      return base + slot_at(s, PLAIN + 1 + i * W, W) + length - now
    end
    return (i == n and stamp) and (stamp + length - now) or length
  end
end
