-- BATCH_UPDATE: set a batch's fields only while the caller holds its lease (when a token is
-- given) and its status is one of those given: a compare-and-set, so a driver that lost its
-- lease, or a cancel racing the finalizer, changes nothing.
-- KEYS and ARGV: BATCH_UPDATE in shared/scripts.py (A.token: the lease's, '' = none needed;
-- A.statuses: space-separated; A.notify '1': a final status set tells K.outbox, the webhook
-- outbox, which lives in another slot: on a Cluster, TELL_BATCH tells it in a step after).
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
-- a final status set here tells the webhook outbox in the same step (A.notify: '1')
if A.notify == '1' then
  for i = REST, #ARGV - 1, 2 do
    local v = ARGV[i + 1]
    if ARGV[i] == 'status' and (v == 'completed' or v == 'failed' or v == 'expired'
        or v == 'cancelled') then
      redis.call('XADD', K.outbox, '*', 'batch', A.batch_id, 'status', v)
    end
  end
end
return {1, status}
