-- SUBMIT: a new job's record, first event and queue entry, with its idempotency key claimed
-- and its admission counted in the same step (so two requests with one key cannot both
-- create a job, and concurrent gateways cannot overshoot a limit).
-- Fairness between owners: an owner with `fair share` jobs in flight already (its counter
-- field) has this one wait in the overflow stream, so its backlog cannot stand between
-- another owner's job and the workers.
-- KEYS: job, events, channel, queue, deadlines, idempotency key ('' for none), then the
-- admission counts, jobs and checks (see admit in prelude.lua), then the overflow queue,
-- then the recent-jobs stream.
-- ARGV: job id, idempotency claim (what the key holds), idempotency ttl, deadline ('' for
-- none), queued event json, n, tokens, check at, m, owner's jobs field, fair share (0 = off),
-- recent-jobs cap, model, priority, then m scopes (jobs field, tokens field, max jobs,
-- max tokens; 0 = no limit), then n queue entry (field, value) pairs, then record (field,
-- value) pairs.
-- -> {'queued'} | {'exists', the claim the key holds}
--  | {'limited', scope (1-based), 'jobs' or 'tokens', the count now}: nothing written
-- A job id is new per request, so a record under it means this very submit ran already and
-- is re-sent (redis-py re-sends a command whose reply a dropped connection lost): 'queued'
-- again, nothing written twice.
if KEYS[6] ~= '' then
  local earlier = redis.call('GET', KEYS[6])
  if earlier then return {'exists', earlier} end
end
if redis.call('EXISTS', KEYS[1]) == 1 then return {'queued'} end
local scopes_from = 15
local entry_from = scopes_from + 4 * tonumber(ARGV[9])
local over = over_limit(KEYS[7], tonumber(ARGV[7]), scopes_from, entry_from - 1)
if over then return over end
if KEYS[6] ~= '' then redis.call('SET', KEYS[6], ARGV[2], 'EX', ARGV[3]) end
local entry_to = entry_from - 1 + 2 * tonumber(ARGV[6])
redis.call('HSET', KEYS[1], unpack(ARGV, entry_to + 1, #ARGV))
redis.call('XADD', KEYS[2], '0-1', 'd', ARGV[5])
redis.call('PUBLISH', KEYS[3], ARGV[5])
local queue = KEYS[4]
local share = tonumber(ARGV[11])
if share > 0 and tonumber(redis.call('HGET', KEYS[7], ARGV[10]) or '0') >= share then
  queue = KEYS[10]
end
redis.call('XADD', queue, '*', unpack(ARGV, entry_from, entry_to))
if ARGV[4] ~= '' then redis.call('ZADD', KEYS[5], ARGV[4], ARGV[1]) end
admit(KEYS[7], KEYS[8], KEYS[9], KEYS[1], ARGV[7], ARGV[8], scopes_from, entry_from - 1)
note_recent(KEYS[11], ARGV[12], 'job', ARGV[1], 'status', 'queued', 'model', ARGV[13],
  'priority', ARGV[14])
return {'queued'}
