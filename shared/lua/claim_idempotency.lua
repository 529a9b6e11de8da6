-- CLAIM_IDEMPOTENCY (Cluster: SUBMIT's first step, in the key's own slot): an owner's
-- Idempotency-Key names the job this submit makes, unless it named one already.
-- KEYS and ARGV: CLAIM_IDEMPOTENCY in shared/scripts.py.
-- A claim already holding A.claim is this very submit's, re-sent (A.claim names its job id,
-- new per request): claimed.
-- -> {'ok'} claimed | {'exists', the claim the key holds}
local earlier = redis.call('GET', K.idempotency)
if earlier == A.claim then return {'ok'} end
if earlier then return {'exists', earlier} end
redis.call('SET', K.idempotency, A.claim, 'EX', A.claim_ttl)
return {'ok'}
