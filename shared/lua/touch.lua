-- TOUCH: reset a held queue entry's idle time (a live owner holds it), but only while this
-- worker still holds it: its own in the pending list and, once started, the job still its
-- own at that attempt. A worker back from a stall must not take back entries that moved.
-- KEYS: queue, job. ARGV: group, worker, entry id, attempt ('' for a claim not started).
-- -> 1 touched | 0 no longer this worker's (the caller lets go of it)
if ARGV[4] ~= '' and not owns(KEYS[2], ARGV[2], ARGV[4]) then return 0 end
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 1
