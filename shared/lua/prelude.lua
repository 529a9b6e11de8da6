-- Shared by every script (prepended when loaded, before the prologue that names the
-- script's KEYS and ARGV: shared/scripts.py). A job's keys: its record (hash), its event log
-- (stream, entry ids 0-<seq>), its live channel.

-- How a job's events are published: PUBLISH on one Redis; on a Cluster SPUBLISH, so they go
-- only to the node holding the job's slot (`shared.transitions.script` swaps this line).
local PUB = 'PUBLISH'

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
      redis.call(PUB, channel, ARGV[i + 1])
    end
  end
  return nil
end

-- Set the (field, value) pairs ARGV[from..#ARGV] on the record (encoded by the caller).
local function set_fields(job, from)
  if #ARGV >= from then redis.call('HSET', job, unpack(ARGV, from, #ARGV)) end
end

-- A job that ended keeps its record and log for `retention` seconds (0: it goes on), leaves
-- the deadlines index and joins the compaction index (`compact_due`) at `compact_at`, when its
-- log is replaced by a compact form (compact.lua). Both indexes are in another slot: on a
-- Cluster JOB_ENDED does this part, as a step after the end (shared/transitions.py).
local function retain(job, events, retention, job_id, compact_at, deadlines, compact_due)
  if tonumber(retention) > 0 then
    redis.call('EXPIRE', job, retention)
    redis.call('EXPIRE', events, retention)
    redis.call('ZREM', deadlines, job_id)
    -- a batch's job is not compacted: its result is the batch's, its keys go soon
    if redis.call('HEXISTS', job, 'done_stream') == 0 then
      redis.call('ZADD', compact_due, compact_at, job_id)
    end
  end
end

-- Admission (shared/quotas.py): jobs and tokens admitted and not yet ended, per counter
-- field, in the hash `counts`; `jobs` maps each admitted job's record key to what its
-- admission added (its tokens, then its counter fields, one a line), so its end takes
-- exactly that off again, once; `checks` scores it by when the repair looks at it next.
-- ARGV[from..to] are scopes of four: jobs field, tokens field, max jobs, max tokens.

-- The first scope a job of `tokens` would take past a limit: {'limited', i, what, count}.
local function over_limit(counts, tokens, from, to)
  for i = from, to, 4 do
    local max_jobs, max_tokens = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
    if max_jobs > 0 or max_tokens > 0 then
      local h = redis.call('HMGET', counts, ARGV[i], ARGV[i + 1])
      local n, used = tonumber(h[1] or '0'), tonumber(h[2] or '0')
      local scope = (i - from) / 4 + 1
      if max_jobs > 0 and n + 1 > max_jobs then return {'limited', scope, 'jobs', n} end
      if max_tokens > 0 and used + tokens > max_tokens then
        return {'limited', scope, 'tokens', used}
      end
    end
  end
  return nil
end

-- Count the job `job` (a record key) in every scope of ARGV[from..to].
local function admit(counts, jobs, checks, job, tokens, check_at, from, to)
  local added = {tokens}
  for i = from, to, 4 do
    redis.call('HINCRBY', counts, ARGV[i], 1)
    redis.call('HINCRBY', counts, ARGV[i + 1], tokens)
    added[#added + 1] = ARGV[i]
    added[#added + 1] = ARGV[i + 1]
  end
  redis.call('HSET', jobs, job, table.concat(added, '\n'))
  redis.call('ZADD', checks, check_at, job)
end

-- A job that ended stops counting (once: a job admitted before admission was counted, or
-- released already, is not in `jobs`). A counter back at zero goes.
local function release(counts, jobs, checks, job)
  local added = redis.call('HGET', jobs, job)
  if not added then return 0 end
  local tokens, odd = nil, true
  for part in string.gmatch(added, '[^\n]+') do
    if tokens == nil then
      tokens = tonumber(part)
    else
      if redis.call('HINCRBY', counts, part, odd and -1 or -tokens) <= 0 then
        redis.call('HDEL', counts, part)
      end
      odd = not odd
    end
  end
  redis.call('HDEL', jobs, job)
  redis.call('ZREM', checks, job)
  return 1
end

-- Token buckets, per owner (gateway/admission.py): its requests (one a request) and its
-- tokens per minute (a job's prompt + max_tokens, taken by SUBMIT). A bucket is a hash of its
-- level ('tokens') and when it was written ('at'), on Redis's clock, so every gateway shares
-- one bucket whatever its own clock says; it refills at `rate` a second up to `size`, and one
-- not written for as long as it takes to fill expires: full, as a new one.
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function level_of(bucket, rate, size, now)
  local h = redis.call('HMGET', bucket, 'tokens', 'at')
  local level = tonumber(h[1] or size)
  local at = tonumber(h[2] or now)
  return math.min(size, level + math.max(0, now - at) * rate)
end

-- Take `n` from a bucket at `level` (which holds them); its level after.
local function take(bucket, level, n, rate, size, now)
  level = level - n
  redis.call('HSET', bucket, 'tokens', tostring(level), 'at', tostring(now))
  redis.call('PEXPIRE', bucket, math.ceil((size - level) / rate * 1000) + 1000)
  return level
end

-- Milliseconds until a bucket at `level` holds `n` (its size: until it is full again).
local function wait_ms(level, n, rate)
  return math.max(0, math.ceil((n - level) / rate * 1000))
end

-- A job that ended tells the stream its record names in `done_stream` (a batch's), in the
-- step that ends it, so a tracker of the batch cannot miss it. That stream lives in its
-- batch's slot, not the job's: on a Cluster (which lets a script touch only keys of one
-- slot) TELL_STREAM does this, as a step after the end.
-- The webhook outbox its record names in `notify` hears of it the same way (a delivery is
-- then made from it by a gateway: gateway/webhooks.py): never an end without its event.
local function tell_done(job, job_id)
  local stream = redis.call('HGET', job, 'done_stream')
  if stream then redis.call('XADD', stream, '*', 'job', job_id) end
  local outbox = redis.call('HGET', job, 'notify')
  if outbox then redis.call('XADD', outbox, '*', 'job', job_id) end
end

-- Note the job in the recent-jobs stream `recent` (the dashboard's list), capped at about
-- `cap` entries (0: not written); ARGV[from..] are its (field, value) pairs. One key for
-- every job, in no job's slot (on a Cluster, one per queue shard, written by the shard's
-- steps).
local function note_recent(recent, cap, ...)
  if recent and recent ~= '' and tonumber(cap) > 0 then
    redis.call('XADD', recent, 'MAXLEN', '~', cap, '*', ...)
  end
end

-- Token-fair scheduling (start-time fair queueing over owners): keyed owners' jobs wait in the
-- sorted set `fairq` scored by their virtual finish time, max(V, the owner's last) + the
-- job's cost / the owner's weight (SUBMIT); `fair_release` moves the lowest-scored into the
-- model's queue, as workers are about to claim, until the queue holds `want` entries not yet
-- delivered (its group's lag), and sets V to the last one's score: an owner idle a while
-- comes back at V, with no credit saved up, and a backlogged owner's jobs interleave with
-- another's in proportion to their weights whatever either's backlog.
-- A member is its queue entry's (field, value) list joined by the unit separator (\31).
-- `skip` (a set of owners, or nil): those owners' jobs stay where they are, and the others'
-- among the first FAIR_SKIP_SCAN in order are released instead (a worker keeping its last
-- slots for other owners than the one filling it: worker/claims.py); V only moves forward.
-- -> entries released
local FAIR_SKIP_SCAN = 32

local function owner_of_member(member)
  local parts = {}
  for part in (member .. '\31'):gmatch('(.-)\31') do parts[#parts + 1] = part end
  for i = 1, #parts - 1, 2 do
    if parts[i] == 'owner' then return parts[i + 1] end
  end
  return nil
end

local function fair_release_skipping(queue, fairq, clock, want, skip)
  local moved = 0
  local scanned = redis.call('ZRANGE', fairq, 0, FAIR_SKIP_SCAN - 1, 'WITHSCORES')
  local v = tonumber(redis.call('HGET', clock, 'V') or '0')
  for i = 1, #scanned, 2 do
    if moved >= want then break end
    local owner = owner_of_member(scanned[i])
    if not (owner and skip[owner]) then
      local entry = {}
      for part in (scanned[i] .. '\31'):gmatch('(.-)\31') do entry[#entry + 1] = part end
      redis.call('ZREM', fairq, scanned[i])
      redis.call('XADD', queue, '*', unpack(entry))
      v = math.max(v, tonumber(scanned[i + 1]))
      moved = moved + 1
    end
  end
  if moved > 0 then redis.call('HSET', clock, 'V', string.format('%.6f', v)) end
  return moved
end

-- Moves to `lane` up to `want` entries of `shared` not yet delivered to `group` (among the
-- first FAIR_SKIP_SCAN of them), except those of the owners in `skip`: entries released
-- into the shared queue ahead of the workers' claims, which may stand behind a capped
-- owner's there. -> entries moved
local function take_undelivered(shared, lane, group, want, skip)
  local groups = redis.pcall('XINFO', 'GROUPS', shared)
  if type(groups) ~= 'table' or groups.err then return 0 end
  local last = nil
  for _, g in ipairs(groups) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == group then last = info['last-delivered-id'] end
  end
  if not last then return 0 end
  local moved = 0
  for _, e in ipairs(redis.call('XRANGE', shared, '(' .. last, '+', 'COUNT', FAIR_SKIP_SCAN)) do
    if moved >= want then break end
    local fields, owner = e[2], nil
    for i = 1, #fields - 1, 2 do
      if fields[i] == 'owner' then owner = fields[i + 1] end
    end
    if not (owner and skip[owner]) then
      redis.call('XDEL', shared, e[1])
      redis.call('XADD', lane, '*', unpack(fields))
      moved = moved + 1
    end
  end
  return moved
end

local function fair_release(queue, fairq, clock, group, want, skip)
  local lag = 0
  local groups = redis.pcall('XINFO', 'GROUPS', queue)
  if type(groups) == 'table' and not groups.err then
    for _, g in ipairs(groups) do
      local info = {}
      for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
      if info['name'] == group then
        lag = tonumber(info['lag'])
        if not lag then lag = redis.call('XLEN', queue) - tonumber(info['pending']) end
      end
    end
  end
  if skip and next(skip) ~= nil then
    return fair_release_skipping(queue, fairq, clock, want - lag, skip)
  end
  local moved = 0
  while moved < want - lag do
    local top = redis.call('ZPOPMIN', fairq)
    if #top == 0 then break end
    local entry = {}
    for part in (top[1] .. '\31'):gmatch('(.-)\31') do entry[#entry + 1] = part end
    redis.call('XADD', queue, '*', unpack(entry))
    redis.call('HSET', clock, 'V', top[2])
    moved = moved + 1
  end
  return moved
end
