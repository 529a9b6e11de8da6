-- COMPACT: replace an ended job's event log by its compact form (shared/compact.py), if the
-- log is still the one the caller read: compare on its last seq and length. The record keeps
-- its TTL; the job leaves the compaction index (KEYS[3]) whatever the outcome but `changed`.
-- KEYS: job, events, compaction index.
-- ARGV: job id, last seq, entries, then record (field, value) pairs: the compact log
-- (`log`), and fields packed smaller (`result`, `spec`).
-- -> 'compacted' | 'changed' (read again) | 'skipped' (gone, not ended, or compacted already)
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'queued' or status == 'running'
    or redis.call('HEXISTS', KEYS[1], 'log') == 1 then
  redis.call('ZREM', KEYS[3], ARGV[1])
  return 'skipped'
end
if last_seq(KEYS[2]) ~= tonumber(ARGV[2]) or redis.call('XLEN', KEYS[2]) ~= tonumber(ARGV[3]) then
  return 'changed'
end
set_fields(KEYS[1], 4)
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
return 'compacted'
