-- TOUCH: reset a held queue entry's idle time (a live owner holds it), but only while this
-- worker still holds it: its own in the pending list and, once started, the job still its
-- own at that attempt. A worker back from a stall must not take back entries that moved.
-- KEYS and ARGV: TOUCH in shared/scripts.py (A.attempt '' for a claim not started).
-- -> 1 touched | 0 no longer this worker's (the caller lets go of it)
if A.attempt ~= '' and not owns(K.job, A.worker, A.attempt) then return 0 end
local p = redis.call('XPENDING', K.queue, A.group, A.entry, A.entry, 1)
if #p == 0 or p[1][2] ~= A.worker then return 0 end
redis.call('XCLAIM', K.queue, A.group, A.worker, 0, A.entry, 'JUSTID')
return 1
