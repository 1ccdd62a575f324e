#!lua
-- slidegate's undo: takes back the log entry of a request that was admitted in one hash slot
-- and rejected in another (src/store/redis/decide.rs, `undo`), in either log format
-- lua/slidegate.lua writes. Rare (only requests spread over several masters), so sent by EVAL.
--
-- KEYS: 1 the log.
-- ARGV: 1 the entry's member as a sorted-set log names it ("<cum>:<weight>:<time>:<prefix>:<i>");
--       2 its time, ms since the epoch; 3 its weight (the request's hits).
-- Reply: the hits taken back (0: the entry is gone already, aged out or taken back).
--
-- A compact log (layout in lua/slidegate.lua and docs/redis.md) loses one entry of that time
-- and weight: entries of one time and weight count alike, and all leave the window together,
-- so whichever goes, the counts are as if the request had never been recorded. Hits above a
-- slot's top bit were recorded as several entries of that time, and go the same way.

local key, member, time, weight = KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if time == nil or weight == nil then
  return redis.error_reply('SLIDEGATE undo: time and weight must be numbers')
end
local kind = redis.call('TYPE', key).ok
if kind == 'zset' then
  return redis.call('ZREM', key, member) * weight
elseif kind ~= 'string' then
  return 0
end

local s = redis.call('GET', key)
local W, weighted = string.byte(s, 1) % 16, string.byte(s, 1) >= 16
-- The head: 13 bytes in a weighted log (the total after the base), 7 in another.
local HEAD = weighted and 13 or 7
if #s < HEAD or (W ~= 4 and W ~= 6) or (#s - HEAD) % W ~= 0 then
  return redis.error_reply('SLIDEGATE log ' .. key .. ' holds an entry slidegate did not write')
end
local top = W == 4 and 2147483648 or 140737488355328
local function number(at, width)
  local v = 0
  for i = at, at + width - 1 do
    v = v * 256 + string.byte(s, i)
  end
  return v
end
local base, total = number(2, 6), weighted and number(8, 6) or (#s - HEAD) / W

-- Every entry: its first byte, its length in bytes, its time and weight.
local entries, at = {}, HEAD + 1
while at <= #s do
  local v = number(at, W)
  if v >= top then
    entries[#entries + 1] = { at = at, len = 2 * W, time = base + v - top, weight = number(at + W, W) }
    at = at + 2 * W
  else
    entries[#entries + 1] = { at = at, len = W, time = base + v, weight = 1 }
    at = at + W
  end
end

local gone, left = {}, weight
while left > 0 do
  local want, found = math.min(left, top - 1), nil
  for i = #entries, 1, -1 do
    local e = entries[i]
    if not gone[i] and e.time == time and e.weight == want then
      found = i
      break
    end
  end
  if found == nil then
    break
  end
  gone[found], left = true, left - want
end
local taken = weight - left
if taken == 0 then
  return 0
end
local kept = {}
for i = 1, #entries do
  if not gone[i] then
    kept[#kept + 1] = string.sub(s, entries[i].at, entries[i].at + entries[i].len - 1)
  end
end
if #kept == 0 then
  redis.call('DEL', key)
  return taken
end
local head = string.sub(s, 1, 7)
if weighted then
  total = total - taken
  local bytes = {}
  for i = 6, 1, -1 do
    bytes[i] = total % 256
    total = math.floor(total / 256)
  end
  head = head .. string.char(unpack(bytes))
end
redis.call('SET', key, head .. table.concat(kept), 'KEEPTTL')
return taken
