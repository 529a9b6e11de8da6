-- STATE: what SETTLE compares against, and who runs the job.
-- -> {status, attempt, last_seq, worker} | {'missing'}
local h = redis.call('HMGET', K.job, 'status', 'attempt', 'worker')
if not h[1] then return {'missing'} end
return {h[1], tonumber(h[2] or '0'), last_seq(K.events), h[3] or ''}
