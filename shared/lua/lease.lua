-- LEASE: take a lease or renew one's own (`hold`, for ttl ms), or free one's own (`free`).
-- KEYS and ARGV: LEASE in shared/scripts.py (A.action: 'hold' | 'free').
-- -> 1 done | 0 another holds it
local holder = redis.call('GET', K.lease)
if A.action == 'free' then
  if holder ~= A.token then return 0 end
  redis.call('DEL', K.lease)
  return 1
end
if holder and holder ~= A.token then return 0 end
redis.call('SET', K.lease, A.token, 'PX', A.ttl_ms)
return 1
