-- DELETE_IDLE_CONSUMER: a consumer is deleted only with nothing pending (XGROUP DELCONSUMER
-- drops its pending entries, and a job whose entry is dropped is never reclaimed).
-- KEYS and ARGV: DELETE_IDLE_CONSUMER in shared/scripts.py. -> 1 deleted | 0 kept
if #redis.call('XPENDING', K.queue, A.group, '-', '+', 1, A.consumer) > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', K.queue, A.group, A.consumer)
return 1
