"""Lua scripts: one per atomic change of stream state.

``unpack`` expands to every value only as the *last* argument of a call, so each script either
ends its argument list with ``unpack`` or builds the whole argument table first.
"""

# KEYS[1] stream; ARGV[1] group; ARGV[2..] entry ids. Acknowledge and delete finished entries.
ACK_DELETE = """
local acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
redis.call('XDEL', KEYS[1], unpack(ARGV, 2))
return acked
"""

# KEYS[1] source stream, KEYS[2] target stream; ARGV[1] group, ARGV[2] entry id, ARGV[3..] field
# value pairs. Hands an entry's outcome on (an event, or a dead letter) and retires the entry in
# one step, so no reader ever sees the outcome published while the entry is still claimable.
PUBLISH_AND_ACK = """
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return id
"""

# KEYS[1] stream; ARGV[1] group, ARGV[2] consumer, ARGV[3..] entry ids. The lease renewal: resets
# the idle time of those entries that this consumer still owns (XCLAIM with min-idle 0 and JUSTID
# does not count a delivery), and returns them. An entry a peer has taken over is left alone:
# plain XCLAIM ignores ownership and would steal it back.
RENEW_OWNED = """
local owned = {}
for i = 3, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if pending[1] and pending[1][2] == ARGV[2] then
    owned[#owned + 1] = ARGV[i]
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
return owned
"""
