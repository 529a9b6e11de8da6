-- SUBMIT_QUEUE (Cluster: in the job's queue shard's slot, after its record is written): the
-- pending entry (SUBMIT_INTENT) goes into its queue stream, with the job's deadline and its
-- note in the recent jobs, and leaves K.pending in the same step: whoever runs it first (the
-- submit, or the reconciler for a submit that stopped) queues the job; any later run finds
-- nothing and writes nothing. So a job is queued exactly once.
-- After its stream, deadline, model, priority and pairs, a pending entry may say '1': its
-- stream is a worker's lane (placement), which joins K.placed_lanes; then, for a job under
-- token-fair scheduling, the shard's fair queue and clock, its cost, owner and window: it
-- waits in that fair queue for its turn among the shard's owners (as SUBMIT does).
-- KEYS and ARGV: SUBMIT_QUEUE in shared/scripts.py.
-- -> 1 queued now | 0 queued before (or never recorded)
local v = redis.call('HGET', K.pending, A.job_id)
if not v then return 0 end
redis.call('HDEL', K.pending, A.job_id)
redis.call('ZREM', K.pending_since, A.job_id)
local parts = {}
for part in (v .. '\30'):gmatch('(.-)\30') do parts[#parts + 1] = part end
local entry = {}
for part in (parts[5] .. '\31'):gmatch('(.-)\31') do entry[#entry + 1] = part end
if parts[6] == '1' then  -- a worker's lane (placement): the steal sweep walks it
  redis.call('SADD', K.placed_lanes, parts[1])
end
if parts[9] and parts[9] ~= '' then  -- token-fair: wait for its turn in the shard (as SUBMIT)
  local fairq, fair_clock = parts[7], parts[8]
  local owner = 'o:' .. parts[10]
  local v = tonumber(redis.call('HGET', fair_clock, 'V') or '0')
  local last = tonumber(redis.call('HGET', fair_clock, owner) or '0')
  local finish = math.max(v, last) + tonumber(parts[9])
  redis.call('HSET', fair_clock, owner, string.format('%.6f', finish))
  redis.call('ZADD', fairq, finish, parts[5])
  fair_release(parts[1], fairq, fair_clock, A.group, tonumber(parts[11]))
else
  redis.call('XADD', parts[1], '*', unpack(entry))
end
if parts[2] ~= '' then redis.call('ZADD', K.deadlines, parts[2], A.job_id) end
note_recent(K.recent, A.recent_cap, 'job', A.job_id, 'status', 'queued', 'model', parts[3],
  'priority', parts[4])
return 1
