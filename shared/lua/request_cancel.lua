-- REQUEST_CANCEL: a running job is flagged (its worker reads the flag with its next write,
-- and is told on its control channel); a queued one is reported for the caller to settle.
-- KEYS and ARGV: REQUEST_CANCEL in shared/scripts.py.
-- -> {'running', worker, attempt} | {'queued', attempt, last_seq} | {status} | {'missing'}
local h = redis.call('HMGET', K.job, 'status', 'worker', 'attempt')
if not h[1] then return {'missing'} end
if h[1] == 'running' then
  redis.call('HSET', K.job, 'cancel', A.reason)
  return {'running', h[2] or '', tonumber(h[3] or '0')}
end
if h[1] == 'queued' then return {'queued', tonumber(h[3] or '0'), last_seq(K.events)} end
return {h[1]}
