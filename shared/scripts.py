"""Lua scripts: the job state transitions that must be atomic in Redis.

Each one touches only the keys of one job (one Cluster slot). A job's events are written
only by whoever owns its state: the gateway while it is `queued` (the `cancelled` event), the
worker named in the record at the record's `attempt` while it is `running` (fencing: a worker
that lost its lease can no longer write). Event ids are `0-<seq>`, so a replayed write fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The last seq written to a job's log (0 if none).
_LAST_SEQ = """
local function last_seq(events)
  local last = redis.call('XREVRANGE', events, '+', '-', 'COUNT', 1)
  if #last == 0 then return 0 end
  return tonumber(string.match(last[1][1], '%-(%d+)$'))
end

-- The first seq in ARGV[from], ARGV[from+2], ... (up to ARGV[to]) that is new to the log;
-- nil when all are replays. A new seq beyond last + 1 means the log lost its tail (Redis
-- restarted without its last writes): writing it would leave a hole no reader gets past.
local function first_new(last, from, to)
  for i = from, to, 2 do
    local seq = tonumber(ARGV[i])
    if seq > last then return seq end
  end
  return nil
end
"""

# KEYS: job, events, channel. ARGV: worker_id, now, max_attempts, retention, maxlen.
# -> {'ok', attempt, last_seq, spec, cancel_requested} | {'exhausted', attempt} | {status}
START = (
    _LAST_SEQ
    + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {'missing'} end
if st ~= 'queued' and st ~= 'running' then return {st} end
local attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
local seq = last_seq(KEYS[2])
-- a drain's hand-back is not a failure: those attempts are not counted against the job
local returned = tonumber(redis.call('HGET', KEYS[1], 'handbacks') or '0')
if attempt - returned > tonumber(ARGV[3]) then
  local msg = 'the job failed ' .. (attempt - 1 - returned) .. ' attempts (max_attempts ' ..
              ARGV[3] .. ')'
  local last_error = redis.call('HGET', KEYS[1], 'last_error')
  if last_error then msg = msg .. '; last error: ' .. last_error end
  local ev = cjson.encode({seq = seq + 1, attempt = attempt - 1, type = 'error',
                           code = 'max_attempts_exceeded', message = msg})
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '0-' .. (seq + 1), 'd', ev)
  redis.call('PUBLISH', KEYS[3], ev)
  redis.call('HSET', KEYS[1], 'status', 'failed', 'attempt', attempt - 1, 'finished_at', ARGV[2],
             'error', cjson.encode({code = 'max_attempts_exceeded', message = msg}))
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
  return {'exhausted', attempt - 1}
end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1])
if not redis.call('HGET', KEYS[1], 'started_at') then
  redis.call('HSET', KEYS[1], 'started_at', ARGV[2])
end
local h = redis.call('HMGET', KEYS[1], 'spec', 'cancel')
return {'ok', attempt, seq, h[1], h[2] or ''}
"""
)

# KEYS: job, events, channel. ARGV: worker_id, attempt, maxlen, then (seq, json) pairs.
# -> 1 written | 0 fenced (this worker no longer owns the job) | -1 - last: nothing written,
# the log ends at seq `last`, short of these events (the caller re-sends the missing ones)
EMIT = (
    _LAST_SEQ
    + """
local h = redis.call('HMGET', KEYS[1], 'worker', 'attempt', 'status')
if h[1] ~= ARGV[1] or h[2] ~= ARGV[2] or h[3] ~= 'running' then return 0 end
local last = last_seq(KEYS[2])
local first = first_new(last, 4, #ARGV)
if first and first > last + 1 then return -1 - last end
for i = 4, #ARGV, 2 do
  if tonumber(ARGV[i]) > last then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '0-' .. ARGV[i], 'd', ARGV[i + 1])
    redis.call('PUBLISH', KEYS[3], ARGV[i + 1])
  end
end
return 1
"""
)

# KEYS: job, events, channel. ARGV: worker_id, attempt, maxlen, retention, n_events,
# then n (seq, json) pairs, then record (field, value) pairs (status among them).
# -> 1 finished | 0 fenced | -1 - last (as EMIT: nothing written)
FINISH = (
    _LAST_SEQ
    + """
local h = redis.call('HMGET', KEYS[1], 'worker', 'attempt', 'status')
if h[1] ~= ARGV[1] or h[2] ~= ARGV[2] or h[3] ~= 'running' then return 0 end
local n = tonumber(ARGV[5])
local last = last_seq(KEYS[2])
local first = first_new(last, 6, 5 + 2 * n)
if first and first > last + 1 then return -1 - last end
for i = 6, 5 + 2 * n, 2 do
  if tonumber(ARGV[i]) > last then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '0-' .. ARGV[i], 'd', ARGV[i + 1])
    redis.call('PUBLISH', KEYS[3], ARGV[i + 1])
  end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 6 + 2 * n))
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
"""
)

# KEYS: job. ARGV: worker_id, attempt, counted (1: a failed attempt; 0: a drain's hand-back),
# error. Fenced like EMIT: only the job's owner may give it back.
# -> 1 the job is `queued` again (the caller re-queues its entry) | 0 fenced
HAND_BACK = """
local h = redis.call('HMGET', KEYS[1], 'worker', 'attempt', 'status')
if h[1] ~= ARGV[1] or h[2] ~= ARGV[2] or h[3] ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued')
redis.call('HDEL', KEYS[1], 'worker')
if ARGV[3] == '0' then redis.call('HINCRBY', KEYS[1], 'handbacks', 1) end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'last_error', ARGV[4]) end
return 1
"""

# KEYS: queue. ARGV: group, consumer. A consumer is deleted only with nothing pending: XGROUP
# DELCONSUMER drops its pending entries, and a job whose entry is dropped is never reclaimed.
# -> 1 deleted | 0 kept
DELETE_IDLE_CONSUMER = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# KEYS: job, events, channel. ARGV: now, retention, maxlen. A queued job past its deadline
# ends `expired` here (its queue entry is acked when a worker reaches it: START answers
# {'expired'}); a running one is left to its worker, which checks its own jobs' deadlines.
# -> {'expired'} | {status} | {'missing'}
EXPIRE = (
    _LAST_SEQ
    + """
local h = redis.call('HMGET', KEYS[1], 'status', 'attempt')
if not h[1] then return {'missing'} end
if h[1] ~= 'queued' then return {h[1]} end
local seq = last_seq(KEYS[2]) + 1
local msg = 'the job timed out before a worker started it'
local ev = cjson.encode({seq = seq, attempt = tonumber(h[2] or '0'), type = 'error',
                         code = 'deadline_exceeded', message = msg})
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '0-' .. seq, 'd', ev)
redis.call('PUBLISH', KEYS[3], ev)
redis.call('HSET', KEYS[1], 'status', 'expired', 'finished_at', ARGV[1],
           'error', cjson.encode({code = 'deadline_exceeded', message = msg}))
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return {'expired'}
"""
)

# KEYS: job, events, channel. ARGV: now, retention, maxlen, reason.
# -> {'done'} (was queued; cancelled now, event written) | {'running', worker} | {status}
#    | {'missing'}
CANCEL = (
    _LAST_SEQ
    + """
local h = redis.call('HMGET', KEYS[1], 'status', 'worker', 'attempt')
local st = h[1]
if not st then return {'missing'} end
if st == 'queued' then
  local seq = last_seq(KEYS[2]) + 1
  local ev = cjson.encode({seq = seq, attempt = tonumber(h[3] or '0'), type = 'cancelled',
                           reason = ARGV[4]})
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '0-' .. seq, 'd', ev)
  redis.call('PUBLISH', KEYS[3], ev)
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  return {'done'}
end
if st == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', ARGV[4])
  return {'running', h[2] or ''}
end
return {st}
"""
)


@dataclass(frozen=True)
class Scripts:
    """The scripts registered on one Redis client (EVALSHA, falling back to EVAL)."""

    start: Any
    emit: Any
    finish: Any
    cancel: Any
    hand_back: Any
    delete_idle_consumer: Any
    expire: Any

    @classmethod
    def register(cls, redis: Any) -> Scripts:
        return cls(
            start=redis.register_script(START),
            emit=redis.register_script(EMIT),
            finish=redis.register_script(FINISH),
            cancel=redis.register_script(CANCEL),
            hand_back=redis.register_script(HAND_BACK),
            delete_idle_consumer=redis.register_script(DELETE_IDLE_CONSUMER),
            expire=redis.register_script(EXPIRE),
        )
