-- === decide: the general decision, for a request of any shape ===
--
-- Five steps per request: 1. count every window of every descriptor; 2. decide; 3. record;
-- 4. keep the keys; 5. report. The straight-line paths (paths.lua) take the same steps for
-- the shapes most calls carry, and answer and write alike (tests/redis/script.rs).
do
  -- 1. Counts every window of descriptor d and decides whether it fits (and, for a debit,
  --    whether it records). Hits of earlier recording descriptors on the same key count as
  --    pending, so two descriptors sharing a log cannot overshoot together.
  local function count_and_fit(d)
    local rule, st = d.rule, d.st
    local ban_end = 0
    if d.ban then
      ban_end = tonumber(call('GET', d.ban) or '0') or 0
    end
    if ban_end > now then
      d.banned = ban_end - now
      return
    end
    if rule.buckets == 0 and not rule.sorted then
      -- A compact log, read once per key, trimmed to the longest window.
      local lg = st.lg
      if not st.head_read then
        st.head_read = true
        open_log(lg, d.key, rule)
        trim_log(lg, now - rule.longest)
      end
      for w = 1, rule.m do
        d[3 * w - 2], d[3 * w - 1], d[3 * w] = count_after(lg, now - rule[3 * w - 1])
      end
    elseif rule.buckets == 0 then
      -- The newest entry first: an empty log, or one whose newest entry is older than a
      -- window, has nothing in that window, so it needs no count (and, for the longest
      -- window, no trim: every entry is stale, and the whole log goes).
      if not st.head_read then
        st.head_read = true
        st.head_cum, st.head_time = last_entry(d.key, rule)
        if st.head_cum > 0 then
          st.trimmed = now - rule.longest
          if st.head_time <= st.trimmed then
            -- Emptied: its running totals start again (see `trim_and_count`).
            call('DEL', d.key)
            st.head_cum = 0
          elseif st.head_cum > 1 then
            call('ZREMRANGEBYSCORE', d.key, '-inf', ms(st.trimmed))
          end
        end
      end
      for w = 1, rule.m do
        local bound = now - rule[3 * w - 1]
        if st.head_cum == 1 and st.head_time > bound then
          -- The log's only entry (see `trim_and_count`) is the window's first.
          d[3 * w - 1], d[3 * w] = 0, st.head_time
        elseif st.head_cum > 0 and st.head_time > bound then
          -- The window's first entry: the cum before it and its time. Where the log was just
          -- trimmed to this window, that is the log's first entry (found by rank: no score
          -- range to read).
          local first
          if bound == st.trimmed then
            first = call('ZRANGE', d.key, '0', '0')[1]
          else
            first = call('ZRANGEBYSCORE', d.key, '(' .. ms(bound), '+inf', 'LIMIT', '0', '1')[1]
          end
          if first ~= nil then
            local cum, weight, time = log_entry(d.key, first)
            d[3 * w - 1], d[3 * w] = cum - weight, time
          end
        end
        d[3 * w - 2] = d[3 * w - 1] and (st.head_cum - d[3 * w - 1]) or 0
      end
    else
      drop_stale_buckets(d)
      for w = 1, rule.m do
        d[3 * w - 2] = counted_hits(d, w)
      end
    end
    local p, size = st.pending, d.size
    local ok, has_room = true, true
    for w = 1, rule.m do
      local c, limit = d[3 * w - 2] + p, rule[3 * w - 2]
      if c + size > limit then
        ok = false
      end
      if c >= limit then
        has_room = false
      end
    end
    d.fits = ok
    d.records = d.hits > 0 and (ok or (rule.debit and has_room) or mode == 3)
    if not ok and rule.ban_ms > 0 and mode ~= 3 then
      -- The key holds the ban's end, which decides; it lives the clock slack longer, so that a
      -- replica whose clock is behind still finds the ban until its own clock reaches the end.
      call('SET', d.ban, ms(now + rule.ban_ms), 'PX', ms(rule.ban_ms + CLOCK_SLACK_MS))
      d.banned = rule.ban_ms
      d.ban_set = 1
      d.records = false
    end
    if d.records then
      st.pending = p + d.hits
    end
  end

  -- 3. Records descriptor d (position i): a log, one weighted entry, stamped no earlier than
  --    the log's newest entry (so totals grow with time even if clocks step back: stricter,
  --    never looser); sliding_counter, the hits go into the current bucket of every distinct
  --    bucket length.
  local function record(d, i)
    local rule, st = d.rule, d.st
    st.recorded = st.recorded + d.hits
    if rule.buckets == 0 and not rule.sorted then
      local lg = st.lg
      local stamp = max(now, lg.newest)
      local at = append_entry(lg, rule, d.hits, stamp)
      d.cum, d.stamp = lg.total, stamp
      if not st.new_before then
        st.new_before, st.new_time, st.new_first = true, stamp, at
      end
    elseif rule.buckets == 0 then
      d.cum = st.head_cum + d.hits
      local stamp = max(now, st.head_time)
      call('ZADD', d.key, score(stamp), member_of(d.cum, d.hits, stamp, i))
      d.stamp = stamp
      if not st.new_before then
        st.new_before, st.new_time = st.head_cum, stamp
      end
      st.head_cum, st.head_time = d.cum, stamp
    else
      record_counter(d)
    end
  end

  -- 5. Adds descriptor d's part of the reply from out[r + 1] on (layout in contract.lua): its
  --    flags, its ban or the entry it recorded, and each window's count after the request
  --    (with every hit it recorded on the same key) and its reset. Returns the new end.
  local function answer(d, r)
    local rule = d.rule
    local banned = d.banned > 0
    out[r + 1] = (d.fits and 1 or 0) + (d.ban_set == 1 and 2 or 0) + (d.records and 4 or 0)
      + (banned and 8 or 0)
    r = r + 1
    if banned then
      out[r + 1] = d.banned
      return r + 1
    end
    if d.records then
      out[r + 1] = d.cum
      r = r + 1
      -- The entry's time, which names it with cum (a sliding_counter records no entry): a
      -- tentative request's always, another's where it is later than the call's time (flag
      -- 16), as `log_answer` writes it.
      local stamp = rule.buckets == 0 and d.stamp or 0
      if mode == 0 then
        out[r + 1] = stamp
        r = r + 1
      elseif stamp > now then
        out[r - 1] = out[r - 1] + 16
        out[r + 1] = stamp
        r = r + 1
      end
    end
    local added = d.st.recorded
    if rule.buckets > 0 and added > 0 then
      d.buckets = read_buckets(d.key)
    end
    local st = d.st
    for w = 1, rule.m do
      local c, reset
      if rule.buckets > 0 then
        c = counted_hits(d, w)
        reset = counter_reset(d, w, c)
      else
        c = d[3 * w - 2] + added
        local first, time = d[3 * w - 1], d[3 * w]
        if not rule.sorted then
          if time == nil and st.new_before then
            -- The window held nothing before this request: its first entry is the first this
            -- request recorded in the log.
            first, time = st.new_first, st.new_time
          end
          reset = compact_reset(st.lg, rule[3 * w - 2], rule[3 * w - 1], d.fits, c, d.size,
            first, time)
        else
          if not first then
            first, time = st.new_before, st.new_time
          end
          reset = window_reset(d.key, rule[3 * w - 2], rule[3 * w - 1], d.fits, c, d.size, first,
            time)
        end
      end
      out[r + 1], out[r + 2] = c, reset
      r = r + 2
    end
    return r
  end

  -- Decides the request whose arguments start at ARGV[a] and keys after KEYS[k], of any
  -- shape: writes its values from out[o + 2] on and answers the index of its last, or nil and
  -- why its arguments are bad.
  decide = function(a, k)
    local after_a, after_k = check_request(current, a, k)
    if after_a == nil then
      return nil, after_k
    end
    next_a, next_k = after_a, after_k
    bind(a, k)
    -- 1. and 2. Count each descriptor, then decide. (Steps that can run in one pass over the
    --    descriptors do: each pass costs the interpreter.)
    local enforced_fit, quota_seen, quota_fit = true, false, false
    for i = 1, n do
      local d = states[i]
      count_and_fit(d)
      local role = d.rule.role
      if role == 0 and not d.fits then
        enforced_fit = false
      elseif role == 2 then
        quota_seen = true
        quota_fit = quota_fit or d.fits
      end
    end
    local admitted = admits(enforced_fit, quota_seen, quota_fit)

    -- 3. Record every fitting descriptor of an admitted request, and every debit that records
    --    whatever the decision. 4. Keep every data key as long as its longest window, whether
    --    or not this request recorded: a key under constant rejection must not expire and
    --    reopen.
    for i = 1, n do
      local d = states[i]
      if d.records and (admitted or d.rule.debit) then
        record(d, i)
      else
        d.records = false
      end
      if d.rule.buckets > 0 or d.rule.sorted then
        call('PEXPIRE', d.key, d.rule.ttl)
      end
    end
    -- A compact log is written once, with its expiry, by the first descriptor on it.
    for i = 1, n do
      local d = states[i]
      if d.st == d and d.rule.buckets == 0 and not d.rule.sorted then
        write_log(d.lg, d.key, d.rule.compact_ttl)
      end
    end

    -- 5. Report.
    local r = o + 1
    for i = 1, n do
      r = answer(states[i], r)
    end
    return r
  end
end
