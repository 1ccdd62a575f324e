-- === quota: Envoy's usage reports, and each holder's share of a bucket's limit ===
--
-- For the Rate Limit Quota Service (src/store/shares.rs has the rule and why; this part follows
-- it number for number, and tests/differential.rs holds the two to the same answers). A
-- bucket is one descriptor: the usage an Envoy reports is recorded in its log or counters by
-- `decide` in mode 3, and the holders of its limit (one per Envoy stream) are a hash beside
-- it, field holder = "expires_ms:max_tokens:tokens_per_fill:fill_interval_s:demand".
--
-- FCALL slidegate_VERSION_quota <numkeys> KEYS... ARGV...
--   KEYS, per bucket: its data key (log or counters), its holders (hash).
--   ARGV: 1 the number of buckets; 2 now (ms, or "" for Redis TIME); 3 an assignment's time
--   to live, ms; per bucket: 7 (a request of one descriptor in mode 3), the allowed requests
--   (recorded), the rule, the holder, the denied requests, the ms since the holder's last
--   report.
--   Reply, packed as the decision's: now; per bucket the grant (0 the window is full, 1 held
--   by others, 2 a token bucket), max_tokens, tokens_per_fill, fill_interval_s, then each
--   window's count after the report; or -1 and an error text for a bucket that failed.
do
  local MOST_ELAPSED_MS, MOST_REPORTED, LEAST_BUDGET, FILL_INTERVALS = 3600000, 1000000000, 2, 10

  -- A holder's cost in a window of `tau` ms: the most its token bucket admits there.
  local function cost(h, tau)
    if h[2] == 0 then
      return 0
    end
    local per = max(h[4], 1) * 1000
    return h[2] + math.floor((h[3] * tau + per - 1) / per)
  end

  -- The holders of the hash `key` whose assignment has not ended, but `holder`: as arrays
  -- { expires, max_tokens, tokens_per_fill, fill_interval_s, demand }, holder's own demand
  -- (nil: new), and the fields of those that ended.
  local function read_holders(key, holder)
    local raw = call('HGETALL', key)
    local others, previous, ended = {}, nil, {}
    for i = 1, #raw, 2 do
      local e, m, f, v, d = string.match(raw[i + 1], '^(%d+):(%d+):(%d+):(%d+):(%d+)$')
      if e == nil or e + 0 <= now then
        ended[#ended + 1] = raw[i]
      elseif raw[i] == holder then
        previous = d + 0
      else
        others[#others + 1] = { e + 0, m + 0, f + 0, v + 0, d + 0 }
      end
    end
    return others, previous, ended
  end

  -- The holder's demand, requests a thousand seconds (`demand` in store/shares.rs).
  local function demand_of(allowed, denied, elapsed, previous, others)
    local reported = math.min(allowed, MOST_REPORTED) + math.min(denied, MOST_REPORTED)
    local measured = math.floor(reported * 1000000 / math.min(max(elapsed, 1000), MOST_ELAPSED_MS))
    if previous ~= nil then
      return max(measured, math.floor(previous / 2))
    elseif #others == 0 then
      return measured
    end
    local total = 0
    for i = 1, #others do
      total = total + others[i][5]
    end
    return max(measured, math.floor(total / #others))
  end

  -- The token bucket whose cost stays within every budget (`token_bucket` in store/shares.rs):
  -- max_tokens, tokens_per_fill, fill_interval_s.
  local function token_bucket(budgets, taus)
    local least = budgets[1]
    for w = 2, #budgets do
      least = math.min(least, budgets[w])
    end
    local burst = max(math.floor(least / 5), 1)
    local function per_second(interval)
      local most
      for w = 1, #budgets do
        local f = math.floor(max(budgets[w] - burst, 1) * 1000 * interval / taus[w])
        most = most and math.min(most, f) or f
      end
      return most
    end
    local fill, interval = 0, 1
    if per_second(1) >= 1 then
      for i = 1, FILL_INTERVALS do
        local f = per_second(i)
        if f * interval > fill * i then
          fill, interval = f, i
        end
      end
    else
      fill = 1
      for w = 1, #budgets do
        local per = max(budgets[w] - burst, 1) * 1000
        interval = max(interval, math.floor((taus[w] + per - 1) / per))
      end
    end
    local tokens
    for w = 1, #budgets do
      local per = interval * 1000
      local left = max(budgets[w] - math.floor((fill * taus[w] + per - 1) / per), 0)
      tokens = tokens and math.min(tokens, left) or left
    end
    return max(tokens, 1), fill, interval
  end

  -- The grant for a holder of `demand` and the budgets it leaves (`share` in store/shares.rs):
  -- 0 full, 1 held elsewhere, or 2 and the token bucket.
  local function share(rule, counts, others, demand, horizon)
    local total = demand
    for i = 1, #others do
      total = total + others[i][5]
    end
    local budgets, taus = {}, {}
    for w = 1, rule.m do
      local remaining = rule[3 * w - 2] - counts[w]
      if remaining <= 0 then
        return 0
      end
      local tau = math.min(rule[3 * w - 1], horizon)
      local room = remaining
      for i = 1, #others do
        room = room - cost(others[i], tau)
      end
      local fair = remaining
      if total > 0 then
        fair = math.floor(remaining * (demand / total))
      end
      local need = math.floor(demand * tau / 500000) + LEAST_BUDGET
      local budget = math.min(room, max(LEAST_BUDGET, math.min(fair, need)))
      if budget < LEAST_BUDGET then
        return 1
      end
      budgets[w], taus[w] = budget, tau
    end
    return 2, token_bucket(budgets, taus)
  end

  -- One bucket, its arguments from ARGV[a] and keys after KEYS[k]: its usage recorded and
  -- counted by `decide`, its share, its holder written; its part of `reply` from r + 1 on.
  -- Answers where the next bucket's arguments and keys start, and the reply's new end.
  local function one_bucket(a, k, ttl, reply, r)
    o = 0
    local e, problem = decide(a, k)
    if e == nil then
      error({ err = 'SLIDEGATE quota: ' .. problem })
    end
    local d = states[1]
    local rule, holder = d.rule, ARGV[a + 3]
    local denied, elapsed = whole(ARGV[a + 4]), whole(ARGV[a + 5])
    local hold = KEYS[k + 2]
    if holder == nil or denied == nil or elapsed == nil or hold == nil then
      error({ err = 'SLIDEGATE quota: a holder, denied requests, elapsed ms and a holders key are required' })
    end
    -- The counts `decide` answered: after the flags and, where it recorded, the entry.
    local counts, at = {}, d.records and 4 or 3
    for w = 1, rule.m do
      counts[w] = out[at + 2 * (w - 1)]
    end
    local others, previous, ended = read_holders(hold, holder)
    if #ended > 0 then
      call('HDEL', hold, unpack(ended))
    end
    local demand = demand_of(d.hits, denied, elapsed, previous, others)
    local horizon = ttl + 1000
    local kind, tokens, fill, interval = share(rule, counts, others, demand, horizon)
    call('HSET', hold, holder, format('%d:%d:%d:%d:%d', now + horizon, tokens or 0, fill or 0,
      interval or 0, demand))
    call('PEXPIRE', hold, ms(horizon + 1000))
    reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4] = kind, tokens or 0, fill or 0,
      interval or 0
    r = r + 4
    for w = 1, rule.m do
      reply[r + w] = counts[w]
    end
    return a + 6, k + 2, r + rule.m
  end

  quota_call = function(keys, args)
    begin_call(keys, args)
    most_mode = 3
    local count, ttl = whole(ARGV[1]), whole(ARGV[3])
    if count == nil or count < 1 or ttl == nil then
      return fail('quota: ARGV[1] (bucket count, at least 1) and ARGV[3] (time to live, ms) are required')
    end
    if not read_now(ARGV[2]) then
      return fail('quota: ARGV[2] (now) must be a whole number of ms or empty')
    end
    local reply, r, a, k = { now }, 1, 4, 0
    for b = 1, count do
      current = b
      local ok, na, nk, nr = pcall(one_bucket, a, k, ttl, reply, r)
      if not ok then
        -- Where the next bucket starts is unknown once one failed: the call ends there.
        reply[r + 1], reply[r + 2] = -1, type(na) == 'table' and tostring(na.err) or tostring(na)
        return cmsgpack.pack(reply)
      end
      a, k, r = na, nk, nr
    end
    return cmsgpack.pack(reply)
  end
end
