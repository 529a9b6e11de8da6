-- BATCH_RESULTS: lines' results, each written once. A line that has a result, in either file,
-- keeps it: a job's end seen twice (a notification read again, a sweep racing the tracker)
-- counts once, and no line is ever in both files. An ended batch takes no more.
-- KEYS: batch record, output results, error results (hashes: line -> the line's JSON).
-- ARGV: ttl of the result hashes, n, then n groups of (line, 'out' | 'err', json, input
-- tokens, output tokens, cached tokens).
-- -> {written, completed, failed}
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'completed' or status == 'failed' or status == 'expired'
    or status == 'cancelled' then
  return {0, 0, 0}
end
local written = 0
for i = 0, tonumber(ARGV[2]) - 1 do
  local at = 3 + 6 * i
  local line = ARGV[at]
  if redis.call('HEXISTS', KEYS[2], line) == 0 and redis.call('HEXISTS', KEYS[3], line) == 0 then
    if ARGV[at + 1] == 'out' then
      redis.call('HSET', KEYS[2], line, ARGV[at + 2])
      redis.call('HINCRBY', KEYS[1], 'completed', 1)
    else
      redis.call('HSET', KEYS[3], line, ARGV[at + 2])
      redis.call('HINCRBY', KEYS[1], 'failed', 1)
    end
    redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[at + 3])
    redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[at + 4])
    redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[at + 5])
    written = written + 1
  end
end
if written > 0 then
  redis.call('EXPIRE', KEYS[2], ARGV[1])
  redis.call('EXPIRE', KEYS[3], ARGV[1])
end
local c = redis.call('HMGET', KEYS[1], 'completed', 'failed')
return {written, tonumber(c[1] or '0'), tonumber(c[2] or '0')}
