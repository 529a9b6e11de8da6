-- START: a worker takes a job it claimed from the queue (queued, or running under a worker
-- whose lease lapsed).
-- KEYS and ARGV: START in shared/scripts.py.
-- -> {'ok', attempt, last_seq, spec, cancel}
--  | {'exhausted', attempt, last_seq, status, last_error}: nothing written; the caller ends
--    the job (settle) with an error event it builds
--  | {'interrupted', attempt, last_seq, status, interruptions}: stops interrupted it more
--    than A.max_interruptions times; nothing written, the caller ends it as for 'exhausted'
--  | {status, done_stream, notify, told}: ended already | {'missing'}
local st = redis.call('HGET', K.job, 'status')
if not st then return {'missing'} end
if st ~= 'queued' and st ~= 'running' then
  local t = redis.call('HMGET', K.job, 'done_stream', 'notify', 'told')
  return {st, t[1] or '', t[2] or '', t[3] or ''}
end
-- Every read that can fail (a damaged key) comes before the first write: a script that
-- errors keeps what it wrote.
local seq = last_seq(K.events)
local h = redis.call('HMGET', K.job, 'attempt', 'handbacks', 'last_error', 'interruptions')
local attempt = tonumber(h[1] or '0')
local interruptions = tonumber(h[4] or '0')
if interruptions > tonumber(A.max_interruptions) then
  return {'interrupted', attempt, seq, st, interruptions}
end
-- a drain's hand-back is not a failure: those attempts are not counted against the job
if attempt - tonumber(h[2] or '0') >= tonumber(A.max_attempts) then
  return {'exhausted', attempt, seq, st, h[3] or ''}
end
attempt = redis.call('HINCRBY', K.job, 'attempt', 1)
redis.call('HSET', K.job, 'status', 'running', 'worker', A.worker)
redis.call('HSETNX', K.job, 'started_at', A.now)
local r = redis.call('HMGET', K.job, 'spec', 'cancel')
return {'ok', attempt, seq, r[1], r[2] or ''}
