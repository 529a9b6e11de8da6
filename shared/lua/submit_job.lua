-- SUBMIT_JOB (Cluster: in the job's slot): its record and first event, published on its
-- shard channel. A record already there means this submit ran and is re-sent.
-- KEYS and ARGV: SUBMIT_JOB in shared/scripts.py. -> 1
if redis.call('EXISTS', K.job) == 1 then return 1 end
redis.call('HSET', K.job, unpack(ARGV, REST, #ARGV))
redis.call('XADD', K.events, '0-1', 'd', A.queued_event)
redis.call(PUB, K.channel, A.queued_event)
return 1
