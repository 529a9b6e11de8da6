-- TELL_STREAM (Cluster: a job's end told to a stream in another slot: its batch's done
-- stream, the webhook outbox), after the end is written in the job's slot.
-- KEYS and ARGV: TELL_STREAM in shared/scripts.py. -> 1
redis.call('XADD', K.stream, '*', 'job', A.job_id)
return 1
