-- SUBMIT: a new job's record, first event and queue entry, with its idempotency key claimed
-- in the same step (so two requests with one key cannot both create a job).
-- KEYS: job, events, channel, queue, deadlines, idempotency key ('' for none).
-- ARGV: job id, idempotency claim (what the key holds), idempotency ttl, deadline ('' for
-- none), queued event json, n, then n queue entry (field, value) pairs, then record
-- (field, value) pairs.
-- -> {'queued'} | {'exists', the claim the key holds}
if KEYS[6] ~= '' then
  local earlier = redis.call('GET', KEYS[6])
  if earlier then return {'exists', earlier} end
  redis.call('SET', KEYS[6], ARGV[2], 'EX', ARGV[3])
end
local entry_to = 6 + 2 * tonumber(ARGV[6])
redis.call('HSET', KEYS[1], unpack(ARGV, entry_to + 1, #ARGV))
redis.call('XADD', KEYS[2], '0-1', 'd', ARGV[5])
redis.call('PUBLISH', KEYS[3], ARGV[5])
redis.call('XADD', KEYS[4], '*', unpack(ARGV, 7, entry_to))
if ARGV[4] ~= '' then redis.call('ZADD', KEYS[5], ARGV[4], ARGV[1]) end
return {'queued'}
