-- === request: the request being decided, its admission, and the call's reply ===
do
  -- Per descriptor position i, the general path's decision state of the request being
  -- decided: made once and reset for each request (requests are decided one after the other),
  -- so deciding a request allocates little but its reply. Fields: rule, hits, size (what it
  -- must fit: its hits, or 1 for a debit rule's check), key (data), ban (key or false), fits,
  -- records, banned (ms left), ban_set, cum and stamp (of the entry it recorded), buckets
  -- (read, sliding_counter), st (the state of the data key, kept by the request's first
  -- descriptor on that key and shared by the others: its newest entry, head_cum and
  -- head_time, once read (head_read) and moved on by what the request records; trimmed, the
  -- bound a sorted set was trimmed to; lg, a compact log read into a table; hits pending from
  -- earlier descriptors; hits recorded; new_before, new_time and new_first, the cum before
  -- the first entry the request recorded, its time and (compact) its slot), and per window w,
  -- in its array part: the count at [3w - 2], and the window's first entry before this
  -- request at [3w - 1] (sorted set: the cum before it, or false; compact: its slot) and [3w]
  -- (its time).
  states = {}

  -- Reads the request from ARGV[a] and KEYS[k + 1] on (checked by `check_request`) into
  -- `states`. Its numbers are in `read`: `check_request` read each of these texts in this
  -- call. Only what a later step reads before writing is reset here (every step runs once per
  -- request: on a deployment's hot path each table write is a measurable share of the call).
  bind = function(a, k)
    begin_request(a)
    local shape = read[ARGV[a]]
    n = (shape - shape % 4) / 4
    local text
    a = a + 1
    for i = 1, n do
      local d = states[i]
      if d == nil then
        d = { rule = false, hits = 0, key = false, ban = false, fits = false, records = false,
              banned = 0, ban_set = 0, cum = 0, buckets = false, st = false, size = 0,
              head_read = false, head_cum = 0, head_time = 0, pending = 0, recorded = 0,
              new_before = false, new_time = 0, trimmed = false, lg = {} }
        states[i] = d
      end
      -- Read again where it is no longer kept: the rules kept may have been dropped since the
      -- check.
      text = ARGV[a + 1]
      local rule = rules[text] or read_rule(text)
      d.rule, d.hits = rule, read[ARGV[a]]
      d.size = (rule.debit and d.hits == 0) and 1 or d.hits
      d.key = KEYS[k + 1]
      if rule.ban_ms > 0 then
        d.ban = KEYS[k + 2]
        k = k + 2
      else
        d.ban = false
        k = k + 1
      end
      -- (buckets is written by a sliding_counter's count before anything reads it.)
      d.fits, d.records, d.banned, d.ban_set, d.cum = false, false, 0, 0, 0
      local st = d
      for j = 1, i - 1 do
        if states[j].key == d.key then
          st = states[j].st
          break
        end
      end
      if st == d then
        -- head_cum, head_time and trimmed are set where head_read is, new_time where
        -- new_before is.
        d.head_read, d.pending, d.recorded, d.new_before = false, 0, 0, false
        d.lg.changed = false
      end
      d.st = st
      -- Counts are set by the count for every window; a first entry's time is read only with
      -- it.
      for w = 1, rule.m do
        d[3 * w - 1] = false
      end
      a = a + 2
    end
  end

  -- Whether the request being decided is admitted, in its mode: final, every enforcing
  -- descriptor fits and, if there are quota descriptors, at least one of them; tentative,
  -- every enforcing descriptor fits (the caller combines the slots' quotas); rejected, never;
  -- usage, always (the hits were spent already).
  admits = function(enforced_fit, quota_seen, quota_fit)
    if mode == 1 then
      return enforced_fit and (quota_fit or not quota_seen)
    end
    return (mode == 0 and enforced_fit) or mode == 3
  end

  -- The call's reply, flat (layout in contract.lua), kept from call to call rather than made
  -- per call (it would grow step by step): o is the index of the last value written. A call
  -- writes its values from the first on, one after the other, so what is past o is what a
  -- longer call (or a request that failed halfway) left, up to the first nil; the call clears
  -- it before packing, as cmsgpack packs a table as an array only when nothing follows its last
  -- value. A call whose reply grew past OUT_KEPT values leaves a fresh table to the next
  -- (`decide_call`).
  out, o = {}, 0

  -- A one-window descriptor's part of the reply, from out[r + 1] on: flags, the running total
  -- of the entry it recorded, if it did, and that entry's time where the caller could not
  -- tell it (a tentative request's always; another's only when it is later than the call's
  -- time, flag 16: the log's newest entry was), then its window's count and reset. Answers the
  -- index of its last value.
  log_answer = function(r, flags, cum, stamp, count, reset)
    out[r + 1] = flags
    r = r + 1
    if flags >= 4 then
      out[r + 1] = cum
      r = r + 1
      if mode == 0 then
        out[r + 1] = stamp
        r = r + 1
      elseif stamp ~= now then
        out[r - 1] = flags + 16
        out[r + 1] = stamp
        r = r + 1
      end
    end
    out[r + 1], out[r + 2] = count, reset
    return r + 2
  end
end
