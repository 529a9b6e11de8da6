"""The OpenAI Files and Batches API on genq's queue.

routes      thin HTTP routes: /v1/files, /v1/batches
files       uploads (streamed, checked line by line, stored), listing, content, delete
lines       one input line checked as the live endpoint checks its body (openai.serving)
storage     where file contents live: the FileStore protocol, in Redis by default
service     create, look up, list and cancel batches
driver      each gateway's loop that moves batches on, one lease-holder per batch: queue
            the next chunk of lines, sweep, cancel or expire, finalize
tracker     each gateway's loop that writes a line's result when its job ends
results     a job's record and events as the line of an output or error file
finalize    the output and error files, and the batch's end, written exactly once
"""
