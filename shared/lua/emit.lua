-- EMIT: the job's owner writes its events and, when the job ends, its record fields; the
-- job then stops counting against admission limits (see release in prelude.lua), leaves the
-- deadlines index and joins the compaction index; its end is noted in the recent-jobs stream.
-- With A.entry (not ''), the job's end also acknowledges and deletes its queue entry (in
-- K.queue, group A.group), in the same step: one round trip less per job, and no moment when
-- a job has ended and its entry still looks held.
-- KEYS and ARGV: EMIT in shared/scripts.py (A.retention 0 while running; A.compact_at unix
-- seconds).
-- -> {1, cancel}: written (cancel: the reason of a cancel asked for meanwhile, or '')
--  | {0}: fenced, this worker no longer owns the job
--  | {-1, last}: nothing written, the log ends at seq `last` (the caller re-sends from there)
if not owns(K.job, A.worker, A.attempt) then return {0} end
local to = REST - 1 + 2 * tonumber(A.n)
local last = append(K.events, K.channel, A.maxlen, REST, to)
if last then return {-1, last} end
set_fields(K.job, to + 1)
retain(K.job, K.events, A.retention, A.job_id, A.compact_at, K.deadlines, K.compact_due)
if tonumber(A.retention) > 0 then  -- a retention: the job ended
  release(K.admission_counts, K.admission_jobs, K.admission_checks, K.job)
  tell_done(K.job, A.job_id)
  local ended = redis.call('HGET', K.job, 'status') or 'ended'
  note_recent(K.recent, A.recent_cap, 'job', A.job_id, 'status', ended)
  if A.entry ~= '' then  -- pcall: a queue that lost its group (a Redis restarted without it)
    redis.pcall('XACK', K.queue, A.group, A.entry)
    redis.pcall('XDEL', K.queue, A.entry)
  end
end
return {1, redis.call('HGET', K.job, 'cancel') or ''}
