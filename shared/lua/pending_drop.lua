-- PENDING_DROP (Cluster: in a queue shard's slot): a pending submit's entry goes, unqueued (a
-- submit that stopped at an idempotency key another request holds, or one the reconciler
-- abandoned).
-- KEYS and ARGV: PENDING_DROP in shared/scripts.py. -> 1 dropped | 0 it was not pending
redis.call('ZREM', K.pending_since, A.job_id)
return redis.call('HDEL', K.pending, A.job_id)
