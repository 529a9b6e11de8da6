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
if attempt > tonumber(ARGV[3]) then
  local msg = 'the job was attempted ' .. (attempt - 1) .. ' times (max_attempts ' .. ARGV[3] .. ')'
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
# -> 1 written | 0 fenced (this worker no longer owns the job)
EMIT = (
    _LAST_SEQ
    + """
local h = redis.call('HMGET', KEYS[1], 'worker', 'attempt', 'status')
if h[1] ~= ARGV[1] or h[2] ~= ARGV[2] or h[3] ~= 'running' then return 0 end
local last = last_seq(KEYS[2])
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
# -> 1 finished | 0 fenced
FINISH = (
    _LAST_SEQ
    + """
local h = redis.call('HMGET', KEYS[1], 'worker', 'attempt', 'status')
if h[1] ~= ARGV[1] or h[2] ~= ARGV[2] or h[3] ~= 'running' then return 0 end
local n = tonumber(ARGV[5])
local last = last_seq(KEYS[2])
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

# KEYS: job, events, channel. ARGV: now, retention, maxlen, reason.
# -> {'ok'} (was queued: now cancelled) | {'running', worker} | {status} | {'missing'}
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
  return {'ok'}
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

    @classmethod
    def register(cls, redis: Any) -> Scripts:
        return cls(
            start=redis.register_script(START),
            emit=redis.register_script(EMIT),
            finish=redis.register_script(FINISH),
            cancel=redis.register_script(CANCEL),
        )
