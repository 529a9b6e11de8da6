-- ADMISSION_DUE: take up to `limit` admitted jobs due a check and push their next check out
-- (so concurrent gateways check each job once per round).
-- KEYS and ARGV: ADMISSION_DUE in shared/scripts.py. -> the jobs' record keys
local due = redis.call('ZRANGEBYSCORE', K.checks, '-inf', A.now, 'LIMIT', 0, A.limit)
for _, job in ipairs(due) do redis.call('ZADD', K.checks, 'XX', A.next_at, job) end
return due
