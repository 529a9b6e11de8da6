-- REFUND (Cluster): the tokens CHARGE took for job A.job_id given back to its owner's
-- bucket, once, when a later step of the submit refused the job (a limit, or another
-- request's Idempotency-Key); a bucket that charged another job since still gets them.
-- KEYS and ARGV: REFUND in shared/scripts.py. -> the bucket's tokens after
local now, tpm = clock(), tonumber(A.tpm)
local rate = tpm / 60
local level = level_of(K.bucket, rate, tpm, now)
if redis.call('HGET', K.bucket, 'refunded') == A.job_id then return math.floor(level) end
level = math.min(tpm, level + tonumber(A.charge))
redis.call('HSET', K.bucket, 'tokens', tostring(level), 'at', tostring(now), 'refunded', A.job_id)
redis.call('PEXPIRE', K.bucket, math.ceil((tpm - level) / rate * 1000) + 1000)
return math.floor(level)
