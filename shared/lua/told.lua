-- TOLD (Cluster): the webhook outbox heard of this job's end (TELL_STREAM, a step after the
-- end), or of this batch's final status (TELL_BATCH; K.job is then the batch's record): a
-- START that finds the job ended, or the driver cleaning up the ended batch, tells it again
-- only while this is not set.
-- KEYS and ARGV: TOLD in shared/scripts.py. -> 1 | 0 (the record is gone)
if redis.call('EXISTS', K.job) == 0 then return 0 end
redis.call('HSET', K.job, 'told', '1')
return 1
