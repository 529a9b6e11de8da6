-- PEEK_IDEMPOTENCY (Cluster: SUBMIT's first step, read only): whether the Idempotency-Key
-- names another request's job already, so a retried request gets its job (not a refusal
-- by a limit its first try passed) before anything is counted. CLAIM_IDEMPOTENCY claims it
-- later, after the admission; a request racing this one is caught there.
-- KEYS and ARGV: PEEK_IDEMPOTENCY in shared/scripts.py.
-- -> {'free'} | {'exists', the claim the key holds}
local earlier = redis.call('GET', K.idempotency)
if earlier and earlier ~= A.claim then return {'exists', earlier} end
return {'free'}
