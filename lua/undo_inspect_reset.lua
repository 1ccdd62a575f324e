-- === undo_inspect_reset: the entry functions that read or change a descriptor's keys outside
-- a decision (register.lua names them to Redis) ===
--
-- A part of its own, so that the script form of the decision (where FUNCTION LOAD is refused,
-- and every function of the text is made again on every call) leaves it out.
do
  -- Takes back the entry of a request that was admitted in one hash slot and rejected in
  -- another (src/store/redis/decide.rs, `undo`), in either log format.
  -- KEYS: 1 the log. ARGV: 1 the entry's member as a sorted-set log names it
  -- ("<cum>:<weight>:<time>:<prefix>:<i>"); 2 its time, ms since the epoch; 3 its weight (the
  -- request's hits). Reply: the hits taken back (0: the entry is gone already, aged out or
  -- taken back). A compact log keeps its expiry.
  undo_call = function(keys, args)
    begin_call(keys, args)
    local key, member, time, weight = KEYS[1], ARGV[1], whole(ARGV[2]), whole(ARGV[3])
    if key == nil or member == nil or time == nil or weight == nil then
      return fail('undo: a log key, a member, and a time and a weight (whole numbers) are required')
    end
    local kind = call('TYPE', key).ok
    if kind == 'zset' then
      return call('ZREM', key, member) * weight
    elseif kind ~= 'string' then
      return 0
    end
    -- (No rule: a string is there, so none is read for a new log or a conversion.)
    local lg = {}
    open_log(lg, key, nil)
    local taken = remove_entry(lg, time, weight)
    write_log(lg, key, nil)
    return taken
  end

  -- A key of another type than slidegate writes there is an error, not an empty window.
  local function of_type(key, wanted)
    local found = call('TYPE', key).ok
    if found ~= 'none' and found ~= wanted then
      error({ err = 'SLIDEGATE ' .. key .. ' is a ' .. found .. ', not a ' .. wanted })
    end
    return found == wanted
  end

  -- Reads one descriptor's keys for the admin API and writes nothing (no trim, no TTL), so an
  -- inspection never changes a decision; registered no-writes, so Redis runs it on a replica
  -- too and while over `maxmemory`.
  -- KEYS: 1 the log (a compact string or a sorted set), 2 the counters (hash), 3 the ban
  -- (string); any may be absent. ARGV: 1 now, ms since the epoch ("" reads Redis TIME); 2 the
  -- longest window, ms. Reply: now; the log: a sorted set's members inside the longest window,
  -- oldest first, or a compact log's text whole (read by src/store/redis/compact.rs); the
  -- counters as field, hits, field, hits...; the ban's end (ms since the epoch) or nil.
  inspect_call = function(keys, args)
    begin_call(keys, args)
    local at, longest = whole(ARGV[1]) or redis_now(), whole(ARGV[2])
    if longest == nil then
      return fail('the longest window is not a whole number: ' .. tostring(ARGV[2]))
    end
    local log, counters, ban = {}, {}, false
    if call('TYPE', KEYS[1]).ok == 'string' then
      log = call('GET', KEYS[1])
    elseif of_type(KEYS[1], 'zset') then
      log = call('ZRANGE', KEYS[1], format('(%d', at - longest), '+inf', 'BYSCORE')
    end
    if of_type(KEYS[2], 'hash') then
      counters = call('HGETALL', KEYS[2])
    end
    if of_type(KEYS[3], 'string') then
      ban = call('GET', KEYS[3])
    end
    return { at, log, counters, ban }
  end

  -- Deletes descriptors' logs, counters and bans, all keys of one hash slot in one call, so a
  -- decision running beside it sees each descriptor either whole or cleared, never half;
  -- registered allow-oom, as deleting frees memory.
  -- KEYS: per descriptor, its log, counters and ban. Reply: per descriptor, how many of its
  -- three keys existed.
  reset_call = function(keys, args)
    begin_call(keys, args)
    local cleared = {}
    for i = 1, #KEYS, 3 do
      cleared[#cleared + 1] = call('DEL', KEYS[i], KEYS[i + 1], KEYS[i + 2])
    end
    return cleared
  end
end
