-- SETTLE: end a job nobody runs (cancel or expire a queued one, fail one out of attempts),
-- if it is still as the caller saw it: compare-and-set on status, attempt and the log's end.
-- The job stops counting against admission limits (KEYS[4..6], see release in prelude.lua),
-- leaves the deadlines index (KEYS[7]) and joins the compaction index (KEYS[9]); its end is
-- noted in the recent-jobs stream (KEYS[8]).
-- KEYS: job, events, channel, admission counts, jobs and checks, deadlines, recent jobs,
-- compaction index.
-- ARGV: status, attempt, last_seq, maxlen, retention, job id, recent-jobs cap, compact at
-- (unix seconds), then one (seq, json) pair, then record (field, value) pairs.
-- -> 1 settled | 0 the job changed meanwhile (the caller looks again)
local h = redis.call('HMGET', KEYS[1], 'status', 'attempt')
if h[1] ~= ARGV[1] or (h[2] or '0') ~= ARGV[2] then return 0 end
if last_seq(KEYS[2]) ~= tonumber(ARGV[3]) then return 0 end
append(KEYS[2], KEYS[3], ARGV[4], 9, 10)
redis.call('HDEL', KEYS[1], 'worker')
set_fields(KEYS[1], 11)
retain(KEYS[1], KEYS[2], ARGV[5], ARGV[6], ARGV[8])
release(KEYS[4], KEYS[5], KEYS[6], KEYS[1])
tell_done(KEYS[1], ARGV[6])
local ended = redis.call('HGET', KEYS[1], 'status') or 'ended'
note_recent(KEYS[8], ARGV[7], 'job', ARGV[6], 'status', ended)
return 1
