-- EMIT: the job's owner writes its events and, when the job ends, its record fields; the
-- job then stops counting against admission limits (KEYS[4..6], see release in prelude.lua),
-- leaves the deadlines index (KEYS[7]) and joins the compaction index (KEYS[9]); its end is
-- noted in the recent-jobs stream (KEYS[8]).
-- KEYS: job, events, channel, admission counts, jobs and checks, deadlines, recent jobs,
-- compaction index.
-- ARGV: worker, attempt, maxlen, retention (0 while running), job id, recent-jobs cap,
-- compact at (unix seconds), n, then n (seq, json) pairs, then record (field, value) pairs.
-- -> {1, cancel}: written (cancel: the reason of a cancel asked for meanwhile, or '')
--  | {0}: fenced, this worker no longer owns the job
--  | {-1, last}: nothing written, the log ends at seq `last` (the caller re-sends from there)
if not owns(KEYS[1], ARGV[1], ARGV[2]) then return {0} end
local to = 8 + 2 * tonumber(ARGV[8])
local last = append(KEYS[2], KEYS[3], ARGV[3], 9, to)
if last then return {-1, last} end
set_fields(KEYS[1], to + 1)
retain(KEYS[1], KEYS[2], ARGV[4], ARGV[5], ARGV[7])
if tonumber(ARGV[4]) > 0 then  -- a retention: the job ended
  release(KEYS[4], KEYS[5], KEYS[6], KEYS[1])
  tell_done(KEYS[1], ARGV[5])
  local ended = redis.call('HGET', KEYS[1], 'status') or 'ended'
  note_recent(KEYS[8], ARGV[6], 'job', ARGV[5], 'status', ended)
end
return {1, redis.call('HGET', KEYS[1], 'cancel') or ''}
