-- COMPACT_JOB (Cluster: COMPACT's step in the job's slot; the compaction index, in the
-- job's queue shard, is updated after it by INDEX_REMOVE).
-- KEYS and ARGV: COMPACT_JOB in shared/scripts.py. -> as COMPACT
local status = redis.call('HGET', K.job, 'status')
if not status or status == 'queued' or status == 'running'
    or redis.call('HEXISTS', K.job, 'log') == 1 then
  return 'skipped'
end
if last_seq(K.events) ~= tonumber(A.last_seq)
    or redis.call('XLEN', K.events) ~= tonumber(A.entries) then
  return 'changed'
end
set_fields(K.job, REST)
redis.call('DEL', K.events)
return 'compacted'
