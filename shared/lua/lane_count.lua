-- LANE_COUNT (Cluster: a step of a worker's cache news, one per queue shard): the entries in
-- a worker's two lanes of one shard; the news adds them up over the shards (PUBLISH_NEWS).
-- KEYS and ARGV: LANE_COUNT in shared/scripts.py. -> the entries
return redis.call('XLEN', K.interactive) + redis.call('XLEN', K.batch)
