-- RELEASE: before a worker claims, let the next jobs of token-fair scheduling into the queue,
-- until it holds A.want entries not yet delivered (fair_release in prelude.lua). A.skip
-- (owners joined by ',', '' for none): owners whose jobs stay queued; then K.queue is the
-- worker's own lane, and the others' jobs go there out of turn: first those released into
-- the shared queue K.shared and not yet delivered, then the next in token-fair order; the
-- lane joins K.placed_lanes as a placed job's does (the steal sweep and a dead worker's
-- hand-back see it).
-- KEYS and ARGV: RELEASE in shared/scripts.py.
-- -> entries released
local skip = {}
for owner in A.skip:gmatch('[^,]+') do skip[owner] = true end
local want = tonumber(A.want)
local moved = 0
if A.skip ~= '' then moved = take_undelivered(K.shared, K.queue, A.group, want, skip) end
moved = moved + fair_release(K.queue, K.fair_queue, K.fair_clock, A.group, want, skip)
if moved > 0 and A.skip ~= '' then redis.call('SADD', K.placed_lanes, K.queue) end
return moved
