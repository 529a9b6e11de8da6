-- STEAL: move the jobs waiting in one worker's lane too long (or all of them, its worker
-- dead) to the model's shared queue, where any worker takes them.
-- Waiting means not yet delivered to the lane's worker: the entries after the group's
-- last-delivered id. One delivered to a worker that died is in the group's pending list and
-- is taken over by the reclaim loop of a live worker, as in any queue. A lane of a dead worker
-- that is empty and holds nothing pending is deleted and leaves K.placed_lanes.
-- KEYS and ARGV: STEAL in shared/scripts.py (A.older_ms: move entries whose id is older than
-- this many milliseconds, or than their own `wait_ms`, the wait placement found worth it;
-- A.dead: '1' moves them all and may delete the lane).
-- -> {moved, left}: entries moved, entries still waiting in the lane
if redis.call('EXISTS', K.lane) == 0 then
  redis.call('SREM', K.placed_lanes, K.lane)
  return {0, 0}
end
local last = '0-0'
local pending = 0
for _, g in ipairs(redis.call('XINFO', 'GROUPS', K.lane)) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  if info['name'] == A.group then
    last = info['last-delivered-id']
    pending = tonumber(info['pending'])
  end
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local entries = redis.call('XRANGE', K.lane, '(' .. last, '+', 'COUNT', tonumber(A.limit))
local moved = 0
local older = tonumber(A.older_ms)
for _, e in ipairs(entries) do
  local ms = tonumber(string.match(e[1], '^(%d+)'))
  local waits = older
  local f = e[2]
  for i = 1, #f - 1, 2 do
    if f[i] == 'wait_ms' then waits = math.min(older, tonumber(f[i + 1]) or older) end
  end
  if A.dead == '1' or ms + waits <= now_ms then
    redis.call('XADD', K.queue, '*', unpack(f))
    redis.call('XDEL', K.lane, e[1])
    moved = moved + 1
  end
end
local left = #entries - moved
if A.dead == '1' and left == 0 and pending == 0 and
    #redis.call('XRANGE', K.lane, '(' .. last, '+', 'COUNT', 1) == 0 then
  redis.call('DEL', K.lane)
  redis.call('SREM', K.placed_lanes, K.lane)
end
return {moved, left}
