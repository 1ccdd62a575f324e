-- === convert: a log found in the other format, rewritten ===
--
-- A key's format follows its rule: compact, or a sorted set for rules whose log can pass 1,000
-- entries and with `--redis-log-format sorted-set`. A reload that moves a limit across 1,000, or
-- a change of that flag, meets logs of the other format under the same keys; each is rewritten
-- whole, in order, when a request first reads it, so nothing it counted is lost.
do
  -- The time to live to give a log rewritten in another format: the one it had.
  local function kept_ttl(key, fallback)
    local pttl = call('PTTL', key)
    return pttl > 0 and ms(pttl) or fallback
  end

  -- Rewrites the sorted-set log `key` as a compact one for `rule` (its entries' times and
  -- weights, in order) and answers its text, or false when it held nothing.
  sorted_to_compact = function(key, rule)
    local members = call('ZRANGE', key, '0', '-1')
    if members[1] == nil then
      return false
    end
    -- Every member read before anything is written: one slidegate did not write fails the
    -- request and leaves the log as it was.
    local lg = { n = 0, f = 0 }
    for i = 1, #members do
      local _, weight, time = log_entry(key, members[i])
      append_entry(lg, rule, weight, max(time, lg.newest or 0))
    end
    local text = log_text(lg)
    call('SET', key, text, 'PX', kept_ttl(key, rule.compact_ttl))
    return text
  end

  -- Rewrites the compact log `key` as a sorted set (`rule`: the one that reads it now):
  -- members "<cum>:<weight>:<time>", cum counted from the first entry kept.
  compact_to_sorted = function(key, rule)
    local lg = {}
    open_log(lg, key, rule)
    local ttl = kept_ttl(key, rule.ttl)
    call('DEL', key)
    local i, cum, t, w = 0, 0, 0, 0
    while i < lg.n do
      t, w, i = entry_at(lg, i)
      cum = cum + w
      call('ZADD', key, ms(t), padded_cum(cum) .. ':' .. ms(w) .. ':' .. ms(t))
    end
    if cum > 0 then
      call('PEXPIRE', key, ttl)
    end
  end
end
