-- HAND_BACK: the owner gives its job back to the queue (the caller re-queues the entry).
-- KEYS and ARGV: HAND_BACK in shared/scripts.py (A.counted 1: a failed attempt; 0: a
-- drain's hand-back; A.interrupted 1: a stop interrupted it, which START bounds).
-- -> 1 the job is queued again | 0 fenced
if not owns(K.job, A.worker, A.attempt) then return 0 end
redis.call('HSET', K.job, 'status', 'queued')
redis.call('HDEL', K.job, 'worker')
if A.counted == '0' then redis.call('HINCRBY', K.job, 'handbacks', 1) end
if A.interrupted == '1' then redis.call('HINCRBY', K.job, 'interruptions', 1) end
if A.error ~= '' then redis.call('HSET', K.job, 'last_error', A.error) end
return 1
