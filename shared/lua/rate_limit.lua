-- RATE_LIMIT: a request of an owner. One request is taken from its request bucket (A.rate:
-- requests a second, A.burst: the bucket's size; 0: no limit), and its tokens bucket is read,
-- not taken from (A.tpm: its size, refilled over a minute; 0: no limit): SUBMIT charges a
-- job's tokens once they are known. Buckets: see prelude.lua.
-- KEYS and ARGV: RATE_LIMIT in shared/scripts.py.
-- -> {1 allowed | 0 not, ms until a request is allowed (0 when allowed),
--     requests left, ms until the request bucket is full,
--     tokens left, ms until the tokens bucket is full}; -1 for a bucket with no limit
local now = clock()
local reply = {1, 0, -1, -1, -1, -1}
local rate, burst = tonumber(A.rate), tonumber(A.burst)
if rate > 0 then
  local level = level_of(K.requests, rate, burst, now)
  if level < 1 then
    reply[1], reply[2] = 0, wait_ms(level, 1, rate)
  else
    level = take(K.requests, level, 1, rate, burst, now)
  end
  reply[3], reply[4] = math.floor(level), wait_ms(level, burst, rate)
end
local tpm = tonumber(A.tpm)
if tpm > 0 then
  local level = level_of(K.tokens, tpm / 60, tpm, now)
  reply[5], reply[6] = math.floor(level), wait_ms(level, tpm, tpm / 60)
end
return reply
