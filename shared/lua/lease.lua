-- LEASE: take a lease or renew one's own (`hold`, for ttl ms), or free one's own (`free`).
-- KEYS: lease. ARGV: token, 'hold' | 'free', ttl ms. -> 1 done | 0 another holds it
local holder = redis.call('GET', KEYS[1])
if ARGV[2] == 'free' then
  if holder ~= ARGV[1] then return 0 end
  redis.call('DEL', KEYS[1])
  return 1
end
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
