-- RELEASE_IDEMPOTENCY: free an idempotency key whose job is gone (expired before the key),
-- only if it still holds the claim the caller read.
-- KEYS and ARGV: RELEASE_IDEMPOTENCY in shared/scripts.py.
-- -> 1 released | 0 it changed meanwhile
if redis.call('GET', K.idempotency) ~= A.claim then return 0 end
redis.call('DEL', K.idempotency)
return 1
