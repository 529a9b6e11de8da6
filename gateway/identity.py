"""Who is calling: the owner their jobs record, and whether they may see everyone's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shared.records import ANONYMOUS


class Owned(Protocol):
    @property
    def owner(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class Identity:
    owner: str
    """`owner_of` the caller's API key; ANONYMOUS while the API is open."""
    admin: bool = False
    """An admin key (GENQ_ADMIN_KEYS): sees and cancels every owner's jobs."""
    keyed: bool = False
    """API keys are configured: per-key quotas and rate limits apply."""

    def may_see(self, record: Owned) -> bool:
        """A job is its owner's (and the admins'). One recorded before owners were (no
        owner) stays visible to every caller, as it was, for the rest of its retention."""
        return self.admin or record.owner is None or record.owner == self.owner


OPEN = Identity(ANONYMOUS)
"""Every caller while no API key is configured."""

GENQ = Identity("genq", admin=True)
"""genq itself, acting on any owner's job (a sweep cancelling a dead gateway's streams)."""
