-- CHARGE (Cluster: SUBMIT's tokens-per-minute step, in the owner's slot, before the
-- admission): A.charge tokens taken from the owner's tokens bucket K.bucket (A.tpm: its
-- size, refilled over a minute; prelude.lua), or none and a refusal. The bucket remembers
-- the last job it charged (field 'job'), so a charge re-sent (redis-py re-sends a command
-- whose reply a dropped connection lost) is not taken twice. A step after that refuses the
-- job gives the tokens back (REFUND).
-- KEYS and ARGV: CHARGE in shared/scripts.py.
-- -> {'charged', tokens left, ms until the bucket is full}
--  | {'throttled', ms until the bucket holds A.charge, tokens left, ms until it is full}
local now, tpm = clock(), tonumber(A.tpm)
local rate, charge = tpm / 60, tonumber(A.charge)
local level = level_of(K.bucket, rate, tpm, now)
if redis.call('HGET', K.bucket, 'job') == A.job_id then
  return {'charged', math.floor(level), wait_ms(level, tpm, rate)}
end
if level < charge then
  return {'throttled', wait_ms(level, charge, rate), math.floor(level), wait_ms(level, tpm, rate)}
end
local after = take(K.bucket, level, charge, rate, tpm, now)
redis.call('HSET', K.bucket, 'job', A.job_id)
return {'charged', math.floor(after), wait_ms(after, tpm, rate)}
