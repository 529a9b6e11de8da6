-- PUBLISH_NEWS (Cluster): a cache news (shared.records.CacheNews, JSON) on its shard channel
-- K.channel (declared as a key: a script reaches only its own slot), with A.lane, the jobs
-- waiting in the worker's lanes, added when not '' (a worker's news; a gateway's placement
-- says none).
-- KEYS and ARGV: PUBLISH_NEWS in shared/scripts.py. -> how many listeners it reached
if A.lane == '' then return redis.call(PUB, K.channel, A.news) end
return redis.call(PUB, K.channel, string.sub(A.news, 1, -2) .. ',"lane":' .. A.lane .. '}')
