-- ADMIT (Cluster: SUBMIT's admission step, in the slot {admission}): the limits checked and
-- the job counted, as SUBMIT does on one Redis (over_limit and admit in prelude.lua); and
-- whether its owner is past its fair share (its entry then waits in the overflow stream).
-- A job counted already (this submit re-sent) is not counted twice.
-- KEYS and ARGV: ADMIT in shared/scripts.py.
-- -> {'ok', overflow (1 or 0)} | {'limited', scope (1-based), 'jobs' or 'tokens', count}
local to = REST - 1 + 4 * tonumber(A.n_scopes)
if redis.call('HEXISTS', K.jobs, A.job_key) == 1 then return {'ok', 0} end
local over = over_limit(K.counts, tonumber(A.tokens), REST, to)
if over then return over end
local share = tonumber(A.fair_share)
local overflow = 0
if share > 0 and tonumber(redis.call('HGET', K.counts, A.fair_field) or '0') >= share then
  overflow = 1
end
admit(K.counts, K.jobs, K.checks, A.job_key, A.tokens, A.check_at, REST, to)
return {'ok', overflow}
