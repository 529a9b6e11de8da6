-- BATCH_UPDATE: set a batch's fields only while the caller holds its lease (when a token is
-- given) and its status is one of those given: a compare-and-set, so a driver that lost its
-- lease, or a cancel racing the finalizer, changes nothing.
-- KEYS: batch record, batch lease. ARGV: lease token ('' = none needed), the statuses
-- (space-separated), then record (field, value) pairs.
-- -> {1, status before}: set | {0, status}: not set ('missing': no batch; 'lease': the lease
--    is another's)
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {0, 'missing'} end
if ARGV[1] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[1] then return {0, 'lease'} end
local allowed = false
for s in string.gmatch(ARGV[2], '%S+') do
  if s == status then allowed = true end
end
if not allowed then return {0, status} end
if #ARGV >= 3 then redis.call('HSET', KEYS[1], unpack(ARGV, 3, #ARGV)) end
return {1, status}
