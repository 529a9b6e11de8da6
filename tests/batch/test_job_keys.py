"""A finished batch keeps its result in its own files: the jobs its lines ran leave no record
or event log behind beyond GENQ_BATCH_JOB_RETENTION_S, and none waits for compaction."""

from __future__ import annotations

import openai
import redis

from shared.keys import Keys
from shared.settings import GatewaySettings
from tests.batch.conftest import Serve, chat_line, results, run_batch

KEEP_S: int = GatewaySettings.model_fields["batch_job_retention_s"].default


def test_a_finished_batchs_jobs_leave_only_its_files(
    client: openai.OpenAI, db: redis.Redis, genq: Serve
) -> None:
    batch = run_batch(client, [chat_line(f"c{i}", f"line {i}", max_tokens=16) for i in range(3)])
    assert batch.status == "completed"
    lines = results(client, batch.output_file_id)
    job_ids = [x["response"]["request_id"] for x in lines]
    assert len(job_ids) == 3
    keys = Keys(genq.prefix)
    for job_id in job_ids:
        left = list(db.scan_iter(match=f"{genq.prefix}*{{{job_id}}}*"))
        assert left, job_id  # kept a while, for a client that streams it
        for key in left:
            assert 0 < db.ttl(key) <= KEEP_S, key
        assert db.zscore(keys.compact_due(), job_id) is None
    # what stays past that: the batch's own keys (its record, its lines' claims) and files
    lasting = [k for k in db.scan_iter(match=f"{genq.prefix}*") if not 0 < db.ttl(k) <= KEEP_S]
    assert not [k for k in lasting if any(j in k for j in job_ids)]
    files = {f for f in (batch.input_file_id, batch.output_file_id, batch.error_file_id) if f}
    tagged = {k.partition(":{")[0].rpartition(":")[2] for k in lasting if batch.id in k}
    assert tagged <= {"batch", "batchline"}, tagged
    for f in files:
        assert db.exists(keys.file(f)) and db.exists(keys.file_data(f))
