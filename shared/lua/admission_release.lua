-- ADMISSION_RELEASE: a job seen ended (or gone) stops counting, if it still does.
-- KEYS: admission counts, jobs, checks. ARGV: the job's record key. -> 1 released | 0
return release(KEYS[1], KEYS[2], KEYS[3], ARGV[1])
