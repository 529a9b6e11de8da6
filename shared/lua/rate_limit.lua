-- RATE_LIMIT: take one request from an owner's token bucket (Redis's clock, so every gateway
-- shares one bucket whatever its own clock says).
-- KEYS and ARGV: RATE_LIMIT in shared/scripts.py (A.rate: requests/s; A.burst: the
-- bucket's size).
-- -> {1, 0} allowed | {0, ms until a request is allowed}
local rate, burst = tonumber(A.rate), tonumber(A.burst)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local h = redis.call('HMGET', K.bucket, 'tokens', 'at')
local tokens = tonumber(h[1] or A.burst)
local at = tonumber(h[2] or now)
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
if tokens < 1 then return {0, math.ceil((1 - tokens) / rate * 1000)} end
redis.call('HSET', K.bucket, 'tokens', tostring(tokens - 1), 'at', tostring(now))
redis.call('PEXPIRE', K.bucket, math.ceil(burst / rate * 1000) + 1000)
return {1, 0}
