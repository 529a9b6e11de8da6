"""The OpenAI Files and Batches API on genq's queue.

routes      thin HTTP routes: /v1/files, /v1/batches
files       the Files API: uploads, listing, content, delete; the files a batch writes
upload      one upload in progress: streamed, checked line by line, stored in chunks
multipart   a multipart/form-data body read as it arrives
lines       one input line checked as the live endpoint checks its body (openai.serving)
storage     where file contents live: the FileStore protocol, in Redis by default
listing     OpenAI's list pages over a sorted-set index
service     create, look up, list and cancel batches
runtime     what the lifespan starts: the services, the driver's and tracker's loops
driver      each gateway's loop that moves batches on, one lease holder per batch
lease       that lease
queueing    a chunk of input lines into the model's queue, once
closing     open lines resolved: the sweep, and a batch that expires or is cancelled
finalize    the output and error files, and the batch's end, exactly once
tracker     each gateway's loop that writes a line's result when its job ends
results     a job's record (and events) as the line of an output or error file
"""
