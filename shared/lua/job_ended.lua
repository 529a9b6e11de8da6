-- JOB_ENDED (Cluster: a job's end, in its queue shard's slot, after the end is written in
-- the job's): it leaves the deadlines index, joins the compaction index (A.compact 1), is
-- noted in the recent jobs, and its queue entry (A.entry, when not '') is acknowledged.
-- KEYS and ARGV: JOB_ENDED in shared/scripts.py (K.queue: the deadlines key when no entry).
-- -> 1
redis.call('ZREM', K.deadlines, A.job_id)
if A.compact == '1' then redis.call('ZADD', K.compact_due, A.compact_at, A.job_id) end
note_recent(K.recent, A.recent_cap, 'job', A.job_id, 'status', A.status)
if A.entry ~= '' then  -- pcall: a queue that lost its group (a Redis restarted without it)
  redis.pcall('XACK', K.queue, A.group, A.entry)
  redis.pcall('XDEL', K.queue, A.entry)
end
return 1
