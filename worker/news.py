"""The worker's cache news (`shared.records.CacheNews`): what its prefix cache took in and
dropped since the last news, and its load, sent with the flush (or beat) after a change, so
every gateway places the next job on what is true now rather than on the last heartbeat.

One message per flush at most, and only when jobs started or ended (the cache model or the
load changed): a flush of tokens alone sends none. Its page hashes are packed as in the
cache summary, 8 bytes a page."""

from __future__ import annotations

from shared.pages import pack_summary
from shared.records import CacheNews, WorkerLoad
from shared.transitions import Call
from worker.state import WorkerState


class NewsDesk:
    def __init__(self, st: WorkerState) -> None:
        self.st = st
        self._seq = 0
        self._load: WorkerLoad | None = None
        """The load the last news said."""
        self._waiting = 0
        """On a cluster: the entries in its lanes when last counted (`_counted`)."""

    def load(self) -> WorkerLoad:
        """The load fields of the heartbeat and the news (`shared.records.LOAD_FIELDS`)."""
        st = self.st
        return {
            "active": st.in_engine(),
            "waiting": len(st.waiting),
            "free": 0 if st.waiting else max(0, st.free_slots()),
            "job_s": round(st.pace.job_s, 4),
            "prefill_tps": round(st.pace.prefill_tps(), 1),
            "prefill_backlog": st.pace.backlog(),
            "prefill_serial": not st.pace.side_by_side,
        }

    def call(self) -> Call[int] | None:
        """The news of what changed since the last (its CACHE_NEWS call), or None: nothing
        did. Once made it counts as told: lost on the way, gateways see the gap in the
        versions and read the summary again."""
        st = self.st
        change = st.cache.take_news()
        load = self.load()
        if change is None and load == self._load:
            return None
        self._seq += 1
        self._load = load
        news = CacheNews(worker=st.id, seq=self._seq, **load)
        if change is not None:
            news.since, news.version = change.since, change.version
            news.added, news.dropped = pack_summary(change.added), pack_summary(change.dropped)
        else:
            news.since = news.version = st.cache.version
        k = st.keys
        lanes = [
            (k.placed(st.model, "interactive", st.id, i), k.placed(st.model, "batch", st.id, i))
            for i in range(k.shards)
        ]  # its lanes in every queue shard (one on one Redis)
        own = {lane for pair in lanes for lane in pair}
        held = sum(1 for r in st.running.values() if r.claim.queue in own)
        held += sum(1 for c in st.waiting if c.queue in own)
        return st.transitions.cache_news(
            lanes, news.encode(), held, waiting=self._waiting, counted=self._counted
        )

    def _counted(self, waiting: int) -> None:
        """On a cluster: the entries in this worker's lanes, counted after its last news was
        sent (the next news says them)."""
        self._waiting = waiting
