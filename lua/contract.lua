#!lua name=slidegate_VERSION
-- slidegate: decides batches of rate-limit requests atomically, on sliding windows.
--
-- A Redis 7 function library (FUNCTION LOAD, then FCALL), joined by build.rs from the parts in
-- lua/, in the order build.rs lists them; this part comes first. slidegate replaces
-- "slidegate_VERSION" with "slidegate_" and the first 16 hex digits of the joined text's SHA-1,
-- so two versions side by side (a rolling upgrade) each call their own. Where FUNCTION LOAD is
-- refused, slidegate runs the same text as a script (EVALSHA) that calls one entry function at
-- its end instead of registering them (src/store/redis/library.rs). Registered without flags,
-- the deciding functions may write, so Redis refuses them while over `maxmemory` (with
-- `noeviction`) rather than let them write.
--
-- Redis runs a function without interleaving other commands, so trimming, counting, deciding
-- and recording cannot race. One call carries one or more requests, decided one after the
-- other, each as it would be alone: a request's descriptors are admitted all together or not at
-- all. The functions touch only keys passed in KEYS (or, by the `_spread` function, in ARGV),
-- and never build a key name. docs/redis.md has the same contract, for operators.
--
-- KEYS, per descriptor of each request in order:
--   key    when               type        content
--   data   sliding_log        string      a compact log: a head, then a slot per entry, oldest
--                                         first (layout in compact_layout.lua)
--          ... rule flag 2    sorted set  score: time in ms; member "<cum>:<weight>:<time>",
--                                         or "<cum>:<weight>:<time>:<prefix>:<i>" when written
--                                         by a tentative request (sorted_log.lua)
--   data   sliding_counter    hash        field "<bucket_ms>:<bucket>" = hits
--   ban    the rule has one   string      the ban's end, ms since the epoch (with a TTL)
--   A log found in the other format than its rule asks for (a rule whose limit moved past
--   1,000, or `--redis-log-format` changed) is rewritten in that one first, whole.
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
--                                  3 usage (only in a quota call, quota.lua): record the hits
--                                    whatever the counts, set no ban, report
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
--   per descriptor  flags: 1 fits, 2 this request set the ban, 4 recorded, 8 banned, 16 the
--                   entry it recorded is later than the call's time (the log's newest was);
--                   if banned: ban_remaining_ms, and nothing more;
--                   if recorded: cum of the entry (a compact log: its total after the
--                   entry; 0 for sliding_counter), then the entry's time in a tentative
--                   request (0 for sliding_counter) and in any other with flag 16 (without
--                   it, the entry's time is the call's);
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
--
-- The other entries: undo (takes back a rejected spread request's entry), inspect (reads a
-- descriptor's keys for the admin API, no write) and reset (deletes descriptors' keys), in
-- undo_inspect_reset.lua; quota (an Envoy's usage reports, and its share of each bucket's limit), in
-- quota.lua. Their contracts are at their functions.
--
-- The parts, in order: contract (this), arguments, sorted_log, compact_layout, compact_log,
-- compact_in_place, convert, counter, request, decide, paths, call, undo_inspect_reset, quota,
-- register. Each part is a do ... end block
-- that assigns the locals declared below which other parts use, and keeps its own helpers
-- local to its block. Lua 5.1 allows 200 active locals in one function, and the library is
-- one: the main chunk holds the 78 declared here (a test counts them), every other local
-- ends with its part's block. (In every function these are upvalues, as any local of an
-- enclosing chunk is.)

-- The Lua library functions used on every request, as locals (a local is a register or an
-- upvalue, a global a table lookup). Set by the first call: while a library loads, Redis lets
-- its code reach nothing but the registration API. (Loops count with an index: `ipairs` is a
-- function call per step.)
local tonumber, format, find, max, call, byte, char
-- This call's KEYS and ARGV (the entry function's arguments), and its time (and as text).
local KEYS, ARGV, now, now_text
-- The request being decided: its member prefix (tentative requests), its mode and number of
-- descriptors; and the highest mode this call's entry takes (3, usage, only from a quota).
local prefix, mode, n, most_mode

-- arguments.lua: numbers, rules and the call's start.
local CLOCK_SLACK_MS, read, rules, fail, foreign, whole, ms, padded_cum, redis_now
local read_rule, check_request, begin_request, begin_call, read_now, hits_to_leave

-- sorted_log.lua: the sorted-set log.
local member_of, score, log_entry, last_entry, trim_and_count, window_reset, expiry_due

-- compact_layout.lua, compact_log.lua and compact_in_place.lua: the compact log.
local HEAD, PLAIN, TOP, slot_at, bytes
local open_log, entry_at, trim_log, count_after, append_entry, remove_entry, log_text
local write_log, compact_reset, plain_log, plain_write, plain_reset

-- convert.lua: each log format rewritten in the other.
local sorted_to_compact, compact_to_sorted

-- counter.lua: the sliding counter.
local drop_stale_buckets, counted_hits, record_counter, counter_reset, read_buckets

-- request.lua: the request being decided, and the call's reply.
local states, out, o, current, current_a, next_a, next_k
local bind, admits, log_answer

-- decide.lua: the general decision.
local decide

-- paths.lua: the straight-line paths, and the table that chooses one.
local PATHS

-- quota.lua: the Rate Limit Quota Service's shares.
local quota_call

-- call.lua and undo_inspect_reset.lua: the entry functions.
local decide_call, undo_call, inspect_call, reset_call
