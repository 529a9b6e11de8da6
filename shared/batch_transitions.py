"""A batch's state transitions: the Lua scripts `batch_results`, `batch_update` and `lease`
behind typed calls, run by the same `ScriptRunner` as the job's. Each touches the keys of one
batch only (its Cluster slot: `{batch_…}`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared import scripts as lua
from shared.batches import ResultKind
from shared.keys import Keys
from shared.scripts import Arg
from shared.transitions import Call, call, lease, steps


@dataclass(frozen=True)
class LineResult:
    """One line's result, as the output or error file will hold it."""

    line: int
    kind: ResultKind
    json: str
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class ResultsWritten:
    written: int
    """Lines that had no result before this call."""
    completed: int
    failed: int


@dataclass(frozen=True)
class Updated:
    done: bool
    status: str
    """The status before (when done), else why not: the status, 'missing' or 'lease'."""


FINAL = frozenset({"completed", "failed", "expired", "cancelled"})
"""A batch's final statuses (as BATCH_UPDATE's notice names them)."""


def _results_reply(r: list[Any]) -> ResultsWritten:
    return ResultsWritten(int(r[0]), int(r[1]), int(r[2]))


def _update_reply(r: list[Any]) -> Updated:
    return Updated(bool(int(r[0])), str(r[1]))


class BatchTransitions:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    def results(
        self, batch_id: str, results: Sequence[LineResult], *, ttl_s: int
    ) -> Call[ResultsWritten]:
        """Write each line's result unless the line has one (in either file)."""
        k = self.keys
        keys = {
            "batch": k.batch(batch_id),
            "output": k.batch_results(batch_id, "out"),
            "errors": k.batch_results(batch_id, "err"),
        }
        groups: list[Arg] = []
        for r in results:
            groups += [r.line, r.kind, r.json, r.input_tokens, r.output_tokens, r.cached_tokens]
        args: dict[str, Arg] = {"ttl": ttl_s, "n": len(results)}
        return call(lua.BATCH_RESULTS, _results_reply, keys, args, groups)

    def update(
        self,
        batch_id: str,
        *,
        statuses: Sequence[str],
        fields: dict[str, str],
        lease_token: str = "",
        notify: bool = False,
    ) -> Call[Updated]:
        """Set `fields` if the status is one of `statuses` (and the lease is `lease_token`'s);
        with `notify`, a final status set tells the webhook outbox in the same step (on a
        cluster, in the step after: the outbox is in another slot)."""
        final = fields.get("status") in FINAL
        if self.keys.cluster:
            return self._update_steps(batch_id, statuses, fields, lease_token, notify and final)
        keys = {
            "batch": self.keys.batch(batch_id),
            "lease": self.keys.batch_lease(batch_id),
            "outbox": self.keys.webhook_outbox(),
        }
        args: dict[str, Arg] = {
            "token": lease_token,
            "statuses": " ".join(statuses),
            "notify": "1" if notify else "0",
            "batch_id": batch_id,
        }
        pairs = [x for kv in fields.items() for x in kv]
        return call(lua.BATCH_UPDATE, _update_reply, keys, args, pairs)

    def _update_steps(
        self,
        batch_id: str,
        statuses: Sequence[str],
        fields: dict[str, str],
        lease_token: str,
        notify: bool,
    ) -> Call[Updated]:
        k = self.keys
        keys = {"batch": k.batch(batch_id), "lease": k.batch_lease(batch_id)}
        keys["outbox"] = keys["lease"]  # not written: the notice is the next step's
        args: dict[str, Arg] = {
            "token": lease_token,
            "statuses": " ".join(statuses),
            "notify": "0",
            "batch_id": batch_id,
        }
        pairs = [x for kv in fields.items() for x in kv]

        def then(raw: Any) -> Call[Updated] | None:
            updated = _update_reply(raw)
            if not (notify and updated.done):
                return None
            return steps(self._tell(batch_id, fields["status"]), updated)

        return call(lua.BATCH_UPDATE, _update_reply, keys, args, pairs, then=then)

    def _tell(self, batch_id: str, status: str) -> list[Call[Any]]:
        """Cluster: the webhook outbox told a batch's final status, then the batch marked
        told (a stop between the status and the mark has the driver tell again: `retell`)."""
        tell: dict[str, Arg] = {"batch_id": batch_id, "status": status}
        return [
            call(lua.TELL_BATCH, int, {"outbox": self.keys.webhook_outbox()}, tell),
            call(lua.TOLD, int, {"job": self.keys.batch(batch_id)}),
        ]

    def retell(self, batch_id: str, status: str) -> Call[bool]:
        """Cluster: tell the outbox of an ended batch whose record is not marked told."""
        told = steps(self._tell(batch_id, status), True)
        assert told is not None
        return told

    def hold(self, batch_id: str, *, token: str, ttl_ms: int) -> Call[bool]:
        """Take the batch's lease, or renew it if `token` holds it."""
        return lease(self.keys.batch_lease(batch_id), token, "hold", ttl_ms)

    def free(self, batch_id: str, *, token: str) -> Call[bool]:
        return lease(self.keys.batch_lease(batch_id), token, "free")
