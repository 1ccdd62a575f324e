#!lua flags=no-writes
-- slidegate's admin inspect: reads one descriptor's keys as lua/slidegate.lua keeps them, and
-- writes nothing (no trim, no TTL), so an inspection never changes a decision. Declared
-- no-writes, Redis runs it on a replica too and while over `maxmemory`.
--
-- KEYS: 1 the log (a compact string or a sorted set), 2 the counters (hash), 3 the ban
-- (string); any may be absent.
-- ARGV: 1 now, ms since the epoch ("" reads Redis TIME); 2 the longest window, ms.
-- Reply: now; the log: a sorted set's members inside the longest window, oldest first, or a
-- compact log's text whole (slidegate reads it); the counters as field, hits, field, hits...;
-- the ban's end (ms since the epoch) or nil.

local now = tonumber(ARGV[1])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local longest = tonumber(ARGV[2])
if longest == nil then
  return redis.error_reply('SLIDEGATE the longest window is not a number: ' .. tostring(ARGV[2]))
end

-- A key of another type than slidegate writes there is an error, not an empty window.
local function kind(key, wanted)
  local found = redis.call('TYPE', key).ok
  if found ~= 'none' and found ~= wanted then
    return redis.error_reply('SLIDEGATE ' .. key .. ' is a ' .. found .. ', not a ' .. wanted)
  end
  return found == wanted
end

local present, log, counters, ban = nil, {}, {}, false
if redis.call('TYPE', KEYS[1]).ok == 'string' then
  log = redis.call('GET', KEYS[1])
else
  present = kind(KEYS[1], 'zset')
  if type(present) == 'table' then return present end
  if present then
    log = redis.call('ZRANGE', KEYS[1], string.format('(%d', now - longest), '+inf', 'BYSCORE')
  end
end
present = kind(KEYS[2], 'hash')
if type(present) == 'table' then return present end
if present then
  counters = redis.call('HGETALL', KEYS[2])
end
present = kind(KEYS[3], 'string')
if type(present) == 'table' then return present end
if present then
  ban = redis.call('GET', KEYS[3])
end
return { now, log, counters, ban }
