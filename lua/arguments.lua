-- === arguments: numbers and rules read from ARGV, checked, and kept ===
do
  fail = function(message)
    return redis.error_reply('SLIDEGATE ' .. message)
  end

  -- A key whose content slidegate did not write (something else wrote into its key space)
  -- fails the request that reads it, with a message that says so, rather than being counted
  -- wrongly.
  foreign = function(key)
    error({ err = 'SLIDEGATE log ' .. key .. ' holds an entry slidegate did not write' })
  end

  -- Whole numbers read so far, by their text (false: not a whole number). Turning text into a
  -- number costs a strtod, and arguments repeat ("0", "1", the same limits and windows, the
  -- same ms): a table lookup is far cheaper. Kept from call to call up to about NUMBERS_KEPT
  -- of them (with `texts`), then dropped all at once when a call starts (never during one:
  -- `bind` finds here every number `check_request` read).
  local NUMBERS_KEPT = 1000
  local numbers_kept = 0
  read = {}
  -- The other way: the text of a whole number, for every number the library passes to
  -- redis.call. Redis 7.0 turns a Lua number argument into text with snprintf("%.17g"), a
  -- floating-point printf; a table lookup, or a "%d" once per distinct number, is far cheaper.
  local texts = {}
  whole = function(text)
    local v = read[text]
    if v == nil then
      v = tonumber(text)
      if v == nil or v < 0 or v % 1 ~= 0 then
        v = false
      end
      if text ~= nil then
        read[text], numbers_kept = v, numbers_kept + 1
      end
    end
    return v or nil
  end

  -- A whole number as text.
  ms = function(v)
    local t = texts[v]
    if t == nil then
      t = format('%d', v)
      texts[v], numbers_kept = t, numbers_kept + 1
    end
    return t
  end

  -- A running total as a log member starts with it: 20 digits, zero-padded (members of one ms
  -- sort by it). Kept for totals below PADDED_KEPT, the common ones (a log's totals start at
  -- its first entry's weight), so the printf runs once per distinct total rather than per
  -- entry.
  local PADDED_KEPT = 1000
  local padded = {}
  padded_cum = function(cum)
    local text = padded[cum]
    if text == nil then
      text = format('%020d', cum)
      if cum < PADDED_KEPT then
        padded[cum] = text
      end
    end
    return text
  end

  -- Redis TIME, read once per call: every request of a call is decided at the same moment.
  local time_now
  redis_now = function()
    if time_now == nil then
      local t = call('TIME')
      time_now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    end
    return time_now
  end

  -- How long every key outlives what it holds: the slack for replicas' clocks, so that a
  -- replica whose clock is behind (up to this much) still finds all it would count.
  CLOCK_SLACK_MS = 1000

  -- Rules read so far, by their text (false: not a rule), kept from call to call (a process's
  -- rules repeat) up to RULES_KEPT of them, then dropped all at once. A rule, once made, is
  -- only read: role, ban_ms, buckets, debit (boolean), sorted (a sorted-set log), m (windows),
  -- longest (window), ttl (the data key's, as text), one_window (one sliding_log window and
  -- no ban: 'compact' or 'sorted', the log's format; else false), width and compact_ttl (a compact log's slot width and
  -- expiry), period (one-window logs: how often their expiry is set), and per window w, in its
  -- array part: limit at [3w - 2], length in ms at [3w - 1], bucket length at [3w]
  -- (sliding_counter; 0 for sliding_log). (One table per rule: each table costs an allocation,
  -- and this runs for every call.)
  local RULES_KEPT = 1000
  local rules_kept = 0
  rules = {}

  -- The windows of a rule from its text after the fields (at `at`), into `rule`: false when
  -- they are not valid.
  local function read_windows(rule, text, at)
    local ok, buckets, last = true, rule.buckets, #text
    while at <= last do
      local limit, length, after = string.match(text, '^:(%d+):(%d+)()', at)
      if limit == nil then
        break
      end
      local w = rule.m + 1
      limit, length = whole(limit), whole(length)
      ok = ok and length >= 1
      rule[3 * w - 2], rule[3 * w - 1], rule[3 * w] = limit, length, 0
      if buckets > 0 then
        rule[3 * w] = max(math.floor(length / buckets), 1)
      end
      rule.m, rule.longest, at = w, max(rule.longest, length), after
    end
    return ok and rule.m > 0 and at == last + 1
  end

  -- How long a rule's keys live: the data key as long as the longest window (plus a bucket),
  -- with the slack for replicas' clocks. The common kind, one sliding_log window without a
  -- ban (what the straight-line paths decide), sets its keys' expiry once per period, a
  -- quarter of the window, and lasts a period longer (see `expiry_due`).
  local function set_lifetimes(rule)
    local buckets = rule.buckets
    local ttl = rule.longest + CLOCK_SLACK_MS
    if buckets > 0 then
      ttl = ttl + math.ceil(rule.longest / buckets)
    end
    local one = buckets == 0 and rule.ban_ms == 0 and rule.m == 1
    rule.one_window = one and (rule.sorted and 'sorted' or 'compact')
    -- The straight-line paths for requests whose first descriptor has this rule (paths.lua).
    rule.paths = one and PATHS[rule.one_window]
    -- A compact log's slots: 4 bytes hold offsets up to 2^31 ms, room for twice a window up
    -- to 2^30 ms (12.4 days); longer windows take 6. Its expiry is set on every write.
    rule.width = rule.longest < 1073741824 and 4 or 6
    rule.compact_ttl = ms(rule.longest + CLOCK_SLACK_MS)
    if one then
      rule.period = max(math.floor(rule.longest / 4), 1)
      ttl = ttl + rule.period
      -- The straight-line paths set a compact log's expiry once a period too (`plain_write`).
      rule.compact_ttl = ms(rule.longest + CLOCK_SLACK_MS + rule.period)
    end
    rule.ttl = ms(ttl)
  end

  read_rule = function(text)
    local rule = rules[text]
    if rule ~= nil then
      return rule or nil
    end
    rule = false
    local role, ban_ms, buckets, flags, at
    if type(text) == 'string' then
      role, ban_ms, buckets, flags, at = string.match(text, '^(%d+):(%d+):(%d+):(%d+)()')
    end
    if role ~= nil then
      flags = whole(flags)
      rule = { role = whole(role), ban_ms = whole(ban_ms), buckets = whole(buckets),
               debit = flags % 2 == 1, sorted = flags >= 2, m = 0, longest = 0, ttl = '' }
      if rule.role <= 2 and flags <= 3 and read_windows(rule, text, at) then
        set_lifetimes(rule)
      else
        rule = false
      end
    end
    if text ~= nil then
      if rules_kept >= RULES_KEPT then
        rules, rules_kept = {}, 0
      end
      rules[text], rules_kept = rule, rules_kept + 1
    end
    return rule or nil
  end

  -- Checks one request's arguments, from ARGV[a] and KEYS[k + 1] on: where the next
  -- request's start, or nil and why not. The general path checks a request here before it
  -- writes anything; the straight-line paths check what they read themselves and leave a bad
  -- request to the general path, which tells why.
  check_request = function(r, a, k)
    local problem = nil
    -- Numbers and rules read before are looked up here rather than through `whole` and
    -- `read_rule` (false: read before, and not valid): this runs for every request of every
    -- call, and a Lua function call costs several lookups.
    local shape = read[ARGV[a]]
    if shape == nil then
      shape = whole(ARGV[a])
    end
    local mode = shape and shape % 4
    local n = shape and (shape - mode) / 4
    if not shape then
      problem = 'shape (4 x descriptor count + mode) must be a whole number'
    elseif mode > most_mode then
      problem = most_mode == 2 and 'mode must be 0, 1 or 2' or 'mode must be 0, 1, 2 or 3'
    elseif n < 1 then
      problem = 'descriptor count must be at least 1'
    elseif mode == 0 and (ARGV[a + 1 + 2 * n] or '') == '' then
      problem = 'member prefix is missing (a tentative request ends with it: it names its entries)'
    else
      a = a + 1
      for i = 1, n do
        local text, hits = ARGV[a + 1], read[ARGV[a]]
        local rule = rules[text]
        if rule == nil then
          rule = read_rule(text)
        end
        if hits == nil then
          hits = whole(ARGV[a])
        end
        if not hits or not rule then
          -- Messages are built only on failure: turning a number into text costs a printf.
          problem = 'descriptor ' .. i .. ': hits and a rule "role(0-2):ban_ms:buckets:flags(0-3):limit:window_ms(>= 1)[:limit:window_ms...]" are required'
          break
        end
        k = k + (rule.ban_ms > 0 and 2 or 1)
        a = a + 2
      end
      if mode == 0 then
        a = a + 1
      end
      if problem == nil and KEYS[k] == nil then
        problem = 'expected at least ' .. k .. ' keys, got ' .. #KEYS
      end
    end
    if problem ~= nil then
      return nil, 'request ' .. r .. ': ' .. problem
    end
    return a, k
  end

  -- Sets the mode and member prefix of the request whose arguments start at ARGV[a], and
  -- answers where the next request's start, or nil when they are not valid (the general path
  -- checks them in `check_request` first, with reasons; the straight-line paths leave a
  -- request with bad ones to it).
  begin_request = function(a)
    local text = ARGV[a]
    local shape = read[text]
    if shape == nil then
      shape = whole(text)
    end
    mode = shape and shape % 4
    if mode == 0 then
      local after = a + 1 + shape / 2
      prefix = ARGV[after]
      return prefix ~= nil and prefix ~= '' and after + 1 or nil
    end
    prefix = nil
    return mode and mode <= 2 and a + 1 + (shape - mode) / 2 or nil
  end

  -- For a descriptor that does not fit `size` hits with `count` in a window of `limit` and
  -- `length` ms: the hits that must leave the window first, or nil and the reset when no entry
  -- decides it (0: the window has room; its length: the hits exceed its limit). Every log
  -- format's reset starts here.
  hits_to_leave = function(limit, length, count, size)
    local need = count + size - limit
    if need <= 0 then
      return nil, 0
    end
    if size > limit then
      return nil, length
    end
    return need
  end

  -- The call's time from `text`, and its text for the scores of the entries recorded at it:
  -- the caller's digits as they came (an entry's score is the call's time unless the log's
  -- newest entry is later), so that no call pays a printf for it, nor keeps a number it will
  -- not see again. "" reads Redis TIME. False when the text is neither.
  read_now = function(text)
    if text == '' then
      now = redis_now()
      now_text = format('%d', now)
    elseif text ~= nil and find(text, '^%d+$') then
      now, now_text = tonumber(text), text
    else
      return false
    end
    return true
  end

  -- Starts a call of any entry function: its KEYS and ARGV, Redis TIME not read yet, the
  -- kept numbers dropped when there are too many, and the library functions' locals set.
  begin_call = function(keys, args)
    KEYS, ARGV, time_now, most_mode = keys, args, nil, 2
    if numbers_kept > NUMBERS_KEPT then
      read, texts, numbers_kept = {}, {}, 0
    end
    if call == nil then
      tonumber, format, find, max, call, byte, char =
        _G.tonumber, _G.string.format, _G.string.find, _G.math.max, _G.redis.call,
        _G.string.byte, _G.string.char
    end
  end
end
