-- TOUCH_QUEUE (Cluster: TOUCH's step in the queue's slot, after OWNS_JOB): as TOUCH.
-- KEYS and ARGV: TOUCH_QUEUE in shared/scripts.py. -> 1 touched | 0 not this worker's
local p = redis.call('XPENDING', K.queue, A.group, A.entry, A.entry, 1)
if #p == 0 or p[1][2] ~= A.worker then return 0 end
redis.call('XCLAIM', K.queue, A.group, A.worker, 0, A.entry, 'JUSTID')
return 1
