-- EMIT_JOB (Cluster: EMIT's step in the job's slot): as EMIT, the owner's events and, when
-- the job ends, its record fields and retention; what the end does in other slots (indexes,
-- admission, the batch's done stream, the webhook outbox, the queue entry's ack) follows as
-- further steps (shared/transitions.py), after this one made the end true.
-- KEYS and ARGV: EMIT_JOB in shared/scripts.py.
-- -> {1, cancel, status, done_stream, outbox} | {0}: fenced | {-1, last}: nothing written
if not owns(K.job, A.worker, A.attempt) then return {0} end
local to = REST - 1 + 2 * tonumber(A.n)
local last = append(K.events, K.channel, A.maxlen, REST, to)
if last then return {-1, last} end
set_fields(K.job, to + 1)
local cancel = redis.call('HGET', K.job, 'cancel') or ''
if tonumber(A.retention) == 0 then return {1, cancel, '', '', ''} end
redis.call('EXPIRE', K.job, A.retention)
redis.call('EXPIRE', K.events, A.retention)
local h = redis.call('HMGET', K.job, 'status', 'done_stream', 'notify')
return {1, cancel, h[1] or 'ended', h[2] or '', h[3] or ''}
