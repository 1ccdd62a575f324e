-- === sorted_log: a log of weighted entries with running totals, in a sorted set ===
--
-- For rules whose log can pass 1,000 entries, or with `--redis-log-format sorted-set` (rule
-- flag 2). An entry's score is its time in ms, its member "<cum>:<weight>:<time>", or
-- "<cum>:<weight>:<time>:<prefix>:<i>" when a tentative request wrote it. Weight is the
-- request's hits; cum (20 digits, zero-padded) is the log's running total of hits up to and
-- including the entry, so the hits in a window are the newest cum minus the cum before the
-- window's first entry, whatever the number of entries; no two entries of a log share a cum.
-- <time> repeats the score, so an entry is read without its score (Redis prints scores with a
-- floating-point printf).
do
  -- cum and weight of a member, or nil for a member slidegate did not write. (Numbers from
  -- text by arithmetic, `text + 0`, which reads the text once, where `tonumber` reads it
  -- twice: the captures are digits, so the arithmetic cannot fail.)
  local MEMBER = '^(%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d):(%d+):'
  local function parse_member(member)
    local cum, weight = string.match(member, MEMBER)
    if cum == nil then
      return nil
    end
    return cum + 0, weight + 0
  end

  -- The texts of cum, weight and time of a member, or nil for a member slidegate did not
  -- write. Texts, not numbers: each number read from text is a strtod, and the newest entry's
  -- weight is not needed. (One capture per field, `%d+` rather than 20 `%d`s: each item of a
  -- pattern costs the matcher a step of its own.)
  local TIMED = '^(%d+):(%d+):(%d+)()'
  local function timed_texts(member)
    local cum, weight, time, after = string.match(member, TIMED)
    if cum == nil or #cum ~= 20 or (after <= #member and byte(member, after) ~= 58) then
      return nil
    end
    return cum, weight, time
  end

  -- cum, weight and time of the entry `member` of `log`.
  log_entry = function(log, member)
    local cum, weight, time = timed_texts(member)
    if cum == nil then
      foreign(log)
    end
    return cum + 0, weight + 0, time + 0
  end

  -- The text of a log entry's time, its score: the call's time as the caller sent it (see
  -- `decide_call`), else a whole number as text.
  score = function(t)
    if t == now then
      return now_text
    end
    return ms(t)
  end

  -- The member of the entry descriptor i of the request being decided records: running total
  -- cum, hits, at time t. (At most one printf, for the padded total; the rest joined from
  -- text: each directive of a format is a printf of its own.)
  member_of = function(cum, hits, t, i)
    if mode == 0 then
      return padded_cum(cum) .. ':' .. ms(hits) .. ':' .. score(t) .. ':' .. prefix .. ':' .. ms(i)
    end
    return padded_cum(cum) .. ':' .. ms(hits) .. ':' .. score(t)
  end

  -- The log's newest entry: its cum and time (0, 0 when empty). A compact log there is
  -- rewritten as a sorted set first.
  last_entry = function(log, rule)
    local newest = redis.pcall('ZRANGE', log, '-1', '-1')
    if newest.err ~= nil then
      if not find(tostring(newest.err), 'WRONGTYPE', 1, true) then
        error(newest)
      end
      compact_to_sorted(log, rule)
      newest = call('ZRANGE', log, '-1', '-1')
    end
    local last = newest[1]
    if last == nil then
      return 0, 0
    end
    local cum, _, time = timed_texts(last)
    if cum == nil then
      foreign(log)
    end
    return cum + 0, time + 0
  end

  -- The newest entry of a log with one window of `length` ms, after trimming the log to that
  -- window: its running total and time, and the window's first entry (the running total
  -- before it, or false, and its time; the log was just trimmed to this window, so it is the
  -- log's first) and the count.
  -- A newest entry whose running total is 1 is the log's only entry: it weighs 1 (every entry
  -- weighs at least 1, and no more than its total), so the total before it is 0, and totals
  -- grow along the log (an entry is recorded after the newest, with the newest's total plus
  -- its weight; trims and removals keep the order), so an entry before it would have a total
  -- of 0. Then there is nothing to trim and no first entry to read: two of four commands
  -- saved on a descriptor's second request in a window, which is most of them where most
  -- users call a few times a window. (The general path, `count_and_fit`, does the same.)
  trim_and_count = function(key, length, rule)
    local head_cum, head_time = last_entry(key, rule)
    if head_cum > 0 then
      local bound = now - length
      if head_time <= bound then
        -- Every entry has left the window: the log goes, and its running totals start again
        -- from 0, so that its next entry is again an only entry of total 1 (a user who calls
        -- once a window or less).
        call('DEL', key)
        return 0, head_time, false, 0, 0
      elseif head_cum == 1 then
        return 1, head_time, 0, head_time, 1
      else
        call('ZREMRANGEBYSCORE', key, '-inf', ms(bound))
        local first = call('ZRANGE', key, '0', '0')[1]
        if first ~= nil then
          local cum, weight, time = log_entry(key, first)
          local before = cum - weight
          return head_cum, head_time, before, time, head_cum - before
        end
      end
    end
    return head_cum, head_time, false, 0, 0
  end

  -- The time of the first entry of the window whose running total reaches `total`, `need`
  -- hits past the total before the window, or nil. Totals grow by at least 1 an entry, so it
  -- is at most need - 1 ranks past the window's first entry; when every entry weighs 1
  -- (requests) the first probe there finds it. Otherwise a binary search by rank.
  local function time_reaching(log, length, total, need)
    local low = call('ZCOUNT', log, '-inf', ms(now - length))
    local high = math.min(call('ZCARD', log) - 1, low + need - 1)
    local probe = call('ZRANGE', log, ms(high), ms(high), 'WITHSCORES')
    if probe[1] ~= nil and parse_member(probe[1]) == total then
      return probe[2] + 0
    end
    local found = nil
    while low <= high do
      local mid = math.floor((low + high) / 2)
      local entry = call('ZRANGE', log, ms(mid), ms(mid), 'WITHSCORES')
      if entry[1] == nil then
        break
      end
      if parse_member(entry[1]) >= total then
        found = entry[2] + 0
        high = mid - 1
      else
        low = mid + 1
      end
    end
    return found
  end

  -- The reset of a window of `limit` and `length` ms for a descriptor that must fit `size`
  -- hits, from its count after the call and the window's first entry (the running total
  -- before it, or false, and its time).
  window_reset = function(key, limit, length, fits, count, size, before, time)
    if fits then
      return before and (time + length - now) or 0
    end
    local need, reset = hits_to_leave(limit, length, count, size)
    if need == nil then
      return reset
    end
    local at = time_reaching(key, length, (before or 0) + need, need)
    return at and (at + length - now) or length
  end

  -- Whether the log of a one-window rule needs its expiry set again, on the straight-line
  -- paths: its newest entry, before this request, at head_time (head_cum 0: none), and after
  -- it at newest (this request's entry, or now when it recorded nothing). The expiry is set,
  -- to the window plus a period plus 1 s, when the newest entry is the first of its period
  -- (time cut into periods of a quarter window), so it outlasts every entry of that period by
  -- the window plus 1 s (the slack for replicas' clocks), and a request that finds the newest
  -- entry in a period before its own sets it again, whether or not it records: a log under
  -- constant rejection does not expire and reopen. Setting it on every request would cost a
  -- command each; this way a busy log sets it about once a period. The general path sets it
  -- on every request.
  expiry_due = function(rule, head_cum, head_time, newest, recorded)
    if head_cum == 0 then
      return recorded
    end
    local period = rule.period
    return newest - newest % period ~= head_time - head_time % period
  end
end
