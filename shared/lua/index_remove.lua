-- INDEX_REMOVE (Cluster): a job id leaves a sorted-set index of its queue shard.
-- KEYS and ARGV: INDEX_REMOVE in shared/scripts.py. -> 1 removed | 0 it was not there
return redis.call('ZREM', K.index, A.job_id)
