"""A batch's end, exactly once: its output and error files from the lines' results, then its
final status, by the holder of its lease.

Every part can run again after the process dies: the files' ids follow from the batch's
(`result_file_id`) and a file written again replaces the earlier content whole; the status
is set by a compare-and-set (from `finalizing` or `cancelling`, under the lease), so it is set
once; and what only the running batch needed (result hashes, done stream, claims' index entry)
is dropped after that, by whoever sees the batch ended.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.batch.files import FileService
from gateway.batch.lease import Lease
from gateway.state import GatewayState
from gateway.webhooks import batch_notify
from shared.batch_transitions import BatchTransitions
from shared.batches import BatchRecord, ResultKind, result_file_id
from shared.transitions import ScriptRunner

log = logging.getLogger(__name__)

READ_RANGE = 1000
"""Result lines read per round while a file is written."""
FILE_NAMES: dict[ResultKind, str] = {"out": "output", "err": "errors"}


class Finalizer:
    def __init__(self, state: GatewayState, files: FileService) -> None:
        self.redis = state.redis
        self.keys = state.keys
        self.settings = state.settings
        self.files = files
        self.scripts = ScriptRunner(state.redis)
        self.tx = BatchTransitions(state.keys)

    async def run(self, record: BatchRecord, lease: Lease) -> bool:
        """Write the files and end the batch; False if it was not ours to end (any more)."""
        renew = lease.renew
        ids: dict[ResultKind, str | None] = {}
        for kind in ("out", "err"):
            file_id = result_file_id(record.id, kind)
            name = f"{record.id}_{FILE_NAMES[kind]}.jsonl"
            written = await self.files.write_output(
                file_id,
                name,
                self._chunks(record, kind, renew),
                record.output_ttl_s,
                owner=record.owner,  # the batch's results are its owner's alone
            )
            ids[kind] = written.id if written else None
        status = record.ending or "completed"
        fields: dict[str, object] = {"status": status, f"{status}_at": time.time()}
        if ids["out"]:
            fields["output_file_id"] = ids["out"]
        if ids["err"]:
            fields["error_file_id"] = ids["err"]
        await renew()
        call = self.tx.update(
            record.id,
            statuses=("finalizing", "cancelling"),
            fields=BatchRecord.fields(**fields),
            lease_token=lease.token,
            notify=batch_notify(self.settings),
        )
        reply = await self.scripts.run(call)
        if not reply.done:
            return False
        log.info(
            "batch ended",
            extra={
                "batch_id": record.id,
                "status": status,
                "completed": record.completed,
                "failed": record.failed,
            },
        )
        await self.clean(record.id)
        return True

    async def _chunks(
        self, record: BatchRecord, kind: ResultKind, renew: Callable[[], Awaitable[None]]
    ) -> AsyncIterator[tuple[bytes, int]]:
        """The result lines of one kind in input order, in chunks of about a file chunk."""
        key = self.keys.batch_results(record.id, kind)
        parts: list[str] = []
        size = 0
        for start in range(1, record.total + 1, READ_RANGE):
            fields = [str(n) for n in range(start, min(start + READ_RANGE, record.total + 1))]
            for value in await self.redis.hmget(key, fields):
                if value is not None:
                    parts.append(value + "\n")
                    size += len(value) + 1
            if size >= self.settings.file_chunk_bytes:
                yield "".join(parts).encode(), len(parts)
                parts, size = [], 0
                await renew()
        if parts:
            yield "".join(parts).encode(), len(parts)

    async def clean(self, batch_id: str) -> None:
        """Drop what only a running batch needs; the record stays for GENQ_BATCH_TTL_S."""
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(
            k.batch_results(batch_id, "out"),
            k.batch_results(batch_id, "err"),
            k.batch_done(batch_id),
        )
        pipe.expire(k.batch(batch_id), self.settings.batch_ttl_s)
        pipe.zrem(k.active_batches(), batch_id)
        await pipe.execute()
