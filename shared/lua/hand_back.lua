-- HAND_BACK: the owner gives its job back to the queue (the caller re-queues the entry).
-- ARGV: worker, attempt, counted (1: a failed attempt; 0: a drain's hand-back), error.
-- -> 1 the job is queued again | 0 fenced
if not owns(KEYS[1], ARGV[1], ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued')
redis.call('HDEL', KEYS[1], 'worker')
if ARGV[3] == '0' then redis.call('HINCRBY', KEYS[1], 'handbacks', 1) end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'last_error', ARGV[4]) end
return 1
