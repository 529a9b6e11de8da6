"""Who is calling: the owner their records name, and whether they may see everyone's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shared.records import ANONYMOUS, OWNERS_SINCE
from shared.settings import NO_KEY_OPTIONS, KeyOptions


class Owned(Protocol):
    """A record a key can reach: a job, a file, a batch."""

    @property
    def owner(self) -> str | None: ...

    @property
    def created_at(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Identity:
    owner: str
    """`owner_of` the caller's API key; ANONYMOUS while the API is open."""
    admin: bool = False
    """An admin key (GENQ_ADMIN_KEYS): sees and cancels every owner's records."""
    keyed: bool = False
    """API keys are configured: per-key quotas and rate limits apply."""
    weight: float = 1.0
    """Its share of the workers against other keys' under token-fair scheduling
    (GENQ_KEY_WEIGHTS)."""
    options: KeyOptions = NO_KEY_OPTIONS
    """What the keys file set for the caller's key: its own requests and tokens per minute
    (None: the settings'), and its `weight` for the scheduler (None: unset)."""

    def may_see(self, record: Owned) -> bool:
        """A record is its owner's (and the admins'); another key gets 404 for it, as for one
        that is not, and no listing shows it. Every writer names the owner (the field has no
        default). A record without one is visible to every key only if it was created before
        owners were recorded (OWNERS_SINCE): the old rule, kept for the rest of those
        records' retention. One without an owner created since is a writer's mistake: only
        admins see it, so a forgotten owner closes a record rather than opening it to all."""
        if self.admin:
            return True
        if record.owner is None:
            return record.created_at < OWNERS_SINCE
        return record.owner == self.owner


OPEN = Identity(ANONYMOUS)
"""Every caller while no API key is configured."""

GENQ = Identity("genq", admin=True)
"""genq itself, acting on any owner's record (a sweep cancelling a dead gateway's streams)."""
