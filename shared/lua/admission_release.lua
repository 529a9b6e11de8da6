-- ADMISSION_RELEASE: a job seen ended (or gone) stops counting, if it still does.
-- KEYS and ARGV: ADMISSION_RELEASE in shared/scripts.py. -> 1 released | 0
return release(K.counts, K.jobs, K.checks, A.job_key)
