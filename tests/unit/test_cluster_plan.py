"""The Redis Cluster settings and slot plan: one Redis keeps every key as it was; a cluster
puts each shard's keys under a tag of its own, in evenly spaced slot ranges."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from redis.crc import key_slot

from shared.keys import Keys, shard_tags
from shared.settings import RedisSettings, Settings


def test_one_redis_keeps_every_key_as_it_was() -> None:
    k = Keys("p:")
    assert k.queue("m", "batch") == "p:queue:m:batch"
    assert k.overflow("m", "interactive") == "p:queue:m:interactive:overflow"
    assert k.deadlines() == "p:deadlines"
    assert k.recent_jobs() == "p:recent"
    assert k.compact_due() == "p:compactdue"
    assert k.placed_lanes() == "p:placed-lanes"
    assert k.placed("m", "batch", "w1") == "p:queue:m:batch:w:w1"
    assert k.shard_of("any-job") == 0


def test_shards_need_a_cluster() -> None:
    with pytest.raises(ValueError, match="Cluster"):
        Keys("p:", shards=2)
    with pytest.raises(ValidationError, match="GENQ_REDIS_CLUSTER"):
        RedisSettings(queue_shards=2)


def slot(key: str) -> int:
    return int(key_slot(key.encode()))


def test_a_shards_keys_share_its_slot_and_shards_spread_over_the_slot_range() -> None:
    k = Keys("p:", cluster=True, shards=6)
    for shard in range(6):
        keys = [
            k.queue("m", "interactive", shard),
            k.overflow("m", "batch", shard),
            k.fair_queue("other", "batch", shard),
            k.deadlines(shard),
            k.recent_jobs(shard),
            k.compact_due(shard),
            k.pending(shard),
            k.pending_since(shard),
            k.placed("m", "batch", "w", shard),
        ]
        slots = {slot(key) for key in keys}
        assert len(slots) == 1
        (s,) = slots
        assert 16384 * shard // 6 <= s < 16384 * (shard + 1) // 6 + 1
    assert len(set(shard_tags(6))) == 6
    # a job's keys are in its own slot, whatever shard its queue entry is in
    assert slot(k.job("j1")) == slot(k.events("j1")) == slot(k.channel("j1"))


def test_jobs_spread_over_shards() -> None:
    k = Keys("p:", cluster=True, shards=4)
    counts = [0] * 4
    for i in range(4000):
        counts[k.shard_of(f"job-{i}")] += 1
    assert min(counts) > 800


def test_cluster_settings() -> None:
    s = RedisSettings(redis_cluster="10.0.0.1:7000, 10.0.0.2:7000", queue_shards=3)
    assert s.redis_cluster == ["10.0.0.1:7000", "10.0.0.2:7000"]
    assert s.redis_configured
    assert RedisSettings(redis_cluster="h:1", redis_password="pw").redis_password is not None
    with pytest.raises(ValidationError, match="one way"):
        RedisSettings(redis_cluster="h:1", redis_url="redis://h:1/0")
    with pytest.raises(ValidationError, match="WAIT"):
        RedisSettings(redis_cluster="h:1", redis_wait_replicas=1)
    with pytest.raises(ValidationError, match="host:port"):
        RedisSettings(redis_cluster="nohost")
    with pytest.raises(ValidationError, match="only with GENQ_REDIS_CLUSTER"):
        RedisSettings(redis_cluster_tls=True)


def test_a_cluster_runs_placement_token_fairness_and_tokens_per_minute() -> None:
    s = Settings(redis_cluster="h:1")
    assert s.placement and s.fair_scheduling == "tokens"  # as on one Redis, by queue shard
    assert Settings(redis_cluster="h:1", tokens_per_minute_per_key=1000).tokens_per_minute_per_key
