-- STATE: what SETTLE compares against.
-- -> {status, attempt, last_seq} | {'missing'}
local h = redis.call('HMGET', KEYS[1], 'status', 'attempt')
if not h[1] then return {'missing'} end
return {h[1], tonumber(h[2] or '0'), last_seq(KEYS[2])}
