"""A batch's state transitions: the Lua scripts `batch_results`, `batch_update` and `lease`
behind typed calls, run by the same `ScriptRunner` as the job's. Each touches the keys of one
batch only (its Cluster slot: `{batch_…}`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared.batches import ResultKind
from shared.keys import Keys
from shared.transitions import Arg, Call, script


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
        keys = [
            k.batch(batch_id),
            k.batch_results(batch_id, "out"),
            k.batch_results(batch_id, "err"),
        ]
        args: list[Arg] = [ttl_s, len(results)]
        for r in results:
            args += [r.line, r.kind, r.json, r.input_tokens, r.output_tokens, r.cached_tokens]
        return Call(script("batch_results"), keys, args, _results_reply)

    def update(
        self,
        batch_id: str,
        *,
        statuses: Sequence[str],
        fields: dict[str, str],
        lease_token: str = "",
    ) -> Call[Updated]:
        """Set `fields` if the status is one of `statuses` (and the lease is `lease_token`'s)."""
        keys = [self.keys.batch(batch_id), self.keys.batch_lease(batch_id)]
        args: list[Arg] = [lease_token, " ".join(statuses)]
        args += [x for kv in fields.items() for x in kv]
        return Call(script("batch_update"), keys, args, _update_reply)

    def hold(self, batch_id: str, *, token: str, ttl_ms: int) -> Call[bool]:
        """Take the batch's lease, or renew it if `token` holds it."""
        args: list[Arg] = [token, "hold", ttl_ms]
        return Call(script("lease"), [self.keys.batch_lease(batch_id)], args, _truthy)

    def free(self, batch_id: str, *, token: str) -> Call[bool]:
        args: list[Arg] = [token, "free", 0]
        return Call(script("lease"), [self.keys.batch_lease(batch_id)], args, _truthy)


def _truthy(r: Any) -> bool:
    return bool(int(r))
