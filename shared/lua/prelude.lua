-- Shared by every script (prepended when loaded). A job's keys: KEYS[1] its record (hash),
-- KEYS[2] its event log (stream, entry ids 0-<seq>), KEYS[3] its live channel.

-- The ownership check, the only one: a running job is its worker's while the record names
-- that worker at that attempt. A worker that lost its lease (paused, cut off) fails it and
-- can write nothing more.
local function owns(job, worker, attempt)
  local h = redis.call('HMGET', job, 'worker', 'attempt', 'status')
  return h[1] == worker and h[2] == attempt and h[3] == 'running'
end

-- The last seq written to a job's log (0 if none).
local function last_seq(events)
  local last = redis.call('XREVRANGE', events, '+', '-', 'COUNT', 1)
  if #last == 0 then return 0 end
  return tonumber(string.match(last[1][1], '%-(%d+)$'))
end

-- Append the (seq, json) pairs ARGV[from..to] to the log and the channel, skipping seqs the
-- log already holds (a retried write). Returns nil when written; else the log's last seq,
-- with nothing written: a new seq beyond last + 1 means the log lost its tail (Redis
-- restarted without its last writes), and writing it would leave a hole no reader gets past.
local function append(events, channel, maxlen, from, to)
  local last = last_seq(events)
  for i = from, to, 2 do
    local seq = tonumber(ARGV[i])
    if seq > last then
      if seq > last + 1 then return last end
      break
    end
  end
  for i = from, to, 2 do
    if tonumber(ARGV[i]) > last then
      redis.call('XADD', events, 'MAXLEN', '~', maxlen, '0-' .. ARGV[i], 'd', ARGV[i + 1])
      redis.call('PUBLISH', channel, ARGV[i + 1])
    end
  end
  return nil
end

-- Set the (field, value) pairs ARGV[from..#ARGV] on the record (encoded by the caller).
local function set_fields(job, from)
  if #ARGV >= from then redis.call('HSET', job, unpack(ARGV, from, #ARGV)) end
end

-- A job that ended keeps its record and log for `retention` seconds (0: no change).
local function retain(job, events, retention)
  if tonumber(retention) > 0 then
    redis.call('EXPIRE', job, retention)
    redis.call('EXPIRE', events, retention)
  end
end

-- A job that ended tells the stream its record names in `done_stream` (a batch's), in the
-- step that ends it, so a tracker of the batch cannot miss it. That stream lives in its
-- batch's slot, not the job's: with SUBMIT, the seam for Cluster (which lets a script touch
-- only keys it is handed).
local function tell_done(job)
  local stream = redis.call('HGET', job, 'done_stream')
  if stream then redis.call('XADD', stream, '*', 'job', string.match(job, '{([^}]*)}')) end
end
