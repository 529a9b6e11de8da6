-- SETTLE_JOB (Cluster: SETTLE's step in the job's slot): end a job nobody runs if it is
-- still as the caller saw it; what the end does in other slots follows (see EMIT_JOB).
-- KEYS and ARGV: SETTLE_JOB in shared/scripts.py.
-- -> {1, status, done_stream, outbox} settled | {0} the job changed meanwhile
local h = redis.call('HMGET', K.job, 'status', 'attempt')
if h[1] ~= A.status or (h[2] or '0') ~= A.attempt then return {0} end
if last_seq(K.events) ~= tonumber(A.last_seq) then return {0} end
append(K.events, K.channel, A.maxlen, REST, REST + 1)
redis.call('HDEL', K.job, 'worker')
set_fields(K.job, REST + 2)
if tonumber(A.retention) > 0 then
  redis.call('EXPIRE', K.job, A.retention)
  redis.call('EXPIRE', K.events, A.retention)
end
local e = redis.call('HMGET', K.job, 'status', 'done_stream', 'notify')
return {1, e[1] or 'ended', e[2] or '', e[3] or ''}
