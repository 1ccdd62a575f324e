#!lua flags=allow-oom
-- slidegate's admin reset: deletes descriptors' logs, counters and bans, all keys of one hash
-- slot in one call, so a decision running beside it sees each descriptor either whole or
-- cleared, never half. allow-oom: deleting frees memory, so it runs while Redis is full.
--
-- KEYS: per descriptor, its log, counters and ban (lua/slidegate.lua's layout).
-- Reply: per descriptor, how many of its three keys existed.

local cleared = {}
for i = 1, #KEYS, 3 do
  cleared[#cleared + 1] = redis.call('DEL', KEYS[i], KEYS[i + 1], KEYS[i + 2])
end
return cleared
