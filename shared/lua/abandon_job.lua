-- ABANDON_JOB (Cluster: the reconciler, for a pending submit whose record never came): the
-- job's record is marked 'abandoned' (for an hour) unless it exists by now, so a submit that
-- comes even later cannot write a job nobody would queue.
-- KEYS and ARGV: ABANDON_JOB in shared/scripts.py. -> 1 abandoned | 0 the record is there
if redis.call('EXISTS', K.job) == 1 then return 0 end
redis.call('HSET', K.job, 'status', 'abandoned')
redis.call('EXPIRE', K.job, A.ttl)
return 1
