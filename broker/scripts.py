"""Lua scripts: one per atomic change of stream state.

``unpack`` expands to every value only as the *last* argument of a call, so each script either
ends its argument list with ``unpack`` or builds the whole argument table first.

Every script that adds or retires an entry of a work stream also writes or clears the stream's
in-flight index (``<prefix>:inflight:<stream>``: what the entry is about -> entry id), so the index
never disagrees with the stream. A retirement clears the index field only if it still names the
retired entry: a newer entry for the same work (a republish) keeps its place.

Every script that retires an entry also deletes its start evidence (``<prefix>:started:<stream>``,
broker/DECISIONS.md rule 31): an entry that ended did not kill its consumer.
"""

# KEYS[1] stream, KEYS[2] its in-flight index; ARGV[1] index field, ARGV[2..] field value pairs.
PUBLISH = """
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
redis.call('HSET', KEYS[2], ARGV[1], id)
return id
"""

# KEYS[1] the dead-letter stream, KEYS[2] the stream to re-drive to, KEYS[3] its in-flight index,
# KEYS[4..] more in-flight indexes, each followed by its stream, that must not carry the work
# either (a trigger's event); ARGV[1] the dead letter's id, ARGV[2] the index field, ARGV[3..]
# field value pairs. Re-drives a dead letter once: {0, ''} if it is gone (retried or dropped
# already), {-1, held} if an entry for the same work is in flight, else the entry is published
# as PUBLISH does (index written), the dead letter deleted, and {1, new id} returned. On a Redis
# Cluster the dead-letter stream is in a slot of its own: ARGV[1] is then '' (KEYS[1] any key of
# the target's slot) and the caller checks and deletes the dead letter around the call.
REDRIVE_DEAD = """
if ARGV[1] ~= '' and #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then
  return {0, ''}
end
local checks = {KEYS[3], KEYS[2]}
for i = 4, #KEYS, 2 do
  checks[#checks + 1] = KEYS[i]
  checks[#checks + 1] = KEYS[i + 1]
end
for i = 1, #checks, 2 do
  local held = redis.call('HGET', checks[i], ARGV[2])
  if held and #redis.call('XRANGE', checks[i + 1], held, held) > 0 then
    return {-1, held}
  end
end
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
redis.call('HSET', KEYS[3], ARGV[2], id)
if ARGV[1] ~= '' then
  redis.call('XDEL', KEYS[1], ARGV[1])
end
return {1, id}
"""

# KEYS[1] stream, KEYS[2] its in-flight index, KEYS[3] its start evidence; ARGV[1] group;
# ARGV[2..] pairs of entry id and index field ('' when the entry names nothing). Acknowledge and
# delete finished entries.
RETIRE = """
local retired = 0
for i = 2, #ARGV, 2 do
  local id, field = ARGV[i], ARGV[i + 1]
  retired = retired + redis.call('XACK', KEYS[1], ARGV[1], id)
  redis.call('XDEL', KEYS[1], id)
  redis.call('HDEL', KEYS[3], id)
  if field ~= '' and redis.call('HGET', KEYS[2], field) == id then
    redis.call('HDEL', KEYS[2], field)
  end
end
return retired
"""

# KEYS[1] source stream, KEYS[2] its index, KEYS[3] target stream, KEYS[4] its index, KEYS[5] the
# source's start evidence; ARGV[1]
# group, ARGV[2] source entry id, ARGV[3] its index field, ARGV[4] the new entry's index field
# ('' for none, e.g. a dead letter), ARGV[5] the target's approximate MAXLEN ('0': untrimmed; only
# the dead-letter stream, which no group reads, is trimmed), ARGV[6..] field value pairs (a fixed,
# small number: never an entry's own fields, which may be thousands). Hands an entry's outcome on
# (an event, or a dead letter) and retires the entry in one step, so no reader ever sees the
# outcome published while the entry is still claimable.
HAND_ON = """
local id
if ARGV[5] ~= '0' then
  id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', unpack(ARGV, 6))
else
  id = redis.call('XADD', KEYS[3], '*', unpack(ARGV, 6))
end
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[4], ARGV[4], id)
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[5], ARGV[2])
if ARGV[3] ~= '' and redis.call('HGET', KEYS[2], ARGV[3]) == ARGV[2] then
  redis.call('HDEL', KEYS[2], ARGV[3])
end
return id
"""

# KEYS[1] stream, KEYS[2] its start evidence, KEYS[3] its suspect claim; ARGV[1] group, ARGV[2]
# consumer, ARGV[3] n, ARGV[4] the claim this consumer holds ('' for none), ARGV[5] the lease in
# ms, ARGV[6..] entry ids. The lease renewal. For each id: 1 if this consumer owns it (its idle
# time is reset), 0 if another consumer took it over, -1 if it is in no pending list at all
# (retired by a peer, or lost with Redis's data). XCLAIM with min-idle 0 and JUSTID resets the
# idle time without counting a delivery; the first n ids (started here a whole heartbeat ago:
# they did not kill their consumer) lose their start evidence, which ends a suspect's claim. A
# claim still held is kept for another lease. Plain XCLAIM ignores ownership and would steal a
# taken entry back.
RENEW = """
local status, owned, proven = {}, {}, {}
local n = tonumber(ARGV[3])
for i = 6, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if pending[1] == nil then
    status[#status + 1] = -1
  elseif pending[1][2] == ARGV[2] then
    status[#status + 1] = 1
    owned[#owned + 1] = ARGV[i]
    if i - 5 <= n then proven[#proven + 1] = ARGV[i] end
  else
    status[#status + 1] = 0
  end
end
if #owned > 0 then
  local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
  for _, id in ipairs(owned) do
    args[#args + 1] = id
  end
  args[#args + 1] = 'JUSTID'
  redis.call(unpack(args))
end
if #proven > 0 then
  redis.call('HDEL', KEYS[2], unpack(proven))
end
if ARGV[4] ~= '' and redis.call('GET', KEYS[3]) == ARGV[4] then
  redis.call('PEXPIRE', KEYS[3], ARGV[5])
end
return status
"""

# KEYS[1] stream, KEYS[2] its start evidence, KEYS[3] its suspect claim; ARGV[1] group, ARGV[2]
# consumer, ARGV[3] the suspect's entry id, ARGV[4] the consumer it is pending under, ARGV[5] the
# idle time it must have at least (ms), ARGV[6] the lease in ms. Takes the group's one suspect
# claim and the entry with it. The claim is free when there is none, when it names this
# consumer (a process restarted under the name: the suspect it ran died with its predecessor),
# or when the entry it names has no start evidence left (it survived or ended). The entry must
# still be pending under ARGV[4], idle long enough, and still a suspect (start evidence present).
# Returns {1, deliveries counted with this one, XCLAIM reply}, {0, holder} if another consumer
# runs a suspect, or {-1} if the entry moved, was renewed or is no suspect any more.
TAKE_SUSPECT = """
local held = redis.call('GET', KEYS[3])
if held then
  local space = string.find(held, ' ', 1, true)
  local holder = string.sub(held, space + 1)
  if holder ~= ARGV[2] and redis.call('HEXISTS', KEYS[2], string.sub(held, 1, space - 1)) == 1 then
    return {0, holder}
  end
end
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if pending[1] == nil or pending[1][2] ~= ARGV[4] or pending[1][3] < tonumber(ARGV[5]) then
  return {-1}
end
if redis.call('HEXISTS', KEYS[2], ARGV[3]) == 0 then
  return {-1}
end
local counted = redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
redis.call('SET', KEYS[3], ARGV[3] .. ' ' .. ARGV[2], 'PX', ARGV[6])
return {1, counted, redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3])}
"""

# KEYS[1] the start evidence, KEYS[2] the suspect claim of a stream. The consumer running the
# stream's suspect now, or '' when none is (the claim is free, see TAKE_SUSPECT).
SUSPECT_HOLDER = """
local held = redis.call('GET', KEYS[2])
if not held then
  return ''
end
local space = string.find(held, ' ', 1, true)
if redis.call('HEXISTS', KEYS[1], string.sub(held, 1, space - 1)) == 0 then
  return ''
end
return string.sub(held, space + 1)
"""

# KEYS[1] stream, KEYS[2] its in-flight index; ARGV index fields. For each: 1 if the index names
# an entry that the stream still holds, else 0 (the reconciler's question: is this work in flight?).
PRESENT = """
local present = {}
for i = 1, #ARGV do
  local id = redis.call('HGET', KEYS[2], ARGV[i])
  if id and #redis.call('XRANGE', KEYS[1], id, id) > 0 then
    present[i] = 1
  else
    present[i] = 0
  end
end
return present
"""

# KEYS[1] stream; ARGV[1] group, ARGV[2] this consumer, ARGV[3..] pairs of entry id and the
# consumer it was found under. Takes back entries that a name no process is registered under
# claimed from us (a forged XCLAIM), only if that name still holds them: a peer that took one
# over meanwhile keeps it. 1 for each taken back, else 0.
RECLAIM = """
local taken = {}
for i = 3, #ARGV, 2 do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if pending[1] ~= nil and pending[1][2] == ARGV[i + 1] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    taken[#taken + 1] = 1
  else
    taken[#taken + 1] = 0
  end
end
return taken
"""

# KEYS[1] stream; ARGV[1] group, ARGV[2..] consumer names. Deletes each consumer that has no
# pending entry now (DELCONSUMER would discard them otherwise); 1 for each deleted, else 0.
DELETE_IDLE_CONSUMERS = """
local deleted = {}
for i = 2, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[i]) == 0 then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[i])
    deleted[#deleted + 1] = 1
  else
    deleted[#deleted + 1] = 0
  end
end
return deleted
"""
