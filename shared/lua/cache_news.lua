-- CACHE_NEWS: publish a worker's cache news (shared.records.CacheNews, JSON) on
-- A.channel, with the jobs waiting in its own lanes counted here, where they are: the entries
-- of K.interactive and K.batch (its lanes) less A.held, those of them it holds (started, or
-- claimed and waiting for room; an entry leaves its lane when its job ends).
-- KEYS and ARGV: CACHE_NEWS in shared/scripts.py.
-- -> how many listeners it reached
local n = redis.call('XLEN', K.interactive) + redis.call('XLEN', K.batch) - tonumber(A.held)
if n < 0 then n = 0 end
return redis.call('PUBLISH', A.channel, string.sub(A.news, 1, -2) .. ',"lane":' .. n .. '}')
