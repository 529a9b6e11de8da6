-- SUBMIT_JOB (Cluster: in the job's slot): its record and first event, published on its
-- shard channel. A record already there means this submit ran and is re-sent.
-- A record marked 'abandoned' is the reconciler's: it gave up on this submit, which came too
-- late (its gateway is answered 503, the job never existed for anyone).
-- KEYS and ARGV: SUBMIT_JOB in shared/scripts.py. -> 1 | 0 abandoned
local status = redis.call('HGET', K.job, 'status')
if status == 'abandoned' then return 0 end
if status then return 1 end
redis.call('HSET', K.job, unpack(ARGV, REST, #ARGV))
redis.call('XADD', K.events, '0-1', 'd', A.queued_event)
redis.call(PUB, K.channel, A.queued_event)
return 1
