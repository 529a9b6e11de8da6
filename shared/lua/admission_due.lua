-- ADMISSION_DUE: take up to `limit` admitted jobs due a check and push their next check out
-- (so concurrent gateways check each job once per round).
-- KEYS: admission checks. ARGV: now, next check at, limit. -> the jobs' record keys
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
for _, job in ipairs(due) do redis.call('ZADD', KEYS[1], 'XX', ARGV[2], job) end
return due
