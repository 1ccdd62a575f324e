-- === call: the decision's entry function (register.lua names it to Redis) ===
do
  -- A call whose reply grew past OUT_KEPT values leaves a fresh table to the next.
  local OUT_KEPT = 4096

  -- Fails requests `from` to `to` of the call: once request `r` before them has `why` (bad
  -- arguments, or an error before its arguments were read), where each of them starts in KEYS
  -- and ARGV can no longer be told.
  local function not_decided(from, to, r, why)
    for later = from, to do
      out[o + 1], out[o + 2] = -1, 'SLIDEGATE request ' .. later .. ': not decided, as request ' .. r .. ' before it ' .. why
      o = o + 2
    end
  end

  -- Decides requests `first` to `last` of the call, from next_a and next_k on, each on its
  -- own, and writes their replies: by the path PATHS names for its shape (its first rule's
  -- `paths`), else (or when the path declines it) by `decide`. Answers false when a request's arguments were bad (it and
  -- those after it answered so).
  local function decide_from(first, last)
    for r = first, last do
      local a, k = next_a, next_k
      current, current_a = r, a
      local shape, e, problem = read[ARGV[a]], nil, nil
      local n = shape and (shape - shape % 4) / 4
      if n and n >= 1 then
        local text = ARGV[a + 2]
        local rule = rules[text] or read_rule(text)
        local paths = rule and rule.paths
        if paths then
          e = paths[n == 1 and 1 or 2](a, k, n, rule)
        end
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

  -- One call: decides each request on its own, in order. With `spread` (the `_spread`
  -- function) the keys come first in ARGV, after their number, and the requests' arguments
  -- follow them.
  decide_call = function(keys, args, spread)
    begin_call(keys, args)
    if o > OUT_KEPT then
      out = {}
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
    if not read_now(ARGV[base + 2]) then
      return fail('ARGV[' .. (base + 2) .. '] (now) must be a whole number of ms or empty')
    end
    -- The reply starts with the call's time.
    out[1], o = now, 1
    -- Each request on its own: a Redis error in one (a key of another type) fails that one
    -- only. One protected call for all of them (a protected call per request costs the
    -- interpreter more than a tenth of a request's work); after an error, the next protected
    -- call goes on from the request after the one that failed.
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
end
