-- === register: the library's functions, by name ===
--
-- FCALL slidegate_VERSION <key count> <keys...> <request count> <requests...>: decides (the
-- contract at the top). slidegate_VERSION_spread: the same for requests whose keys sit in hash
-- slots of one Redis Cluster master: FCALL slidegate_VERSION_spread 0 <key count> <keys...>
-- <request count> <requests...>, sent to that master by name. No key is declared (Redis would
-- refuse declared keys of several slots, and redirect the whole call for one slot that moved),
-- and the flag lets the function reach them while this master serves their slots. A key it no
-- longer serves (a slot moved, or mid-migration and the key already gone) fails the request
-- that reached for it with "Script attempted to access a non local key" before that request
-- recorded a hit (every key of a request is read before any hit is written; what it did before
-- is stale entries trimmed and a ban set on a descriptor over its limit, which deciding it
-- again does alike), and the caller sends that request again (a call per slot where they sit
-- in several) to the master serving its slot now, or, mid-migration, keys declared after
-- ASKING to the master importing it. The undo, inspect and reset functions are at their
-- definitions in undo_inspect_reset.lua, the quota function in quota.lua.
-- Each registration is one line: the script form (EVALSHA, where FUNCTION LOAD is refused)
-- turns every one into a comment but its entry's, which becomes a call of it.
redis.register_function('slidegate_VERSION', decide_call)
redis.register_function{function_name = 'slidegate_VERSION_spread', callback = function(keys, args) return decide_call(keys, args, true) end, flags = { 'allow-cross-slot-keys' }}
redis.register_function('slidegate_VERSION_undo', undo_call)
redis.register_function{function_name = 'slidegate_VERSION_inspect', callback = inspect_call, flags = { 'no-writes' }}
redis.register_function{function_name = 'slidegate_VERSION_reset', callback = reset_call, flags = { 'allow-oom' }}
redis.register_function('slidegate_VERSION_quota', quota_call)
