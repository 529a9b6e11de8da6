-- SETTLE: end a job nobody runs (cancel or expire a queued one, fail one out of attempts),
-- if it is still as the caller saw it: compare-and-set on status, attempt and the log's end.
-- The job stops counting against admission limits (see release in prelude.lua), leaves the
-- deadlines index and joins the compaction index; its end is noted in the recent-jobs stream.
-- KEYS and ARGV: SETTLE in shared/scripts.py (A.compact_at unix seconds).
-- -> 1 settled | 0 the job changed meanwhile (the caller looks again)
local h = redis.call('HMGET', K.job, 'status', 'attempt')
if h[1] ~= A.status or (h[2] or '0') ~= A.attempt then return 0 end
if last_seq(K.events) ~= tonumber(A.last_seq) then return 0 end
append(K.events, K.channel, A.maxlen, REST, REST + 1)
redis.call('HDEL', K.job, 'worker')
set_fields(K.job, REST + 2)
retain(K.job, K.events, A.retention, A.job_id, A.compact_at, K.deadlines, K.compact_due)
release(K.admission_counts, K.admission_jobs, K.admission_checks, K.job)
tell_done(K.job, A.job_id)
local ended = redis.call('HGET', K.job, 'status') or 'ended'
note_recent(K.recent, A.recent_cap, 'job', A.job_id, 'status', ended)
return 1
