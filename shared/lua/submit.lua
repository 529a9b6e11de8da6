-- SUBMIT: a new job's record, first event and queue entry, with its idempotency key claimed
-- and its admission counted in the same step (so two requests with one key cannot both
-- create a job, and concurrent gateways cannot overshoot a limit).
-- Fairness between owners: an owner with `fair share` jobs in flight already (its counter
-- field) has this one wait in the overflow stream, so its backlog cannot stand between
-- another owner's job and the workers.
-- Token-fair scheduling: with A.fair_cost (not ''), a job bound for the queue waits in
-- K.fair_queue for its turn among owners (fair_release in prelude.lua); GENQ_FAIR_WINDOW of
-- them are released at once, so an idle worker takes it without waiting.
-- Placement: K.placed, when not '', is the lane of the worker whose cache holds the job's
-- prompt: the job waits there (unless its owner is past its fair share) and the lane joins
-- K.placed_lanes, which the steal sweep walks; A.news (when not '') goes to every gateway on
-- A.news_channel: that worker's cache will hold the prompt.
-- KEYS and ARGV: SUBMIT in shared/scripts.py. K.idempotency is '' for none, A.claim what the
-- key holds, A.deadline '' for none, A.fair_share 0 for off; the admission keys and scopes:
-- see admit in prelude.lua (a scope's max 0 = no limit).
-- Tokens per minute: A.charge tokens (0: none) are taken from the owner's tokens bucket
-- K.tokens_bucket (A.tpm: its size, refilled over a minute; see prelude.lua), in the step that
-- queues the job: a job refused, or a submit re-sent, is not charged.
-- -> {'queued'} | {'queued', tokens left, ms until the bucket is full} (charged)
--  | {'exists', the claim the key holds}
--  | {'limited', scope (1-based), 'jobs' or 'tokens', the count now}: nothing written
--  | {'throttled', ms until the bucket holds A.charge, tokens left, ms until it is full}:
--    nothing written
-- A job id is new per request, so a record under it means this very submit ran already and
-- is re-sent (redis-py re-sends a command whose reply a dropped connection lost): 'queued'
-- again, nothing written twice.
if K.idempotency ~= '' then
  local earlier = redis.call('GET', K.idempotency)
  if earlier then return {'exists', earlier} end
end
if redis.call('EXISTS', K.job) == 1 then return {'queued'} end
local scopes_from = REST
local entry_from = scopes_from + 4 * tonumber(A.n_scopes)
local over = over_limit(K.admission_counts, tonumber(A.tokens), scopes_from, entry_from - 1)
if over then return over end
local charge, tpm = tonumber(A.charge), tonumber(A.tpm)
local left = nil
if charge > 0 and tpm > 0 then
  local now, rate = clock(), tpm / 60
  local level = level_of(K.tokens_bucket, rate, tpm, now)
  if level < charge then
    return {'throttled', wait_ms(level, charge, rate), math.floor(level), wait_ms(level, tpm, rate)}
  end
  local after = take(K.tokens_bucket, level, charge, rate, tpm, now)
  left = {math.floor(after), wait_ms(after, tpm, rate)}
end
if K.idempotency ~= '' then redis.call('SET', K.idempotency, A.claim, 'EX', A.claim_ttl) end
local entry_to = entry_from - 1 + 2 * tonumber(A.n_entry)
redis.call('HSET', K.job, unpack(ARGV, entry_to + 1, #ARGV))
redis.call('XADD', K.events, '0-1', 'd', A.queued_event)
redis.call(PUB, K.channel, A.queued_event)
local queue = K.queue
local share = tonumber(A.fair_share)
if share > 0 and tonumber(redis.call('HGET', K.admission_counts, A.fair_field) or '0') >= share then
  queue = K.overflow
elseif K.placed ~= '' then
  queue = K.placed
  redis.call('SADD', K.placed_lanes, K.placed)
  if A.news ~= '' then redis.call('PUBLISH', A.news_channel, A.news) end
end
if A.fair_cost ~= '' and queue == K.queue then  -- token-fair: wait for its turn (prelude)
  local owner = 'o:' .. A.fair_owner
  local v = tonumber(redis.call('HGET', K.fair_clock, 'V') or '0')
  local last = tonumber(redis.call('HGET', K.fair_clock, owner) or '0')
  local finish = math.max(v, last) + tonumber(A.fair_cost)
  redis.call('HSET', K.fair_clock, owner, string.format('%.6f', finish))
  local entry = {}
  for i = entry_from, entry_to do entry[#entry + 1] = ARGV[i] end
  redis.call('ZADD', K.fair_queue, finish, table.concat(entry, '\31'))
  fair_release(K.queue, K.fair_queue, K.fair_clock, A.group, tonumber(A.fair_window))
else
  redis.call('XADD', queue, '*', unpack(ARGV, entry_from, entry_to))
end
if A.deadline ~= '' then redis.call('ZADD', K.deadlines, A.deadline, A.job_id) end
admit(K.admission_counts, K.admission_jobs, K.admission_checks, K.job, A.tokens, A.check_at,
  scopes_from, entry_from - 1)
note_recent(K.recent, A.recent_cap, 'job', A.job_id, 'status', 'queued', 'model', A.model,
  'priority', A.priority)
if left then return {'queued', left[1], left[2]} end
return {'queued'}
