-- === compact_layout: the compact log's bytes ===
--
-- A sliding_log as one string (docs/redis.md#the-compact-log): a head, then fixed-width slots,
-- oldest entry first. Head: one byte, the tag: the slot width (4 or 6 bytes) plus 16 once the
-- log may hold a weighted entry; 6 bytes, the base (ms since the epoch); and in a weighted log
-- 6 more, the total of the entries' weights (in the other, the number of slots is the total).
-- An entry is its time less the base in one slot; an entry that weighs more than 1 has the
-- slot's top bit set and its weight in the next slot (whose top bit is clear: so a slot whose
-- previous slot has its top bit set is a weight). Every number is big-endian.
--
-- This part and the two after it are the only code that reads or writes these bytes: the
-- decision, the undo and (for the admin API, whose reader in Rust is
-- src/store/redis/compact.rs) the inspection all go through them. The head is read where the
-- log is opened (`open_log`, `plain_log`), not by a function of its own: that call cost a
-- decision more than 1,000 of Redis's instructions (docs/performance.md).
do
  -- A log of unweighted entries has a head of PLAIN bytes, a weighted one of HEAD.
  HEAD, PLAIN = 13, 7
  -- The top bit of a slot, by width; a weight is below it.
  TOP = { [4] = 2147483648, [6] = 140737488355328 }

  -- The value of the W-byte slot at byte p of s.
  slot_at = function(s, p, W)
    if W == 4 then
      local a, b, c, d = byte(s, p, p + 3)
      return ((a * 256 + b) * 256 + c) * 256 + d
    end
    local a, b, c, d, e, f = byte(s, p, p + 5)
    return ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
  end

  -- A whole number below 2^48 as W (4 or 6) big-endian bytes. (Arithmetic, not math.floor:
  -- each library call costs more than the operations it saves.)
  bytes = function(v, W)
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
end
