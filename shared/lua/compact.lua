-- COMPACT: replace an ended job's event log by its compact form (shared/compact.py), if the
-- log is still the one the caller read: compare on its last seq and length. The record keeps
-- its TTL; the job leaves the compaction index whatever the outcome but `changed`.
-- KEYS and ARGV: COMPACT in shared/scripts.py.
-- -> 'compacted' | 'changed' (read again) | 'skipped' (gone, not ended, or compacted already)
local status = redis.call('HGET', K.job, 'status')
if not status or status == 'queued' or status == 'running'
    or redis.call('HEXISTS', K.job, 'log') == 1 then
  redis.call('ZREM', K.compact_due, A.job_id)
  return 'skipped'
end
if last_seq(K.events) ~= tonumber(A.last_seq)
    or redis.call('XLEN', K.events) ~= tonumber(A.entries) then
  return 'changed'
end
set_fields(K.job, REST)
redis.call('DEL', K.events)
redis.call('ZREM', K.compact_due, A.job_id)
return 'compacted'
