-- BATCH_RESULTS: lines' results, each written once. A line that has a result, in either file,
-- keeps it: a job's end seen twice (a notification read again, a sweep racing the tracker)
-- counts once, and no line is ever in both files. An ended batch takes no more.
-- KEYS and ARGV: BATCH_RESULTS in shared/scripts.py (K.output and K.errors: hashes, line ->
-- the line's JSON; A.ttl: theirs).
-- -> {written, completed, failed}
local status = redis.call('HGET', K.batch, 'status')
if not status or status == 'completed' or status == 'failed' or status == 'expired'
    or status == 'cancelled' then
  return {0, 0, 0}
end
local written = 0
for i = 0, tonumber(A.n) - 1 do
  local at = REST + 6 * i
  local line = ARGV[at]
  if redis.call('HEXISTS', K.output, line) == 0 and redis.call('HEXISTS', K.errors, line) == 0 then
    if ARGV[at + 1] == 'out' then
      redis.call('HSET', K.output, line, ARGV[at + 2])
      redis.call('HINCRBY', K.batch, 'completed', 1)
    else
      redis.call('HSET', K.errors, line, ARGV[at + 2])
      redis.call('HINCRBY', K.batch, 'failed', 1)
    end
    redis.call('HINCRBY', K.batch, 'input_tokens', ARGV[at + 3])
    redis.call('HINCRBY', K.batch, 'output_tokens', ARGV[at + 4])
    redis.call('HINCRBY', K.batch, 'cached_tokens', ARGV[at + 5])
    written = written + 1
  end
end
if written > 0 then
  redis.call('EXPIRE', K.output, A.ttl)
  redis.call('EXPIRE', K.errors, A.ttl)
end
local c = redis.call('HMGET', K.batch, 'completed', 'failed')
return {written, tonumber(c[1] or '0'), tonumber(c[2] or '0')}
