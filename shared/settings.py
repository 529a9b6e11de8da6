"""Settings, a section per process, from `GENQ_*` variables; built in each entry point and
passed down (no module-level instance).

    RedisSettings                 every process: where Redis is, how to talk to it
    JobSettings                   every process that writes job state: retention, log bounds
    ├── GatewaySettings           `genq gateway`: HTTP, auth, limits, the OpenAI API
    └── WorkerSettings            `genq worker`: leases, claims, flushes, placement
        └── EngineSettings        the engine it runs (sim, exllamav2)
    Settings                      all of them: `genq serve` and the tools that drive both sides

A process validates only its own sections: a gateway never reads GENQ_CHAT_TEMPLATE (a
worker's file), so a path that exists only on worker hosts cannot stop it from starting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_CONFIG = SettingsConfigDict(env_prefix="GENQ_", extra="ignore")

LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "text", "json"]


def _template_text(v: str | None) -> str | None:
    """A value without `{` names a template file: read it now, so a typo stops the start."""
    if v is None or "{" in v:
        return v
    path = Path(v).expanduser()
    if not path.is_file():
        raise ValueError(f"no chat template file at {v!r} (inline templates contain '{{')")
    return path.read_text(encoding="utf-8")


class RedisSettings(BaseSettings):
    model_config = _CONFIG

    redis_url: str | None = Field(
        default=None,
        description="redis://… of the shared Redis; unset means `genq serve` embeds one",
    )
    key_prefix: str = "genq:"
    redis_socket_timeout_s: float = 10.0
    redis_health_check_s: float = 15.0
    redis_retries: int = 5
    redis_max_connections: int = Field(default=256, ge=4)
    redis_pool_timeout_s: float = Field(
        default=10.0, gt=0, description="wait this long for a free pooled connection"
    )
    log_level: LogLevel = Field(
        default="info", description="least level logged; `--log-level` overrides it"
    )
    log_format: LogFormat = Field(
        default="auto",
        description="auto: human-readable lines (local time) when stderr is a terminal, else "
        "JSON, one object per line; text or json: always that",
    )

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v  # GENQ_LOG_LEVEL=INFO is common

    @field_validator("key_prefix")
    @classmethod
    def _prefix_is_safe(cls, v: str) -> str:
        if not v or any(c in v for c in " {}*?"):
            raise ValueError(
                "key_prefix must be non-empty and free of spaces, braces and glob chars"
            )
        return v


class JobSettings(RedisSettings):
    retention_s: int = Field(default=86_400, ge=1, description="TTL of a finished job's keys")
    event_log_maxlen: int = Field(default=100_000, ge=100)
    shutdown_grace_s: float = Field(default=30.0, ge=0)


class GatewaySettings(JobSettings):
    idempotency_ttl_s: int = Field(default=86_400, ge=1)
    max_prompt_chars: int = Field(default=2_000_000, ge=1)
    max_metadata_bytes: int = Field(default=16_384, ge=0)
    default_max_tokens: int = Field(default=256, ge=1)
    api_keys: list[str] = Field(
        default_factory=list, description="accepted bearer tokens; empty = open"
    )
    sse_keepalive_s: float = Field(default=15.0, gt=0)
    stream_idle_poll_s: float = Field(
        default=2.0, gt=0, description="a stream silent this long re-reads the event log"
    )
    card_cache_s: float = Field(default=2.0, ge=0)

    # OpenAI-compatible API
    default_chat_template: str | None = Field(
        default=None,
        description="Jinja chat template (inline, or a file path) for models whose card has none",
    )
    openai_cancel_on_disconnect: bool = Field(
        default=True, description="a client that disconnects cancels its jobs, queued or running"
    )
    openai_max_jobs: int = Field(
        default=32, ge=1, description="most jobs one request may start (n x prompts)"
    )
    openai_max_queue_depth: int = Field(
        default=0,
        ge=0,
        description="429 while the model's interactive queue holds this many jobs; 0 = no limit",
    )

    # OpenAI Files and Batches API
    file_max_bytes: int = Field(
        default=200 * 1024 * 1024,
        ge=1,
        description="largest file upload, in bytes (OpenAI's: 200 MB); 413 beyond it",
    )
    batch_max_lines: int = Field(
        default=50_000,
        ge=1,
        description="most requests in a batch input file (OpenAI's: 50,000); 413 beyond it",
    )
    file_ttl_s: int = Field(
        default=30 * 86_400, ge=60, description="how long files are kept (OpenAI: 30 days)"
    )
    batch_ttl_s: int = Field(
        default=30 * 86_400, ge=60, description="how long a batch's record is kept once it ended"
    )
    file_chunk_bytes: int = Field(
        default=256 * 1024,
        ge=1024,
        description="files are stored in chunks of whole lines of about this size; a batch is "
        "queued a chunk at a time",
    )
    batch_max_in_flight: int = Field(
        default=10_000,
        ge=1,
        description="most jobs of one batch queued or running at once; its other lines wait "
        "in its input file (bounds Redis memory per batch)",
    )
    batch_lease_s: float = Field(
        default=10.0,
        gt=0,
        description="a gateway driving a batch (queueing, cancelling, finalizing) that is "
        "silent this long loses it to another gateway",
    )
    batch_loops: bool = Field(
        default=True,
        description="this gateway moves batches on (queueing, results, finalizing); off, it "
        "only serves the API (every batch route works either way): run the loops in "
        "gateways of their own to keep their CPU away from interactive requests",
    )
    batch_poll_s: float = Field(
        default=0.5, gt=0, description="how often each gateway looks for batch work"
    )
    batch_sweep_s: float = Field(
        default=30.0,
        gt=0,
        description="a batch that made no progress this long has its open lines' jobs looked "
        "at directly (a safety net under the job-end notifications)",
    )
    batch_claim_idle_s: float = Field(
        default=10.0,
        gt=0,
        description="job-end notifications read by a gateway that died are taken over by "
        "another after this long",
    )
    batch_job_retention_s: int = Field(
        default=60,
        ge=1,
        description="a batch's job keeps its record and event log this long once its result "
        "is in the batch (instead of GENQ_RETENTION_S): about 8 KB a job while kept",
    )

    _default_template = field_validator("default_chat_template")(_template_text)


class EngineSettings(BaseSettings):
    model_config = _CONFIG

    engine: Literal["sim", "exllamav2"] = "sim"
    model_dir: str | None = None
    model_name: str | None = None
    max_batch: int = Field(default=256, ge=1)
    chat_template: str | None = Field(
        default=None,
        description="Jinja chat template (inline, or a file path) for the model card",
    )

    # exllamav2
    sampling_threads: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="threads sampling logits on the CPU; default: the CPUs this process may "
        "use (its pinned set, when the launcher pinned it), at most 16",
    )
    gpu_sampling: bool = Field(
        default=True,
        description="sample on the GPU (temperature, top_k, top_p, min_p); jobs with "
        "penalties or top logprobs still go to exllamav2's CPU sampler",
    )
    cache_tokens: int | None = Field(default=None, ge=256, description="default: fit the batch")
    cache_mode: Literal["FP16", "Q4", "Q6", "Q8"] = "FP16"
    max_seq_len: int | None = Field(default=None, ge=16, description="default: the model's")
    max_chunk_size: int = Field(default=2048, ge=16)
    gpu_split: str | None = Field(
        default=None, description="GB per GPU, e.g. '20,24'; default auto"
    )

    # sim
    sim_step_ms: float = Field(default=20.0, ge=0)
    sim_prefill_ms_per_1k: float = Field(default=5.0, ge=0)
    sim_max_seq_len: int = Field(default=8192, ge=16)
    sim_poison_marker: str | None = Field(
        default=None,
        min_length=1,
        description="test-only fault injection: the sim engine fails every attempt of a job "
        "whose prompt contains this string (off unless set)",
    )

    _template = field_validator("chat_template")(_template_text)

    @model_validator(mode="after")
    def _engine_follows_model(self) -> EngineSettings:
        """A model directory means the real engine unless an engine was named."""
        if self.model_dir and "engine" not in self.model_fields_set:
            self.engine = "exllamav2"
        return self


class WorkerSettings(JobSettings, EngineSettings):
    worker_id: str | None = None
    max_attempts: int = Field(default=3, ge=1)
    heartbeat_s: float = Field(default=1.0, gt=0)
    lease_s: float = Field(default=5.0, gt=0)
    claim_block_ms: int = Field(default=1000, ge=1)
    log_repair_window_s: float = Field(
        default=10.0,
        ge=0,
        description="a worker keeps the events it wrote this long, to re-send them if Redis "
        "restarts without its last writes (AOF everysec loses up to ~2 s on a host crash)",
    )
    flush_interval_ms: float = Field(
        default=15.0,
        ge=0,
        description="least time between event flushes (first tokens and "
        "job ends go at once); tokens produced meanwhile fold into one event per job",
    )
    gil_switch_interval_s: float | None = Field(
        default=None,
        gt=0,
        description="sys.setswitchinterval in worker processes; default 0.5 ms for the sim "
        "engine (pure-Python steps starve Redis I/O otherwise), CPython's 5 ms for exllamav2 "
        "(measured faster: its long Python stretches suffer from frequent hand-overs)",
    )
    batch_share: int = Field(
        default=4, ge=1, description="when both queues have work, every Nth claim takes a batch job"
    )

    # worker processes (the launcher)
    cpu_affinity: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="pin each launched worker process to cores of its own (on its GPU's NUMA "
        "node where known); auto: when the launcher runs several exllamav2 processes",
    )
    cpus: str | None = Field(
        default=None,
        pattern=r"^[0-9][0-9,\- ]*$",
        description="CPUs this worker process runs on (Linux cpulist, e.g. 0-3,16-19); the "
        "launcher sets it per process",
    )


class Settings(GatewaySettings, WorkerSettings):
    """Every section: `genq serve` (gateway and worker in one place) and the tools."""
