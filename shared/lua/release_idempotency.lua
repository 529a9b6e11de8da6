-- RELEASE_IDEMPOTENCY: free an idempotency key whose job is gone (expired before the key),
-- only if it still holds the claim the caller read.
-- KEYS: idempotency key. ARGV: claim. -> 1 released | 0 it changed meanwhile
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
