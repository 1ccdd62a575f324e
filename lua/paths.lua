-- === paths: straight-line decisions for the request shapes most calls carry ===
--
-- Each path takes `decide`'s steps in the same order for one request shape only, in
-- straight-line code and locals: `decide`'s state tables, its loops over windows and its
-- sharing of a key between descriptors cost the interpreter more than the Redis commands do.
-- A path answers the request's end in `out` and writes as `decide` would, or nil, having
-- written nothing, for a request not of its shape or with bad arguments (`decide` tells why).
-- PATHS, at the end, is the one table that chooses; tests/redis/script.rs runs every call
-- through a library whose table is empty beside this one and compares replies and keys, byte
-- for byte; docs/performance.md has what each path saves.
do
  -- Per descriptor position, the state of a request decided by a several-descriptor path, in
  -- arrays (an array slot is cheaper to reach than a named field): its rule, hits, what it
  -- must fit, its key, the count, whether it fits, whether it records; for sorted-set logs the
  -- newest entry (running total and time), the window's first entry before the request (the
  -- running total before it, or false, and its time), and the running total and time of the
  -- entry it recorded; for compact logs what `plain_log` read.
  local s_rule, s_hits, s_size, s_key, s_count, s_fits, s_records = {}, {}, {}, {}, {}, {}, {}
  local s_head, s_head_time, s_before, s_time, s_cum, s_stamp = {}, {}, {}, {}, {}, {}
  local s_text, s_width, s_base, s_slots, s_first, s_first_time, s_newest =
    {}, {}, {}, {}, {}, {}, {}

  -- Reads the n descriptors of the request whose arguments start at ARGV[a] and keys after
  -- KEYS[k] into the `s_` arrays, and its prefix and mode: where the next request's arguments
  -- start if every descriptor is on a one-window log of `kind` without a ban, each on a key of
  -- its own (compact: with one hit or none), with valid arguments; else nil.
  local function read_logs(a, k, n, kind)
    local compact = kind == 'compact'
    for i = 1, n do
      local text = ARGV[a + 2 * i]
      local rule = rules[text] or read_rule(text)
      local key = KEYS[k + i]
      if not (rule and key and rule.one_window == kind) then
        return nil
      end
      for j = 1, i - 1 do
        if s_key[j] == key then
          return nil
        end
      end
      text = ARGV[a + 2 * i - 1]
      local hits = read[text]
      if hits == nil then
        hits = whole(text)
      end
      if not hits or (compact and hits > 1) then
        return nil
      end
      s_rule[i], s_hits[i], s_key[i] = rule, hits, key
      s_size[i] = (rule.debit and hits == 0) and 1 or hits
    end
    return begin_request(a)
  end

  -- 2. From each descriptor's count, whether it fits and whether it records, and whether the
  --    request is admitted (as `decide`).
  local function admit_counted(n)
    local enforced_fit, quota_seen, quota_fit = true, false, false
    for i = 1, n do
      local rule, count = s_rule[i], s_count[i]
      local limit = rule[1]
      local fits = count + s_size[i] <= limit
      s_fits[i] = fits
      s_records[i] = s_hits[i] > 0 and (fits or (rule.debit and count < limit))
      local role = rule.role
      enforced_fit = enforced_fit and (fits or role ~= 0)
      if role == 2 then
        quota_seen, quota_fit = true, quota_fit or fits
      end
    end
    return admits(enforced_fit, quota_seen, quota_fit)
  end

  -- Several descriptors, each on a compact log of its own holding unweighted entries, with
  -- one hit or none. Every log is read before anything is written.
  local function several_compact_logs(a, k, n)
    local after = read_logs(a, k, n, 'compact')
    if not after then
      return nil
    end
    -- 1. Per descriptor: the log, its trim, the count.
    for i = 1, n do
      local s, W, base, slots, f, first, newest = plain_log(s_key[i], s_rule[i], s_rule[i][2])
      if s == nil then
        return nil
      end
      s_text[i], s_width[i], s_base[i], s_slots[i], s_first[i], s_first_time[i], s_newest[i] =
        s, W, base, slots, f, first, newest
      s_count[i] = slots - f
    end
    next_a, next_k = after, k + n
    -- 2. Whether each fits, and the request is admitted.
    local admitted = admit_counted(n)
    -- 3. Record, 4. write each log with its expiry, 5. report.
    local r = o + 1
    for i = 1, n do
      local rule, fits, stamp = s_rule[i], s_fits[i], false
      local s, W, base, slots, f = s_text[i], s_width[i], s_base[i], s_slots[i], s_first[i]
      if s_records[i] and (admitted or rule.debit) then
        stamp = max(now, s_newest[i])
        s_count[i] = s_count[i] + 1
      end
      plain_write(s_key[i], rule, s, W, base, slots, f, stamp, s_newest[i])
      local count = s_count[i]
      local reset = plain_reset(s, W, base, slots, f, s_first_time[i], stamp, rule[1], rule[2],
        fits, count, s_size[i])
      r = log_answer(r, (fits and 1 or 0) + (stamp and 4 or 0), count, stamp, count, reset)
    end
    return r
  end

  -- Several descriptors, each on a sorted-set log of its own.
  local function several_sorted_logs(a, k, n)
    local after = read_logs(a, k, n, 'sorted')
    if not after then
      return nil
    end
    next_a, next_k = after, k + n
    -- 1. Per descriptor: the newest entry, the trim, the window's first entry and the count.
    for i = 1, n do
      local rule = s_rule[i]
      s_head[i], s_head_time[i], s_before[i], s_time[i], s_count[i] =
        trim_and_count(s_key[i], rule[2], rule)
    end
    -- 2. Whether each fits, and the request is admitted.
    local admitted = admit_counted(n)
    -- 3. Record every fitting descriptor of an admitted request and every debit that records;
    --    4. keep every key.
    for i = 1, n do
      local rule, key, head_time = s_rule[i], s_key[i], s_head_time[i]
      local newest = now
      if s_records[i] and (admitted or rule.debit) then
        local hits = s_hits[i]
        local cum = s_head[i] + hits
        newest = max(now, head_time)
        call('ZADD', key, score(newest), member_of(cum, hits, newest, i))
        if not s_before[i] then
          s_before[i], s_time[i] = s_head[i], newest
        end
        s_count[i], s_cum[i], s_stamp[i] = s_count[i] + hits, cum, newest
      else
        s_records[i] = false
      end
      if expiry_due(rule, s_head[i], head_time, newest, s_records[i]) then
        call('PEXPIRE', key, rule.ttl)
      end
    end
    -- 5. Report: per descriptor its flags, the entry it recorded, its count and its reset.
    local r = o + 1
    for i = 1, n do
      local rule, fits, count = s_rule[i], s_fits[i], s_count[i]
      local reset = window_reset(s_key[i], rule[1], rule[2], fits, count, s_size[i], s_before[i],
        s_time[i])
      r = log_answer(r, (fits and 1 or 0) + (s_records[i] and 4 or 0), s_cum[i], s_stamp[i],
        count, reset)
    end
    return r
  end

  -- One descriptor on a compact log that holds weighted entries, or of more than one hit: the
  -- log read into a table (compact_log.lua), in straight-line code.
  local single = {}
  local function one_weighted_log(key, rule, hits)
    local limit, length, debit = rule[1], rule[2], rule.debit
    local size = (debit and hits == 0) and 1 or hits
    -- 1. The log trimmed to the window: what is left is the count.
    local lg = single
    open_log(lg, key, rule)
    trim_log(lg, now - length)
    local count = lg.total
    -- 2. Decide, 3. record, 4. write the log with its expiry if it trimmed or recorded.
    local fits = count + size <= limit
    local flags, cum, newest = fits and 1 or 0, 0, now
    if hits > 0 and (fits or (debit and count < limit)) and (mode ~= 2 or debit) then
      newest = max(now, lg.newest)
      append_entry(lg, rule, hits, newest)
      cum, count, flags = lg.total, count + hits, flags + 4
    end
    write_log(lg, key, rule.compact_ttl)
    -- 5. The reset (the log was trimmed to the window: its first entry kept is the window's).
    local first = lg.f < lg.n and entry_at(lg, lg.f) or nil
    local reset = compact_reset(lg, limit, length, fits, count, size, lg.f, first)
    return log_answer(o + 1, flags, cum, newest, count, reset)
  end

  -- One descriptor on a compact log (`rule`, its first's), the most common request. Alone, a
  -- descriptor that records either fits (then every role admits the request) or is a debit
  -- (which records whatever the decision), so the role changes nothing here: only a request
  -- the caller already rejected (mode 2) records no fitting hits. One hit or none on a log of
  -- unweighted entries is read in place; any other by `one_weighted_log`.
  local function one_compact_log(a, k, _, rule)
    local key, text = KEYS[k + 1], ARGV[a + 1]
    local hits = read[text]
    if hits == nil then
      hits = whole(text)
    end
    local after = key and hits and begin_request(a)
    if not after then
      return nil
    end
    next_a, next_k = after, k + 1
    local s, W, base, n, f, first, newest
    if hits <= 1 then
      s, W, base, n, f, first, newest = plain_log(key, rule, rule[2])
    end
    if s == nil then
      return one_weighted_log(key, rule, hits)
    end
    local limit, length, debit = rule[1], rule[2], rule.debit
    local size = (debit and hits == 0) and 1 or hits
    local count = n - f
    local fits = count + size <= limit
    local flags, cum, stamp = fits and 1 or 0, 0, false
    if hits > 0 and (fits or (debit and count < limit)) and (mode ~= 2 or debit) then
      stamp = max(now, newest)
      count = count + 1
      cum, flags = count, flags + 4
    end
    plain_write(key, rule, s, W, base, n, f, stamp, newest)
    local reset = plain_reset(s, W, base, n, f, first, stamp, limit, length, fits, count, size)
    return log_answer(o + 1, flags, cum, stamp or now, count, reset)
  end

  -- One descriptor on a sorted-set log (the role changes nothing: see `one_compact_log`).
  local function one_sorted_log(a, k, _, rule)
    local key, text = KEYS[k + 1], ARGV[a + 1]
    local hits = read[text]
    if hits == nil then
      hits = whole(text)
    end
    local after = key and hits and begin_request(a)
    if not after then
      return nil
    end
    next_a, next_k = after, k + 1
    local limit, length, debit = rule[1], rule[2], rule.debit
    local size = (debit and hits == 0) and 1 or hits
    -- 1. The newest entry, the trim, the window's first entry and the count.
    local head_cum, head_time, before, time, count = trim_and_count(key, length, rule)
    -- 2. Decide.
    local fits = count + size <= limit
    local records = hits > 0 and (fits or (debit and count < limit)) and (mode ~= 2 or debit)
    -- 3. Record, 4. keep the key.
    local flags, cum, newest = fits and 1 or 0, 0, now
    if records then
      cum = head_cum + hits
      newest = max(now, head_time)
      call('ZADD', key, score(newest), member_of(cum, hits, newest, 1))
      if not before then
        before, time = head_cum, newest
      end
      count = count + hits
      flags = flags + 4
    end
    if expiry_due(rule, head_cum, head_time, newest, records) then
      call('PEXPIRE', key, rule.ttl)
    end
    -- 5. The reset and the reply.
    local reset = window_reset(key, limit, length, fits, count, size, before, time)
    return log_answer(o + 1, flags, cum, newest, count, reset)
  end

  -- The paths, by the log format of the first descriptor's rule when it is a one-window log
  -- without a ban (`rule.one_window`: 'compact' or 'sorted'; a rule of several windows, a ban
  -- or a sliding_counter has none), then by the number of descriptors: [1] one, [2] several.
  -- Each path checks the rest of the request; a request none takes goes to `decide`. (A rule
  -- keeps its entry of this table, `rule.paths`, made with the rule: `decide_from` looks up no
  -- name per request.)
  PATHS = {
    compact = { one_compact_log, several_compact_logs },
    sorted = { one_sorted_log, several_sorted_logs },
  }
end
