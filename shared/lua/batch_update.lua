-- BATCH_UPDATE: set a batch's fields only while the caller holds its lease (when a token is
-- given) and its status is one of those given: a compare-and-set, so a driver that lost its
-- lease, or a cancel racing the finalizer, changes nothing.
-- KEYS and ARGV: BATCH_UPDATE in shared/scripts.py (A.token: the lease's, '' = none needed;
-- A.statuses: space-separated).
-- -> {1, status before}: set | {0, status}: not set ('missing': no batch; 'lease': the lease
--    is another's)
local status = redis.call('HGET', K.batch, 'status')
if not status then return {0, 'missing'} end
if A.token ~= '' and redis.call('GET', K.lease) ~= A.token then return {0, 'lease'} end
local allowed = false
for s in string.gmatch(A.statuses, '%S+') do
  if s == status then allowed = true end
end
if not allowed then return {0, status} end
if #ARGV >= REST then redis.call('HSET', K.batch, unpack(ARGV, REST, #ARGV)) end
return {1, status}
