#!lua name=slidegate_VERSION
-- slidegate: decides batches of rate-limit requests atomically, on sliding windows.
--
-- A Redis 7 function library (FUNCTION LOAD, then FCALL). slidegate replaces "slidegate_VERSION"
-- with "slidegate_" and the first 16 hex digits of this file's SHA-1, so two versions side by
-- side (a rolling upgrade) each call their own. Where FUNCTION LOAD is refused, slidegate runs
-- this same file as a script (EVALSHA), with a bare "#!lua" first line and the last line calling
-- the function instead of registering it. Registered without flags, the functions may write, so
-- Redis refuses them while over `maxmemory` (with `noeviction`) rather than let them write.
--
-- Redis runs a function without interleaving other commands, so trimming, counting, deciding
-- and recording cannot race. One call carries one or more requests, decided one after the
-- other, each as it would be alone: a request's descriptors are admitted all together or not at
-- all. The functions touch only keys passed in KEYS (or, by the `_spread` function at the end,
-- in ARGV), and never build a key name. docs/redis.md has the same contract, for operators.
--
-- KEYS, per descriptor of each request in order:
--   key    when               type        content
--   data   sliding_log        string      a compact log: a head, then a slot per entry, oldest
--                                         first (layout at "sliding_log, compact" below)
--          ... rule flag 2    sorted set  score: time in ms; member: "<cum>:<weight>:<time>",
--                                         or "<cum>:<weight>:<time>:<prefix>:<i>" when written
--                                         by a tentative request
--   data   sliding_counter    hash        field "<bucket_ms>:<bucket>" = hits
--   ban    the rule has one   string      the ban's end, ms since the epoch (with a TTL)
--   In a sorted set, weight is the request's hits; cum (20 digits, zero-padded) is the log's
--   running total of hits up to and including the entry, so the hits in a window are the
--   newest cum minus the cum before the window's first entry, whatever the number of entries;
--   no two entries of a log share a cum. <time> repeats the score, so an entry is read without
--   its score. A log found in the other format than its rule asks for is rewritten in that
--   one first, whole (a rolling upgrade between formats).
--
-- ARGV:
--   position                     value
--   1                            number of requests in the call, >= 1
--   2                            now: ms since the epoch, digits only; "" reads Redis TIME
--   per request: shape           4 * n + mode: n descriptors (>= 1) and the mode,
--                                  1 final: admit iff every enforcing descriptor fits and, if
--                                    there are quota descriptors, at least one of them fits;
--                                    record only if admitted
--                                  0 tentative (a request spread over several masters):
--                                    record iff every enforcing descriptor of this call fits;
--                                    the caller may remove the entries again
--                                  2 rejected (already known to be over): record nothing but
--                                    debits, set bans, report
--   per descriptor: hits         0 checks without recording
--   per descriptor: rule         "role:ban_ms:buckets:flags:limit:window_ms[:limit:window_ms...]"
--                                  role 0 enforce, 1 shadow, 2 quota; ban_ms 0: no ban;
--                                  buckets 0: sliding_log, else sliding_counter with that many
--                                  buckets per window; flags: 1 debit (usage already spent),
--                                  2 a sliding_log kept as a sorted set
--   tentative request: prefix    last; unique per request, names its entries for their removal
--
-- Reply: one flat array of integers (and error texts), packed by cmsgpack into one string:
--   part            content
--   the call        now, the time its requests were decided at
--   per request     L, then L integers for its descriptors; or -1 and an error text when a Redis
--                   command of that request failed (a key of another type, an entry slidegate
--                   did not write) or its arguments are bad
--   per descriptor  flags: 1 fits, 2 this request set the ban, 4 recorded, 8 banned;
--                   if banned: ban_remaining_ms, and nothing more;
--                   if recorded: cum of the entry (a compact log: its total after the
--                   entry; 0 for sliding_counter), and in a tentative request the entry's
--                   time (0 for sliding_counter);
--                   per window of the rule: count, reset_ms
--   count     hits in the window after this call
--   reset_ms  fitting descriptor: until the oldest counted hit leaves the window (0 if empty);
--             otherwise: until this request's hits would fit (0 if this window has room, the
--             window's length if the hits exceed its limit)
--   An admitted request with one descriptor of one window is 4, 5, cum, count, reset_ms.
--
-- Windows. sliding_log: an entry with time t is inside a window W at now iff t > now - W.
-- sliding_counter: a window of length W has buckets of floor(W / buckets) ms; every bucket that
-- overlaps (now - W, now] counts in full, so the count is never below the log's; windows with
-- the same bucket length share their buckets. Debit: a call records its hits even when they
-- cross the limit, as long as every window had room for one more hit before it; it fits iff
-- count + max(hits, 1) <= limit in every window, so a check fails once the budget is spent.
--
-- Errors. Bad arguments never make a Lua runtime error. A request's own are checked before it
-- writes anything: bad, it fails (-1, then an error whose code is SLIDEGATE), and so does every
-- request after it (where they start can no longer be told), while those before it stand. A
-- call whose request count is bad, or whose keys or arguments outlast its requests, gets one
-- error reply of code SLIDEGATE.

-- The library functions used for every request as locals: a local is a register, a global a
-- table lookup. Set by the first call: while a library loads, Redis lets its code reach
-- nothing but the registration API. (Loops count with an index: `ipairs` is a function call
-- per step.)
local tonumber, format, find, max, call, byte, char
-- This call's KEYS and ARGV (the function's arguments).
local KEYS, ARGV

local function fail(message)
  return redis.error_reply('SLIDEGATE ' .. message)
end

-- Whole numbers read so far, by their text (false: not a whole number). Turning text into a
-- number costs a strtod, and arguments repeat ("0", "1", the same
-- limits and windows, the same ms): a table lookup is far cheaper. Kept from call to call up
-- to about NUMBERS_KEPT of them (with `texts`), then dropped all at once when a call starts
-- (never during one: `bind` finds here every number `check_request` read).
local NUMBERS_KEPT = 1000
local read, numbers_kept = {}, 0
-- The other way: the text of a whole number, for every number this script passes to
-- redis.call. Redis 7.0 turns a Lua number argument into text with snprintf("%.17g"), a
-- floating-point printf; a table lookup, or a "%d" once per distinct number, is far cheaper.
local texts = {}
local function whole(text)
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
local function ms(v)
  local t = texts[v]
  if t == nil then
    t = format('%d', v)
    texts[v], numbers_kept = t, numbers_kept + 1
  end
  return t
end

-- A running total as a log member starts with it: 20 digits, zero-padded (members of one ms
-- sort by it). Kept for totals below PADDED_KEPT, the common ones (a log's totals start at its
-- first entry's weight), so the printf runs once per distinct total rather than per entry.
local PADDED_KEPT = 1000
local padded = {}
local function padded_cum(cum)
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
local function redis_now()
  if time_now == nil then
    local t = call('TIME')
    time_now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return time_now
end

-- How long every key outlives what it holds: the slack for replicas' clocks, so that a replica
-- whose clock is behind (up to this much) still finds all it would count.
local CLOCK_SLACK_MS = 1000

-- Rules read so far, by their text (false: not a rule), kept from call to call (a process's
-- rules repeat) up to RULES_KEPT of them, then dropped all at once. A rule, once made, is only
-- read: role, ban_ms, buckets, debit (boolean), m (windows), longest (window), ttl (the
-- data key's, as text), one_log (one sliding_log window and no ban), and per window w, in its
-- array part: limit at [3w - 2], length in ms at [3w - 1], bucket length at [3w]
-- (sliding_counter; 0 for sliding_log). (One table per rule: each table costs an allocation,
-- and this runs for every call.)
local RULES_KEPT = 1000
local rules, rules_kept = {}, 0
local function read_rule(text)
  local rule = rules[text]
  if rule ~= nil then
    return rule or nil
  end
  rule = false
  local role, ban_ms, buckets, debit, at
  if type(text) == 'string' then
    role, ban_ms, buckets, debit, at = string.match(text, '^(%d+):(%d+):(%d+):(%d+)()')
  end
  if role ~= nil then
    local flags = whole(debit)
    rule = { role = whole(role), ban_ms = whole(ban_ms), buckets = whole(buckets),
             debit = flags % 2 == 1, sorted = flags >= 2, m = 0, longest = 0, ttl = '' }
    local ok = rule.role <= 2 and flags <= 3
    buckets = rule.buckets
    local last = #text
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
    if ok and rule.m > 0 and at == last + 1 then
      -- Keep the data key as long as the longest window (plus a bucket), with the slack for
      -- replicas' clocks.
      local ttl = rule.longest + CLOCK_SLACK_MS
      if buckets > 0 then
        ttl = ttl + math.ceil(rule.longest / buckets)
      end
      -- The common kind, which `decide_logs` and `decide_single` decide: one sliding_log
      -- window, no ban (one field to read where three were). Their keys' expiry is set once
      -- per period, a quarter of the window, and lasts a period longer (see `expiry_due`).
      local one = buckets == 0 and rule.ban_ms == 0 and rule.m == 1
      rule.one_log = one and rule.sorted
      rule.one_compact = one and not rule.sorted
      -- A compact log's slots: 4 bytes hold offsets up to 2^31 ms, room for twice a window
      -- up to 2^30 ms (12.4 days); longer windows take 6. Its expiry is set on every write.
      rule.width = rule.longest < 1073741824 and 4 or 6
      rule.compact_ttl = ms(rule.longest + CLOCK_SLACK_MS)
      if one then
        rule.period = max(math.floor(rule.longest / 4), 1)
        ttl = ttl + rule.period
        -- The common path sets a compact log's expiry once a period too (`plain_write`).
        rule.compact_ttl = ms(rule.longest + CLOCK_SLACK_MS + rule.period)
      end
      rule.ttl = ms(ttl)
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

-- Checks one request's arguments, from ARGV[a] and KEYS[k + 1] on: where the next request's
-- start, or nil and why not. The general path checks a request here before it writes anything;
-- the common paths check what they read themselves and leave a bad request to the general
-- path, which tells why.
local function check_request(r, a, k)
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
  elseif mode > 2 then
    problem = 'mode must be 0, 1 or 2'
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

-- The call's time (and as text), and the request being decided: its member prefix, mode and
-- number of descriptors.
local now, now_text, prefix, mode, n

-- The text of a log entry's time, its score: the call's time as the caller sent it (see
-- `decide_call`), else a whole number as text.
local function score(t)
  if t == now then
    return now_text
  end
  return ms(t)
end

-- The member of the entry descriptor i of the request being decided records: running total
-- cum, hits, at time t (layout in the header). (At most one printf, for the padded total; the
-- rest joined from text: each directive of a format is a printf of its own.)
local function member_of(cum, hits, t, i)
  if mode == 0 then
    return padded_cum(cum) .. ':' .. ms(hits) .. ':' .. score(t) .. ':' .. prefix .. ':' .. ms(i)
  end
  return padded_cum(cum) .. ':' .. ms(hits) .. ':' .. score(t)
end

-- Per descriptor position i, the decision state of the request being decided: made once and
-- reset for each request (requests are decided one after the other), so deciding a request
-- allocates little but its reply. Fields: rule, hits, key (data), ban (key or false),
-- fits, records, banned (ms left), ban_set, cum (of the entry it recorded), buckets (read,
-- sliding_counter), st (the state of the data key, kept by the request's first descriptor on
-- that key and shared by the others: its newest entry, head_cum and head_time, once read
-- (head_read) and moved on by what the request records; hits pending from earlier
-- descriptors; hits recorded; new_before and new_time, the cum before the first entry the
-- request recorded and its time), and per window w, in its array part: the count at [3w - 2],
-- and the window's first entry before this request at [3w - 1] (the cum before it, or false)
-- and [3w] (its time).
local states = {}

-- Sets the mode and member prefix of the request whose arguments start at ARGV[a], and
-- answers where the next request's start, or nil when they are not valid (the general path
-- checks them in `check_request` first, with reasons; the common paths leave a request with
-- bad ones to it).
local function begin_request(a)
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

-- Reads the request from ARGV[a] and KEYS[k + 1] on (checked by `check_request`) into `states`.
-- Its numbers are in `read`: `check_request` read each of these texts in this call. Only what a
-- later step reads before writing is reset here (every step runs once per request: on a
-- deployment's hot path each table write is a measurable share of the call).
local function bind(a, k)
  begin_request(a)
  local shape = read[ARGV[a]]
  n = (shape - shape % 4) / 4
  local text
  a = a + 1
  for i = 1, n do
    local d = states[i]
    if d == nil then
      d = { rule = false, hits = 0, key = false, ban = false, fits = false, records = false,
            banned = 0, ban_set = 0, cum = 0, buckets = false, st = false, size = 0, head_read = false,
            head_cum = 0, head_time = 0, pending = 0, recorded = 0, new_before = false,
            new_time = 0, trimmed = false, lg = {} }
      states[i] = d
    end
    -- Read again where it is no longer kept: the rules kept may have been dropped since the
    -- check.
    text = ARGV[a + 1]
    local rule = rules[text] or read_rule(text)
    d.rule, d.hits = rule, read[ARGV[a]]
    -- What the descriptor must fit: its hits, or 1 for a debit rule's check.
    d.size = (rule.debit and d.hits == 0) and 1 or d.hits
    d.key = KEYS[k + 1]
    if rule.ban_ms > 0 then
      d.ban = KEYS[k + 2]
      k = k + 2
    else
      d.ban = false
      k = k + 1
    end
    -- (buckets is written by a sliding_counter's step 1 before anything reads it.)
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
    -- Counts are set by step 1 for every window; a first entry's time is read only with it.
    for w = 1, rule.m do
      d[3 * w - 1] = false
    end
    a = a + 2
  end
end

-- === sliding_log: a log of weighted entries with running totals ===

-- cum and weight of a member, or nil for a member slidegate did not write. (Numbers from
-- text by arithmetic, `text + 0`, which reads the text once, where `tonumber` reads it twice:
-- the captures are digits, so the arithmetic cannot fail.)
local MEMBER = '^(%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d):(%d+):'
local function parse_member(member)
  local cum, weight = string.match(member, MEMBER)
  if cum == nil then
    return nil
  end
  return cum + 0, weight + 0
end

-- The texts of cum, weight and time of a member ("<cum>:<weight>:<time>", then a tentative
-- request's ":<prefix>:<i>"), or nil for a member slidegate did not write. Texts, not
-- numbers: each number read from text is a strtod, and the newest entry's weight is not needed.
-- (One capture per field, `%d+` rather than 20 `%d`s: each item of a pattern costs the matcher
-- a step of its own.)
local TIMED = '^(%d+):(%d+):(%d+)()'
local function timed_texts(member)
  local cum, weight, time, after = string.match(member, TIMED)
  if cum == nil or #cum ~= 20 or (after <= #member and string.byte(member, after) ~= 58) then
    return nil
  end
  return cum, weight, time
end

-- A member slidegate did not write (something else wrote into its key space) fails the
-- request that reads it, with a message that says so, rather than being counted wrongly.
local function foreign(log)
  error({ err = 'SLIDEGATE log ' .. log .. ' holds an entry slidegate did not write' })
end

-- cum, weight and time of the entry `member` of `log`.
local function log_entry(log, member)
  local cum, weight, time = timed_texts(member)
  if cum == nil then
    foreign(log)
  end
  return cum + 0, weight + 0, time + 0
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

-- For a log descriptor that does not fit `size` hits with `count` in a window of `limit` and
-- `length` ms: the hits that must leave the window first, or nil and the reset when no entry
-- decides it (0: the window has room; its length: the hits exceed its limit).
local function hits_to_leave(limit, length, count, size)
  local need = count + size - limit
  if need <= 0 then
    return nil, 0
  end
  if size > limit then
    return nil, length
  end
  return need
end

-- === sliding_log, compact: one string per log ===
--
-- The log as one string (docs/redis.md#the-compact-log): a head, then fixed-width slots,
-- oldest entry first. Head: one byte, the slot width (4 or 6 bytes) plus 16 once the log may
-- hold a weighted entry; 6 bytes, the base (ms since the epoch); and in a weighted log 6 more,
-- the total of the entries' weights (in the other, the number of slots). An entry is its time
-- less the base in one slot; an entry that weighs more than 1 has the slot's top bit set and
-- its weight in the next slot (whose top bit is clear: so a slot whose previous slot has its
-- top bit set is a weight). Every number is big-endian. A log is written whole (one SET, which
-- keeps a string exactly its length where APPEND and SETRANGE leave room to grow) when a call
-- trims or records, and its expiry with it.
--
-- The functions below (`open_log` to `write_log`) read a log into a table and serve every
-- path; the common one (`decide_one_compact`, `decide_compacts`) reads a log of unweighted
-- entries in place (`plain_log` to `plain_reset`).
-- A log of unweighted entries has a head of PLAIN bytes, a weighted one of HEAD.
local HEAD, PLAIN = 13, 7
-- The top bit of a slot, by width; a weight is below it.
local TOP = { [4] = 2147483648, [6] = 140737488355328 }

-- The value of the W-byte slot at byte p of s.
local function slot_at(s, p, W)
  if W == 4 then
    local a, b, c, d = byte(s, p, p + 3)
    return ((a * 256 + b) * 256 + c) * 256 + d
  end
  local a, b, c, d, e, f = byte(s, p, p + 5)
  return ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
end

-- The value of slot i (from 0) of a log read into a table (see below). (`slot_at` in line: this
-- runs for every slot read.)
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

-- A whole number below 2^48 as W (4 or 6) big-endian bytes. (Arithmetic, not math.floor:
-- each library call costs more than the operations it saves.)
local function bytes(v, W)
  local d = v % 256
  v = (v - d) / 256
  local c = v % 256
  v = (v - c) / 256
  local b = v % 256
  v = (v - b) / 256
  if W == 4 then
    return char(v, b, c, d)
  end
  local a = v % 256
  v = (v - a) / 256
  local z = v % 256
  return char((v - z) / 256, z, a, b, c, d)
end

-- The state of a compact log while a request decides on it, in a table `lg`: s, its text as
-- read, with what this request appended (false: no log); o, the length of its head; W, the
-- slot width; base and total (as in the head, total less what the trim dropped and plus what
-- was appended); weighted; f, the first slot kept (the trim drops slots before it); n, the
-- number of slots in s; newest, the newest entry's time (0: none); changed, whether it must be
-- written; moved, whether this request moved its base (and so its slots).

-- Reads the compact log `key` into lg. A sorted set there is a log in the former format
-- (written by a slidegate before this format, or by one asked for it): it is rewritten in this
-- one first, whole, so that nothing it counted is lost.
local sorted_to_compact
local function open_log(lg, key, rule)
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
  lg.base = ((((b1 * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6
  if weighted then
    local t1, t2, t3, t4, t5, t6 = byte(s, PLAIN + 1, HEAD)
    lg.total = ((((t1 * 256 + t2) * 256 + t3) * 256 + t4) * 256 + t5) * 256 + t6
  end
  if n > 0 then
    local last = n - 1
    if n > 1 and slot(lg, n - 2) >= TOP[W] then
      last = n - 2
    end
    lg.newest = lg.base + slot(lg, last) % TOP[W]
  end
end

-- The entry whose first slot is i: its time, its weight and the slot after it.
local function entry_at(lg, i)
  local v, top = slot(lg, i), TOP[lg.W]
  if v >= top then
    return lg.base + v - top, slot(lg, i + 1), i + 2
  end
  return lg.base + v, 1, i + 1
end

-- The first slot of the first entry kept whose time is after `bound` (lg.n: none), by binary
-- search: a slot that is a weight stands for the entry before it.
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

-- The weight of the entries from slot i to slot j (each the first slot of an entry, or j =
-- lg.n).
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
local function trim_log(lg, bound)
  if lg.n > lg.f and entry_at(lg, lg.f) <= bound then
    local first = first_after(lg, bound)
    if first > lg.f then
      lg.total = lg.total - weight_of(lg, lg.f, first)
      lg.f, lg.changed = first, true
    end
  end
end

-- The hits after `bound`, and the first slot of the first entry after it and its time (nil:
-- none).
local function count_after(lg, bound)
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

-- The reset of a compact log's window of `limit` and `length` ms for a descriptor that must
-- fit `size` hits, from its count after the call and the window's first entry (its slot and
-- time, nil: none), as `window_reset` for the former format.
local function compact_reset(lg, limit, length, fits, count, size, first, time)
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
    -- One slot an entry: the entry that takes the window's count down by `need` is need - 1
    -- entries past its first.
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

-- Re-encodes the entries kept with width W from base `base`: when an entry would lie further
-- from the base than a slot holds (the base is kept until the log empties: a log busy for
-- weeks), or a rule with a longer window writes a log of one with a shorter.
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

-- Appends an entry of `hits` at time `stamp` (no earlier than the newest); answers its slot.
local function append_entry(lg, rule, hits, stamp)
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

-- The log's text as it is stored: its head, then the slots kept.
local function log_text(lg)
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
-- expiry, the longest window and the slack for replicas' clocks past now (every entry leaves
-- every window before it).
local function write_log(lg, key, rule)
  if not lg.changed then
    return
  end
  if lg.n == lg.f then
    call('DEL', key)
    return
  end
  local W = lg.W
  call('SET', key, log_text(lg), 'PX', rule.compact_ttl)
end

-- === The common path's compact log: unweighted entries, read in place ===

-- Reads the log `key` of a one-window rule of `length` ms if it holds unweighted entries only
-- (or is absent), and finds its trim: answers its text (false: none), slot width, base, number
-- of slots n, the first slot inside the window f (n: none), that slot's time, and the newest
-- entry's time (0: none). nil for any other log: a weighted one, a sorted set, a key of another
-- type, a text slidegate did not write (the general path reads it, and tells why), or one
-- whose next entry would lie further from its base than a slot holds (the general path moves
-- the base).
local function plain_log(key, rule, length)
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
-- window, a period (a quarter window) and 1 s, is set as `expiry_due` has it for a sorted set:
-- when the entry recorded is the first of its period (time cut into periods) or the log is
-- new, so that it outlasts every entry of that period by the window and 1 s, and a busy log
-- sets it about once a period; other writes keep it (KEEPTTL), since it outlasts the newest
-- entry kept.
local function plain_write(key, rule, s, W, base, n, f, stamp, newest)
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

-- The reset of a log read by `plain_log` (as `compact_reset`), from its window's first slot f
-- and that slot's time, the entry the request recorded at `stamp` (false: none) and the count
-- after the request.
local function plain_reset(s, W, base, n, f, first, stamp, limit, length, fits, count, size)
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

-- The time to live to give a log rewritten in another format: the one it had.
local function kept_ttl(key, fallback)
  local pttl = call('PTTL', key)
  return pttl > 0 and ms(pttl) or fallback
end

-- Rewrites the sorted-set log `key` as a compact one (its entries' times and weights, in order)
-- and answers its text, or false when it held nothing.
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

-- Rewrites the compact log `key` as a sorted set (`rule`: the one that reads it now), for a
-- slidegate asked for that format that finds a compact log: members "<cum>:<weight>:<time>",
-- cum counted from the first entry kept.
local function compact_to_sorted(key, rule)
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

-- === sliding_counter: buckets in a hash ===

-- The buckets stored in a hash, as { size, index, hits, field }.
local function read_buckets(key)
  local raw = call('HGETALL', key)
  local found = {}
  for f = 1, #raw, 2 do
    local size, index = string.match(raw[f], '^(%d+):(%d+)$')
    if size then
      found[#found + 1] = { size = tonumber(size), index = tonumber(index), hits = tonumber(raw[f + 1]) or 0,
                            field = raw[f] }
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

local function counted_hits(d, w)
  local c, list = 0, buckets_in_window(d, w)
  for bi = 1, #list do
    c = c + list[bi].hits
  end
  return c
end

local function drop_stale_buckets(d)
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

-- The reset of window w of a sliding_counter descriptor, from its count after the call.
local function counter_reset(d, w, count)
  local length, limit, size_w = d.rule[3 * w - 1], d.rule[3 * w - 2], d.rule[3 * w]
  local wanted = 1
  if not d.fits then
    local size = d.size
    wanted = count + size - limit
    if wanted <= 0 then
      return 0
    end
    if size > limit then
      return length
    end
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

-- === sliding_log, continued ===

-- The log's newest entry: its cum and time (0, 0 when empty). A compact log there (written by
-- a slidegate not asked for sorted sets) is rewritten as a sorted set first.
local function last_entry(log, rule)
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
  -- (`timed_texts` in line: this runs for the newest entry of every log a call reads, where
  -- a function call is a measurable share of the work.)
  local cum, _, time, after = string.match(last, TIMED)
  if cum == nil or #cum ~= 20 or (after <= #last and string.byte(last, after) ~= 58) then
    foreign(log)
  end
  return cum + 0, time + 0
end

-- The reset of a sliding_log window of `limit` and `length` ms for a descriptor that must fit
-- `size` hits, from its count after the call and the window's first entry (the running total
-- before it, or false, and its time).
local function window_reset(key, limit, length, fits, count, size, before, time)
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

-- The reset of window w of a sliding_log descriptor, from its count after the call.
local function log_reset(d, w, count)
  local before, time = d[3 * w - 1], d[3 * w]
  if not before then
    -- The window held nothing before this request: its first entry is the first this request
    -- recorded in the log, if any.
    before, time = d.st.new_before, d.st.new_time
  end
  return window_reset(d.key, d.rule[3 * w - 2], d.rule[3 * w - 1], d.fits, count, d.size, before, time)
end

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
  d.records = d.hits > 0 and (ok or (rule.debit and has_room))
  if not ok and rule.ban_ms > 0 then
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

-- 3. Records descriptor d (position i): sliding_log, one weighted entry, stamped no earlier
--    than the log's newest entry (so totals grow with time even if clocks step back: stricter,
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
end

-- 5. Adds descriptor d's part of the reply from reply[r + 1] on (layout in the header): its
--    flags, its ban or the entry it recorded, and each window's count after the request (with
--    every hit it recorded on the same key) and its reset. Returns the new end.
local function report(d, reply, r)
  local rule = d.rule
  local banned = d.banned > 0
  reply[r + 1] = (d.fits and 1 or 0) + (d.ban_set == 1 and 2 or 0) + (d.records and 4 or 0)
    + (banned and 8 or 0)
  r = r + 1
  if banned then
    reply[r + 1] = d.banned
    return r + 1
  end
  if d.records then
    reply[r + 1] = d.cum
    r = r + 1
    if mode == 0 then
      -- The entry's time, which names it with cum (a sliding_counter records no entry).
      reply[r + 1] = rule.buckets == 0 and d.stamp or 0
      r = r + 1
    end
  end
  local added = d.st.recorded
  if rule.buckets > 0 and added > 0 then
    d.buckets = read_buckets(d.key)
  end
  for w = 1, rule.m do
    local c, reset
    if rule.buckets > 0 then
      c = counted_hits(d, w)
      reset = counter_reset(d, w, c)
    elseif not rule.sorted then
      c = d[3 * w - 2] + added
      local first, time = d[3 * w - 1], d[3 * w]
      if time == nil and d.st.new_before then
        -- The window held nothing before this request: its first entry is the first this
        -- request recorded in the log.
        first, time = d.st.new_first, d.st.new_time
      end
      reset = compact_reset(d.st.lg, rule[3 * w - 2], rule[3 * w - 1], d.fits, c, d.size, first,
        time)
    else
      c = d[3 * w - 2] + added
      reset = log_reset(d, w, c)
    end
    reply[r + 1] = c
    reply[r + 2] = reset
    r = r + 2
  end
  return r
end

-- Whether the request being decided is admitted, in its mode: final, every enforcing
-- descriptor fits and, if there are quota descriptors, at least one of them; tentative, every
-- enforcing descriptor fits (the caller combines the slots' quotas); rejected, never.
local function admits(enforced_fit, quota_seen, quota_fit)
  if mode == 1 then
    return enforced_fit and (quota_fit or not quota_seen)
  end
  return mode == 0 and enforced_fit
end

-- The call's reply, flat (layout in the header), kept from call to call rather than made per
-- call (it would grow step by step): o is the index of the last value written. A call writes
-- its values from the first on, one after the other, so what is past o is what a longer call
-- (or a request that failed halfway) left, up to the first nil; the call clears it before
-- packing, as cmsgpack packs a table as an array only when nothing follows its last value. A
-- call whose reply grew past OUT_KEPT values leaves a fresh table to the next.
local OUT_KEPT = 4096
local out, o = {}, 0
-- The number of the request being decided and where its arguments start, and where the next
-- request's arguments and keys start: set by the request's path once its arguments are
-- checked, before it writes anything (so that when a Redis command fails it, the next one can
-- be found).
local current, current_a, next_a, next_k

-- A log descriptor's part of the reply, from out[r + 1] on (layout in the header): flags, the
-- running total and (in a tentative request) time of the entry it recorded, if it did, then
-- its window's count and reset. Answers the index of its last value.
local function log_answer(r, flags, cum, stamp, count, reset)
  out[r + 1] = flags
  r = r + 1
  if flags >= 4 then
    out[r + 1] = cum
    r = r + 1
    if mode == 0 then
      out[r + 1] = stamp
      r = r + 1
    end
  end
  out[r + 1], out[r + 2] = count, reset
  return r + 2
end

-- Decides the request whose arguments start at ARGV[a] and keys after KEYS[k], of any kind:
-- writes its values from out[o + 2] on and answers the index of its last, or nil and why its
-- arguments are bad.
local function decide(a, k)
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
      write_log(d.lg, d.key, d.rule)
    end
  end

  -- 5. Report.
  local r = o + 1
  for i = 1, n do
    r = report(states[i], out, r)
  end
  return r
end


-- The newest entry of a log with one window of `length` ms, after trimming the log to that
-- window: its running total and time, and the window's first entry (the running total before
-- it, or false, and its time; the log was just trimmed to this window, so it is the log's
-- first) and the count. (`count_and_fit` for one window, with no other descriptor on the log.)
-- A newest entry whose running total is 1 is the log's only entry: it weighs 1 (every entry
-- weighs at least 1, and no more than its total), so the total before it is 0, and totals
-- grow along the log (an entry is recorded after the newest, with the newest's total plus its
-- weight; trims and removals keep the order), so an entry before it would have a total of 0.
-- Then there is nothing to trim and no first entry to read: two of four commands saved on a
-- descriptor's second request in a window, which is most of them where most users call a few
-- times a window. Weighted entries are not read for it: reading an entry's weight beside its
-- total would cost every other request a little.
-- (The general path, `count_and_fit`, does the same.)
local function trim_and_count(key, length, rule)
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

-- Whether the log of a one-window rule (`one_log`) needs its expiry set again, by the common
-- paths: its newest entry, before this request, at head_time (head_cum 0: none), and after it
-- at newest (this request's entry, or now when it recorded nothing). The expiry is set, to the
-- window plus a period plus 1 s, when the newest entry is the first of its period (time cut
-- into periods of a quarter window), so it outlasts every entry of that period by the window
-- plus 1 s (the slack for replicas' clocks), and a request that finds the newest entry in a
-- period before its own sets it again, whether or not it records: a log under constant
-- rejection does not expire and reopen. Setting it on every request would cost a command each;
-- this way a busy log sets it about once a period. Logs of the general path, whichever their
-- rule, still set it on every request.
local function expiry_due(rule, head_cum, head_time, newest, recorded)
  if head_cum == 0 then
    return recorded
  end
  local period = rule.period
  return newest - newest % period ~= head_time - head_time % period
end

-- Per descriptor position, the state of a request decided by `decide_logs`, in arrays (an
-- array slot is cheaper to reach than a named field): its rule, hits, what it must fit, its
-- key, the log's newest entry (running total and time), the window's first entry before the
-- request (the running total before it, or false, and its time), the count, whether it fits,
-- whether it records, and the running total and time of the entry it recorded.
local s_rule, s_hits, s_size, s_key, s_head, s_head_time = {}, {}, {}, {}, {}, {}
local s_before, s_time, s_count, s_fits, s_records, s_cum, s_stamp = {}, {}, {}, {}, {}, {}, {}

-- Reads the n descriptors of the request whose arguments start at ARGV[a] and keys after
-- KEYS[k] into the `s_` arrays, and its prefix and mode: where the next request's arguments
-- start if the request is of the kind `decide_logs` decides (with `compact`, the kind
-- `decide_compacts` decides), with valid arguments, else nil.
local function read_logs(a, k, n, compact)
  for i = 1, n do
    local text = ARGV[a + 2 * i]
    local rule = rules[text] or read_rule(text)
    local key = KEYS[k + i]
    if not (rule and key and (compact and rule.one_compact or rule.one_log)) then
      return false
    end
    for j = 1, i - 1 do
      if s_key[j] == key then
        return false
      end
    end
    text = ARGV[a + 2 * i - 1]
    local hits = read[text]
    if hits == nil then
      hits = whole(text)
    end
    if not hits or (compact and hits > 1) then
      return false
    end
    s_rule[i], s_hits[i], s_key[i] = rule, hits, key
    s_size[i] = (rule.debit and hits == 0) and 1 or hits
  end
  return begin_request(a)
end

-- 2. For `decide_logs` and `decide_compacts`: from each descriptor's count, whether it fits
--    and whether it records, and whether the request is admitted (as `decide`).
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

-- The state of a request decided by `decide_compacts`, per descriptor: what `plain_log` read.
local s_text, s_width, s_base, s_slots, s_first, s_first_time, s_newest =
  {}, {}, {}, {}, {}, {}, {}

-- `decide_logs` for compact logs: every descriptor on a one-window rule without a ban, each on
-- a log of its own holding unweighted entries, with one hit or none. Every log is read before
-- anything is written; answers nil, having written nothing, for another kind.
local function decide_compacts(a, k, n)
  local after = read_logs(a, k, n, true)
  if not after then
    return nil
  end
  -- 1. Per descriptor: the log, its trim, the count, and whether it fits.
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
    else
      s_records[i] = false
    end
    plain_write(s_key[i], rule, s, W, base, slots, f, stamp, s_newest[i])
    local count = s_count[i]
    local reset = plain_reset(s, W, base, slots, f, s_first_time[i], stamp, rule[1], rule[2],
      fits, count, s_size[i])
    r = log_answer(r, (fits and 1 or 0) + (stamp and 4 or 0), count, stamp, count, reset)
  end
  return r
end

-- The request whose arguments start at ARGV[a] and keys after KEYS[k] when it is the common
-- kind: every descriptor on a sorted-set sliding_log of one window (compact logs:
-- `decide_compacts`), without a ban, each on a key of its own. The same steps as `decide` in the same order, for this case only: `decide`'s state
-- tables, its loops over windows and its sharing of a key between descriptors cost the
-- interpreter more than the Redis commands do. Writes as `decide` does; answers nil, having written
-- nothing, for another kind or bad arguments (`decide` tells why).
local function decide_logs(a, k, n)
  local first = rules[ARGV[a + 2]]
  if first and first.one_compact then
    return decide_compacts(a, k, n)
  end
  local after = read_logs(a, k, n)
  if not after then
    return nil
  end
  next_a, next_k = after, k + n
  -- 1. Per descriptor: the newest entry, the trim, the window's first entry (the log was just
  --    trimmed to this window, so it is the log's first) and the count.
  for i = 1, n do
    local rule = s_rule[i]
    local head_cum, head_time, before, time, count = trim_and_count(s_key[i], rule[2], rule)
    s_head[i], s_head_time[i], s_before[i], s_time[i], s_count[i] =
      head_cum, head_time, before, time, count
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
  -- 5. Report: per descriptor its flags, the entry it recorded, its count and its reset (as
  --    `log_reset`).
  local r = o + 1
  for i = 1, n do
    local rule, fits, count, before = s_rule[i], s_fits[i], s_count[i], s_before[i]
    local limit, length = rule[1], rule[2]
    local reset = window_reset(s_key[i], limit, length, fits, count, s_size[i], before, s_time[i])
    r = log_answer(r, (fits and 1 or 0) + (s_records[i] and 4 or 0), s_cum[i], s_stamp[i], count,
      reset)
  end
  return r
end

-- A request of one descriptor on a compact log of one window without a ban, the most common
-- request: `decide`'s steps for this case only, in straight-line code (see `decide_logs`), on
-- the log read into a table.
local single = {}
local function decide_one_logged(key, rule, hits)
  local limit, length, debit = rule[1], rule[2], rule.debit
  local size = (debit and hits == 0) and 1 or hits
  -- 1. Read the log, trim it to the window: what is left is the count.
  local lg = single
  open_log(lg, key, rule)
  trim_log(lg, now - length)
  local count = lg.total
  -- 2. Decide (as in `decide_single`: alone, the role changes nothing).
  local fits = count + size <= limit
  local flags, cum, newest = fits and 1 or 0, 0, now
  -- 3. Record, 4. write the log with its expiry if the request trimmed or recorded.
  if hits > 0 and (fits or (debit and count < limit)) and (mode ~= 2 or debit) then
    newest = max(now, lg.newest)
    append_entry(lg, rule, hits, newest)
    cum, count, flags = lg.total, count + hits, flags + 4
  end
  write_log(lg, key, rule)
  -- 5. The reset and the reply.
  -- (The log was trimmed to the window: its first entry kept is the window's.)
  local first = lg.f < lg.n and entry_at(lg, lg.f) or nil
  local reset = compact_reset(lg, limit, length, fits, count, size, lg.f, first)
  return log_answer(o + 1, flags, cum, newest, count, reset)
end

-- The same, for the most common request of all: one hit or none, on a log of unweighted
-- entries, read in place (no table of its state); any other goes by `decide_one_logged`.
local function decide_one_compact(key, rule, hits)
  local s, W, base, n, f, first, newest
  if hits <= 1 then
    s, W, base, n, f, first, newest = plain_log(key, rule, rule[2])
  end
  if s == nil then
    return decide_one_logged(key, rule, hits)
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

-- `decide_logs` for a request of one descriptor, the most common request, in straight-line
-- code and locals, cheaper again than `decide_logs` for the same request (docs/performance.md
-- has the counts). Writes as `decide` does; answers
-- nil, having written nothing, for another kind or bad arguments (`decide` tells why).
local function decide_single(a, k)
  local text = ARGV[a + 2]
  local rule = rules[text] or read_rule(text)
  local key = KEYS[k + 1]
  if not (rule and (rule.one_log or rule.one_compact) and key) then
    return nil
  end
  text = ARGV[a + 1]
  local hits = read[text]
  if hits == nil then
    hits = whole(text)
  end
  local after = hits and begin_request(a)
  if not after then
    return nil
  end
  next_a, next_k = after, k + 1
  if rule.one_compact then
    return decide_one_compact(key, rule, hits)
  end
  local limit, length = rule[1], rule[2]
  local debit = rule.debit
  local size = (debit and hits == 0) and 1 or hits
  -- 1. The newest entry, the trim, the window's first entry (the log was just trimmed to
  --    this window, so it is the log's first) and the count.
  local head_cum, head_time, before, time, count = trim_and_count(key, length, rule)
  -- 2. Decide. Alone, a descriptor that records either fits (then every role admits the
  --    request) or is a debit (which records whatever the decision), so the role changes
  --    nothing here: only a request the caller already rejected (mode 2) records no fitting
  --    hits.
  local fits = count + size <= limit
  local records = hits > 0 and (fits or (debit and count < limit))
  -- 3. Record, 4. keep the key.
  local flags, cum, newest = fits and 1 or 0, 0, now
  if records and (mode ~= 2 or debit) then
    cum = head_cum + hits
    newest = max(now, head_time)
    -- (`member_of`, in line.)
    local stamp = score(newest)
    if mode == 0 then
      call('ZADD', key, stamp, padded_cum(cum) .. ':' .. ms(hits) .. ':' .. stamp .. ':' .. prefix .. ':1')
    else
      call('ZADD', key, stamp, padded_cum(cum) .. ':' .. ms(hits) .. ':' .. stamp)
    end
    if not before then
      before, time = head_cum, newest
    end
    count = count + hits
    flags = flags + 4
  end
  -- (`expiry_due`, in line: this path runs for most requests.)
  local period = rule.period
  if (head_cum == 0 and flags >= 4)
      or (head_cum > 0 and newest - newest % period ~= head_time - head_time % period) then
    call('PEXPIRE', key, rule.ttl)
  end
  -- 5. The reset (as `log_reset`) and the reply.
  local reset = window_reset(key, limit, length, fits, count, size, before, time)
  return log_answer(o + 1, flags, cum, newest, count, reset)
end

-- Decides requests `first` to `last` of the call, from next_a and next_k on, each on its own,
-- and writes their replies. Answers false when a request's arguments were bad (it and those
-- after it answered so).
-- Fails requests `from` to `to` of the call: once request `r` before them has `why` (bad
-- arguments, or an error before its arguments were read), where each of them starts in KEYS
-- and ARGV can no longer be told.
local function not_decided(from, to, r, why)
  for later = from, to do
    out[o + 1], out[o + 2] = -1, 'SLIDEGATE request ' .. later .. ': not decided, as request ' .. r .. ' before it ' .. why
    o = o + 2
  end
end

local function decide_from(first, last)
  for r = first, last do
    local a, k = next_a, next_k
    current, current_a = r, a
    -- The common kinds by paths of their own (nil: not of their kind, or bad arguments), the
    -- others by `decide`.
    local shape, e, problem = read[ARGV[a]], nil, nil
    local n = shape and (shape - shape % 4) / 4
    if n == 1 then
      e = decide_single(a, k)
    elseif n and n > 1 then
      e = decide_logs(a, k, n)
    end
    if e == nil then
      e, problem = decide(a, k)
    end
    if e == nil then
      out[o + 1], out[o + 2] = -1, 'SLIDEGATE ' .. problem
      o = o + 2
      not_decided(r + 1, last, r, 'has bad arguments')
      return false
    end
    out[o + 1] = e - o - 1
    o = e
  end
  return true
end

-- One call: decides each request on its own, in order. With `spread` (the `_spread` function
-- below) the keys come first in ARGV, after their number, and the requests' arguments follow
-- them.
local function decide_call(keys, args, spread)
  KEYS, ARGV, time_now = keys, args, nil
  if numbers_kept > NUMBERS_KEPT then
    read, texts, numbers_kept = {}, {}, 0
  end
  if o > OUT_KEPT then
    out = {}
  end
  if call == nil then
    tonumber, format, find, max, call, byte, char =
      _G.tonumber, _G.string.format, _G.string.find, _G.math.max, _G.redis.call, _G.string.byte,
      _G.string.char
  end
  local base = 0
  if spread then
    local m = whole(ARGV[1])
    if m == nil or m < 1 then
      return fail('ARGV[1] (key count) must be at least 1')
    end
    KEYS = {}
    for i = 1, m do
      KEYS[i] = ARGV[i + 1]
    end
    base = m + 1
  end
  local count = whole(ARGV[base + 1])
  if count == nil or count < 1 then
    return fail('ARGV[' .. (base + 1) .. '] (request count) must be at least 1')
  end
  -- The call's time, and its text for the scores of the entries recorded at it: the caller's
  -- digits as they came (an entry's score is the call's time unless the log's newest entry is
  -- later), so that no call pays a printf for it, nor keeps a number it will not see again.
  local text = ARGV[base + 2]
  if text == '' then
    now = redis_now()
    now_text = format('%d', now)
  elseif text ~= nil and find(text, '^%d+$') then
    now, now_text = tonumber(text), text
  else
    now = nil
  end
  if now == nil then
    return fail('ARGV[' .. (base + 2) .. '] (now) must be a whole number of ms or empty')
  end
  -- The reply starts with the call's time.
  out[1], o = now, 1
  -- Each request on its own: a Redis error in one (a key of another type) fails that one only.
  -- One protected call for all of them (a protected call per request costs the interpreter
  -- more than a tenth of a request's work); after an error, the next protected call goes on
  -- from the request after the one that failed.
  next_a, next_k = base + 3, 0
  local first, checked = 1, true
  while true do
    local ok, result = pcall(decide_from, first, count)
    if ok then
      checked = result
      break
    end
    -- What Redis said (a command's error reply), or a Lua error's text, in place of what the
    -- request wrote into the reply.
    out[o + 1], out[o + 2] = -1, type(result) == 'table' and tostring(result.err) or tostring(result)
    o = o + 2
    if next_a == current_a then
      -- It failed before its arguments were read: where the next one starts is unknown.
      not_decided(current + 1, count, current, 'failed')
      checked = false
      break
    end
    if current == count then
      break
    end
    first = current + 1
  end
  if checked and (ARGV[next_a] ~= nil or #KEYS ~= next_k) then
    return fail('the call\'s ' .. #KEYS .. ' keys and ' .. #ARGV .. ' arguments are not what its requests take (' .. next_k .. ' and ' .. (next_a - 1) .. ')')
  end
  local j = o + 1
  while out[j] ~= nil do
    out[j] = nil
    j = j + 1
  end
  return cmsgpack.pack(out)
end

-- The same for requests whose keys sit in hash slots of one Redis Cluster master:
-- FCALL slidegate_VERSION_spread 0 <key count> <keys...> <request count> <requests...>, sent to
-- that master by name. No key is declared (Redis would refuse declared keys of several slots,
-- and redirect the whole call for one slot that moved), and the flag lets the function reach
-- them while this master serves their slots. A key it no longer serves (a slot moved, or
-- mid-migration and the key already gone) fails the request that reached for it with "Script
-- attempted to access a non local key" before that request recorded a hit (every key of a
-- request is read before any hit is written; what it did before is stale entries trimmed and a
-- ban set on a descriptor over its limit, which deciding it again does alike), and the caller
-- sends that request again (a call per slot where they sit in several) to the master serving
-- its slot now, or, mid-migration, keys declared after ASKING to the master importing it.
redis.register_function{function_name = 'slidegate_VERSION_spread', callback = function(keys, args) return decide_call(keys, args, true) end, flags = { 'allow-cross-slot-keys' }}
redis.register_function('slidegate_VERSION', decide_call)
