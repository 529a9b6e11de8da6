-- RELEASE: before a worker claims, let the next jobs of token-fair scheduling into the queue,
-- until it holds A.want entries not yet delivered (fair_release in prelude.lua).
-- KEYS and ARGV: RELEASE in shared/scripts.py.
-- -> entries released
return fair_release(K.queue, K.fair_queue, K.fair_clock, A.group, tonumber(A.want))
