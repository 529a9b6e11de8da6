-- DELETE_IDLE_CONSUMER: a consumer is deleted only with nothing pending (XGROUP DELCONSUMER
-- drops its pending entries, and a job whose entry is dropped is never reclaimed).
-- KEYS: queue. ARGV: group, consumer. -> 1 deleted | 0 kept
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
