-- OWNS_JOB (Cluster: TOUCH's check in the job's slot, before TOUCH_QUEUE in the queue's).
-- KEYS and ARGV: OWNS_JOB in shared/scripts.py. -> 1 | 0
if owns(K.job, A.worker, A.attempt) then return 1 end
return 0
