-- TELL_BATCH (Cluster: BATCH_UPDATE's notice to the webhook outbox, in the outbox's slot,
-- after the batch's final status is set in its own).
-- KEYS and ARGV: TELL_BATCH in shared/scripts.py. -> 1
redis.call('XADD', K.outbox, '*', 'batch', A.batch_id, 'status', A.status)
return 1
