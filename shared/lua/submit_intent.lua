-- SUBMIT_INTENT (Cluster: before the job's record is written, in its queue shard's slot):
-- the queue entry the job will get, kept in K.pending until SUBMIT_QUEUE writes it; the
-- reconciler queues what a submit that stopped after its record left here.
-- A.entry: the queue stream's key, the deadline ('' none), model, priority, then the entry's
-- (field, value) pairs, joined by the record separator (\30), the pairs by \31; then '1'
-- if the stream is a worker's lane (placement), else ''; under token-fair scheduling then
-- the shard's fair queue and clock, the job's cost, owner and window (SUBMIT_QUEUE).
-- KEYS and ARGV: SUBMIT_INTENT in shared/scripts.py. -> 1
redis.call('HSETNX', K.pending, A.job_id, A.entry)
redis.call('ZADD', K.pending_since, 'NX', A.now, A.job_id)
return 1
