"""Settings, a section per process, from `GENQ_*` variables; built in each entry point and
passed down (no module-level instance).

    RedisSettings                 every process: where Redis is, how to talk to it
    JobSettings                   every process that writes job state: retention, log bounds
    ├── GatewaySettings           `genq gateway`: HTTP, auth, limits, the OpenAI API
    └── WorkerSettings            `genq worker`: leases, claims, flushes, placement
        └── EngineSettings        the engine it runs (sim, exllamav2, exllamav3)
    Settings                      all of them: `genq serve` and the tools that drive both sides

A process validates only its own sections: a gateway never reads GENQ_CHAT_TEMPLATE (a
worker's file), so a path that exists only on worker hosts cannot stop it from starting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shared.keys import Keys, keys_for
from shared.model_format import engine_for_folder
from shared.webhooks import EVENT_TYPES, check_secret

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


def _key_list(v: Any) -> Any:
    """GENQ_API_KEYS (or GENQ_CORS_ORIGINS) as `k1,k2` (blanks around commas dropped) or a
    JSON list `["k1","k2"]`."""
    if not isinstance(v, str):
        return v
    if v.lstrip().startswith("["):
        return json.loads(v)
    return [k.strip() for k in v.split(",") if k.strip()]


class KeyOptions(BaseModel):
    """What a keys file's line sets for its key beside the global settings (None: the
    setting's value; 0: no limit for this key): `<key> tpm=100000 rpm=600 weight=3`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tpm: int | None = Field(default=None, ge=0)
    """Tokens per minute (GENQ_TOKENS_PER_MINUTE_PER_KEY for this key)."""
    rpm: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """Requests per minute (GENQ_RATE_LIMIT_PER_KEY × 60 for this key)."""
    weight: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """The key's share when owners are scheduled by the tokens they cost (relative)."""


NO_KEY_OPTIONS = KeyOptions()
KeysFile = dict[str, KeyOptions]
"""A keys file's keys, in file order, each with the options its line set."""


def _keys_file(path: Path, setting: str = "GENQ_API_KEYS_FILE") -> KeysFile:
    """One key per line, optionally followed by options (`name=value` words, KeyOptions) and a
    `#` comment; blank lines and `#` comment lines skipped. A key is the line's first word, so
    a file of bare keys reads as it always did. Errors name the line, never the key."""
    try:
        text = path.expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{setting}: cannot read {str(path)!r}: {exc.strerror}") from None
    keys: KeysFile = {}
    first_line: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        key, options = words[0], _key_options(words[1:], f"{setting} line {n}")
        if key in keys and keys[key] != options:
            raise ValueError(
                f"{setting} line {n}: the key of line {first_line[key]} again, with other options"
            )
        keys.setdefault(key, options)
        first_line.setdefault(key, n)
    if not keys:  # an empty file would leave the gateway open: refuse instead
        raise ValueError(f"{setting}: {str(path)!r} holds no key")
    return keys


def _key_options(words: list[str], where: str) -> KeyOptions:
    given: dict[str, str] = {}
    for word in words:
        if word.startswith("#"):
            break
        name, eq, value = word.partition("=")
        if not eq or name not in KeyOptions.model_fields:
            options = ", ".join(f"{o}=" for o in KeyOptions.model_fields)
            raise ValueError(f"{where}: {word!r} is no option (after the key: {options})")
        if name in given:
            raise ValueError(f"{where}: {name}= given twice")
        given[name] = value
    try:
        return KeyOptions.model_validate(given)
    except ValidationError as exc:
        wrong = "; ".join(
            f"{e['loc'][0]}={given[str(e['loc'][0])]!r}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(f"{where}: {wrong}") from None


class PriorityLimits(BaseModel):
    """One limit per priority; 0 = no limit. From the environment: one number for both,
    `interactive=N,batch=M` (a priority left out keeps its default), or a JSON object."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    interactive: int = Field(default=0, ge=0)
    batch: int = Field(default=0, ge=0)

    def of(self, priority: Literal["interactive", "batch"]) -> int:
        return self.interactive if priority == "interactive" else self.batch


def _priority_limits(v: Any, info: ValidationInfo) -> Any:
    if isinstance(v, int) and not isinstance(v, bool):
        return {"interactive": v, "batch": v}
    if isinstance(v, str):
        text = v.strip()
        if text.isdigit():
            return {"interactive": int(text), "batch": int(text)}
        v = json.loads(text) if text.startswith("{") else _limit_pairs(text)
    if not isinstance(v, dict):
        return v
    assert info.field_name is not None
    default = GatewaySettings.model_fields[info.field_name].default
    return {**default.model_dump(), **v} if isinstance(default, PriorityLimits) else v


def _limit_pairs(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"{part!r} is not priority=limit (e.g. interactive=1000,batch=0)")
        out[name.strip()] = value.strip()
    return out


WAIT_TIMEOUT_MS = 100
"""A submit's WAIT on loopback costs about a millisecond (measured: docs/performance.md,
"Redis Sentinel failover"); this bound only matters while a replica is slow or gone."""
_SENTINEL_ONLY = ("redis_sentinel_master", "redis_sentinel_password")
_SENTINEL_OR_CLUSTER = ("redis_password", "redis_username")


def sentinel_address(address: str) -> tuple[str, int]:
    """`host:port` (`[v6]:port` for IPv6) as a pair; ValueError naming a bad one."""
    host, sep, port = address.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"sentinel {address!r} is not host:port (e.g. 10.0.0.1:26379)")
    return host, int(port)


class RedisSettings(BaseSettings):
    model_config = _CONFIG

    redis_url: str | None = Field(
        default=None,
        description="redis://… of the shared Redis; unset means `genq serve` embeds one",
    )
    key_prefix: str = Field(
        default="genq:",
        description="prefix of every Redis key genq writes (deployments sharing a Redis "
        "differ here)",
    )
    redis_socket_timeout_s: float = Field(
        default=10.0,
        description="a Redis reply not in after this long breaks the connection (the call "
        "is retried)",
    )
    redis_health_check_s: float = Field(
        default=15.0, description="a pooled connection idle this long is PINGed before its next use"
    )
    redis_retries: int = Field(
        default=5,
        description="retries of a Redis call after a connection error or timeout (backoff between)",
    )
    redis_max_connections: int = Field(
        default=256, ge=4, description="connections in each process's Redis pool"
    )
    redis_pool_timeout_s: float = Field(
        default=10.0, gt=0, description="wait this long for a free pooled connection"
    )

    # Sentinel: where the master is found instead of a URL (README "Redis Sentinel")
    redis_sentinels: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Redis Sentinels as host:port, comma-separated (or a JSON list): every "
        "client then asks them for the master and follows it through failovers; not with "
        "redis_url",
    )
    redis_sentinel_master: str | None = Field(
        default=None,
        description="the master's name in the sentinels' config (`sentinel "
        "monitor NAME …`); required with redis_sentinels",
    )
    redis_sentinel_password: SecretStr | None = Field(
        default=None, description="the sentinels' own password (their requirepass), if any"
    )
    redis_password: SecretStr | None = Field(
        default=None,
        description="with redis_sentinels or redis_cluster: the Redis nodes' password; with "
        "redis_url the password goes in the URL",
    )
    redis_username: str | None = Field(
        default=None,
        description="with redis_sentinels or redis_cluster: the nodes' ACL user, if not default",
    )

    # Cluster: seed nodes instead of a URL (docs/deploy.md "Redis Cluster")
    redis_cluster: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Redis Cluster seed nodes as host:port, comma-separated (or a JSON list): "
        "clients learn the slot map from them and follow it; not with redis_url or "
        "redis_sentinels",
    )
    redis_cluster_tls: bool = Field(
        default=False, description="with redis_cluster: connect to every node over TLS"
    )
    queue_shards: int = Field(
        default=1,
        ge=1,
        le=64,
        description="streams each model's queue of each priority is split over, in different "
        "Cluster slots (gateways spread submits, workers read all); more than 1 only with "
        "redis_cluster",
    )
    redis_wait_replicas: int | None = Field(
        default=None,
        ge=0,
        description="replicas that must hold a job before its submit is answered 2xx "
        "(Redis WAIT after the submit); default 1 with redis_sentinels, else 0 (off)",
    )
    redis_wait_timeout_ms: int = Field(
        default=WAIT_TIMEOUT_MS,
        ge=1,
        description="how long a submit waits for those replicas; a submit still unreplicated "
        "then is answered anyway, with a warning logged",
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

    @field_validator("redis_sentinels", "redis_cluster", mode="before")
    @classmethod
    def _sentinel_list(cls, v: Any) -> Any:
        return _key_list(v)

    @field_validator("redis_sentinels", "redis_cluster")
    @classmethod
    def _sentinels_are_addresses(cls, v: list[str]) -> list[str]:
        for address in v:
            sentinel_address(address)  # ValueError naming it
        return v

    @model_validator(mode="after")
    def _one_way_to_redis(self) -> RedisSettings:
        if self.redis_wait_timeout_ms >= self.redis_socket_timeout_s * 1000:
            raise ValueError(
                "GENQ_REDIS_WAIT_TIMEOUT_MS must be under GENQ_REDIS_SOCKET_TIMEOUT_S, or a "
                "submit's WAIT would time out its connection"
            )
        if self.redis_cluster:
            return self._cluster_ok()
        if self.queue_shards > 1:
            raise ValueError(
                "GENQ_QUEUE_SHARDS above 1 needs GENQ_REDIS_CLUSTER (on one Redis, shards "
                "would only split one thread's work)"
            )
        if self.redis_cluster_tls:
            raise ValueError("GENQ_REDIS_CLUSTER_TLS: only with GENQ_REDIS_CLUSTER")
        if not self.redis_sentinels:
            names_given = (*_SENTINEL_ONLY, *_SENTINEL_OR_CLUSTER)
            given = [n for n in names_given if getattr(self, n) is not None]
            if given:
                names = ", ".join(f"GENQ_{n.upper()}" for n in given)
                raise ValueError(
                    f"{names}: only with GENQ_REDIS_SENTINELS (with GENQ_REDIS_URL, put the "
                    "password and user in the URL: redis://USER:PASSWORD@HOST:6379/0)"
                )
            return self
        if self.redis_url:
            raise ValueError(
                "GENQ_REDIS_URL and GENQ_REDIS_SENTINELS: give one, not both (with sentinels "
                "the master is found through them; its password: GENQ_REDIS_PASSWORD)"
            )
        if not self.redis_sentinel_master:
            raise ValueError(
                "GENQ_REDIS_SENTINELS needs GENQ_REDIS_SENTINEL_MASTER, the name the "
                "sentinels monitor the master under"
            )
        return self

    def _cluster_ok(self) -> RedisSettings:
        if self.redis_url or self.redis_sentinels:
            raise ValueError(
                "GENQ_REDIS_CLUSTER with GENQ_REDIS_URL or GENQ_REDIS_SENTINELS: give one way "
                "to Redis (a cluster's password: GENQ_REDIS_PASSWORD)"
            )
        given = [n for n in _SENTINEL_ONLY if getattr(self, n) is not None]
        if given:
            names = ", ".join(f"GENQ_{n.upper()}" for n in given)
            raise ValueError(f"{names}: only with GENQ_REDIS_SENTINELS")
        if self.redis_wait_replicas:
            raise ValueError(
                "GENQ_REDIS_WAIT_REPLICAS with GENQ_REDIS_CLUSTER: a submit spans several "
                "primaries, and WAIT counts one connection's writes to one of them"
            )
        return self

    def keys(self) -> Keys:
        """The key builder of this deployment (its prefix; the slot plan on a cluster)."""
        return keys_for(self.key_prefix, bool(self.redis_cluster), self.queue_shards)

    @property
    def redis_configured(self) -> bool:
        """A shared Redis is named, by URL, through sentinels, or as a cluster."""
        return bool(self.redis_url or self.redis_sentinels or self.redis_cluster)

    @property
    def wait_replicas(self) -> int:
        """Replicas a submit waits for (GENQ_REDIS_WAIT_REPLICAS, or its default)."""
        if self.redis_wait_replicas is not None:
            return self.redis_wait_replicas
        return 1 if self.redis_sentinels else 0

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
    event_log_maxlen: int = Field(
        default=100_000,
        ge=100,
        description="events kept in a job's event log, the replay streams resume from",
    )
    event_compact_grace_s: int = Field(
        default=300,
        ge=0,
        description="how long a finished job keeps its whole event log; then a gateway "
        "replaces it by a compact form in the job's record (the text, token ids and logprobs, "
        "and where each event's text begins), from which a resume with any Last-Event-ID gets "
        "the same text and final event",
    )
    recent_jobs: int = Field(
        default=1000,
        ge=0,
        description="entries kept in the recent-jobs stream the dashboard lists (two a job: "
        "its submission and its end); 0: none written",
    )
    shutdown_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="after SIGTERM or Ctrl-C: how long a worker lets its running jobs finish "
        "before it hands them back to the queue (a job whose streams are all gone goes back at "
        "once), and a gateway lets its open streams end with their jobs before it ends each "
        "with a `server_stopping` error; `genq serve` uses 5 unless this is set",
    )


class WebhookEndpoint(BaseModel):
    """One deployment-wide webhook endpoint (GENQ_WEBHOOKS), as OpenAI's project webhooks:
    its URL, its signing secret and the event types it wants."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(pattern=r"^https?://[^\s/?#]+[^\s]*$", max_length=2048)
    secret: SecretStr
    events: list[str] = Field(min_length=1)

    @field_validator("events")
    @classmethod
    def _known(cls, events: list[str]) -> list[str]:
        unknown = sorted(set(events) - EVENT_TYPES)
        if unknown:
            raise ValueError(f"unknown webhook event types {unknown}; known: {sorted(EVENT_TYPES)}")
        return events

    @field_validator("secret")
    @classmethod
    def _signs(cls, secret: SecretStr) -> SecretStr:
        check_secret(secret.get_secret_value())
        return secret


class GatewaySettings(JobSettings):
    webhooks: list[WebhookEndpoint] = Field(
        default_factory=list,
        description="webhook endpoints told of ends (JSON list of {url, secret, events}): "
        "events among job.succeeded/failed/cancelled/expired, response.completed/failed/"
        "cancelled/incomplete, batch.completed/failed/expired/cancelled",
    )
    webhook_secret: SecretStr | None = Field(
        default=None,
        description="signs the events sent to a job's own `webhook` (whsec_ and base64, as "
        "OpenAI's); a job naming a webhook is refused while it is unset",
    )
    webhook_allow_http: bool = Field(
        default=False, description="webhook URLs may be http (otherwise https only)"
    )
    webhook_allow_hosts: list[str] = Field(
        default_factory=list,
        description="hosts, addresses or networks (CIDR) webhooks may reach although they are "
        "loopback, private or link-local (refused otherwise)",
    )
    webhook_timeout_s: float = Field(
        default=10.0, gt=0, le=60, description="one webhook delivery attempt, connect to answer"
    )
    webhook_retry_window_s: float = Field(
        default=259_200.0,
        gt=0,
        description="how long a webhook event is retried (72 h, as OpenAI) before it goes to "
        "the dead letters",
    )
    webhook_backoff_s: float = Field(
        default=5.0, gt=0, description="first retry of a failed delivery; it doubles each time"
    )
    webhook_backoff_max_s: float = Field(
        default=3600.0, gt=0, description="longest wait between two attempts of one delivery"
    )
    webhook_max_response_bytes: int = Field(
        default=65_536, ge=0, description="most of a webhook receiver's answer read"
    )
    webhook_concurrency: int = Field(
        default=16, ge=1, le=256, description="webhook deliveries in flight at once"
    )
    webhook_lease_s: float = Field(
        default=30.0,
        gt=0,
        description="the gateway process sending webhooks holds a lease this long, renewed "
        "each third of it; if it dies another takes over after it (and sends again what it "
        "was sending: at least once)",
    )
    webhook_poll_s: float = Field(
        default=0.25, gt=0, description="how often the sending gateway looks for due events"
    )
    idempotency_ttl_s: int = Field(
        default=86_400, ge=1, description="how long an Idempotency-Key keeps naming its job"
    )
    access_log: bool = Field(
        default=True,
        description="one info line per HTTP request (method, route, status, duration, job "
        "ids; a stream's when it ends); off at request rates where the lines cost too much",
    )
    max_body_bytes: int = Field(
        default=16 * 2**20,
        ge=1024,
        description="largest request body (bytes); a bigger one is refused with 413 while it "
        "is read, before it is parsed",
    )
    max_prompt_chars: int = Field(
        default=2_000_000,
        ge=1,
        description="longest prompt (characters; for chat, the messages' content together), "
        "checked before tokenizing",
    )
    prepare_threads: int = Field(
        default=4,
        ge=1,
        description="requests tokenized (or chat templates rendered) at once, each in a "
        "thread off the event loop; more wait their turn",
    )
    max_metadata_bytes: int = Field(
        default=16_384, ge=0, description="largest `metadata` of a job, in bytes of JSON"
    )
    max_constraint_bytes: int = Field(
        default=262_144,
        ge=1024,
        description="largest constraint of a job (a JSON schema, regex, grammar or tool "
        "list, in bytes of JSON), refused before it is compiled",
    )
    max_constraint_depth: int = Field(
        default=64,
        ge=2,
        description="deepest nesting of a JSON schema constraint (objects and lists)",
    )
    constraint_cache_size: int = Field(
        default=1024,
        ge=0,
        description="constraints a gateway process keeps compiled and checked (by hash): "
        "one sent again is not compiled again",
    )
    default_max_tokens: int = Field(
        default=256,
        ge=1,
        description="max_tokens of a request that names none (at most what its context leaves)",
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="accepted API keys, comma-separated (or a JSON list); with no "
        "api_keys_file either, the API is open",
    )
    api_keys_file: Path | None = Field(
        default=None,
        description="file of accepted API keys, read at start, added to api_keys: one a "
        "line, optionally followed by its own limits and weight (`<key> tpm=100000 rpm=600 "
        "weight=3`: tokens per minute, requests per minute, its share in scheduling; 0 = no "
        "limit for this key; docs/limits.md); blank lines and # comments skipped",
    )
    auth_fail_limit: int = Field(
        default=20,
        ge=0,
        description="failed authentications (a missing or wrong API key) one client address "
        "may make per auth_fail_window_s, in each gateway process, before its next are "
        "answered 429 with Retry-After; a valid key is never counted nor refused; 0 = no limit",
    )
    auth_fail_window_s: float = Field(
        default=60.0,
        gt=0,
        description="the window auth_fail_limit counts in: an address's count starts at its "
        "first failure and is forgotten when the window ends",
    )
    auth_fail_max_clients: int = Field(
        default=10_000,
        ge=1,
        description="client addresses each gateway process counts failures of (an IPv6 "
        "address counts as its /64); past it, the one that failed least recently is forgotten",
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="origins a browser may call the API from, comma-separated (or a JSON "
        "list); `*` allows any; none: no CORS headers",
    )
    sse_keepalive_s: float = Field(
        default=15.0,
        gt=0,
        description="a stream with no event for this long gets an SSE comment (proxies keep it)",
    )
    stream_idle_poll_s: float = Field(
        default=300.0,
        gt=0,
        description="a stream that heard nothing of its job this long looks at the end of "
        "the job's event log anyway (one read; each wait jittered from half to one and a "
        "half times this, so streams do not read together): a safety net for a change no "
        "message announces, such as a log evicted from Redis. New events, a gap, and a "
        "pub/sub reconnect make a stream read at once; waiting costs Redis nothing",
    )
    card_cache_s: float = Field(
        default=2.0, ge=0, description="a gateway reuses a model card read from Redis this long"
    )
    fair_scheduling: Literal["tokens", "jobs"] = Field(
        default="tokens",
        description="how keyed owners share a model's workers: `tokens`, by the tokens their "
        "jobs cost (max_tokens + uncached prompt tokens x GENQ_FAIR_PREFILL_WEIGHT), weighted "
        "per key, start-time fair queueing; `jobs`, by jobs in flight (GENQ_FAIR_SHARE_JOBS, "
        "then an overflow stream)",
    )
    fair_window: int = Field(
        default=4,
        ge=1,
        description="token-fair scheduling: jobs released into a model's queue ahead of "
        "workers' claims (what a blocked worker wakes on); the order between owners holds "
        "beyond it",
    )
    fair_prefill_weight: float = Field(
        default=0.02,
        ge=0,
        description="token-fair scheduling: what an uncached prompt token costs against a "
        "generated one (prefill is that much cheaper per token than decoding)",
    )
    key_weights: dict[str, Annotated[float, Field(gt=0, le=1000)]] = Field(
        default_factory=dict,
        description="token-fair scheduling: API key → its weight (JSON object; a key not "
        "named weighs 1): with weights 3 and 1, two backlogged keys get 3/4 and 1/4 of the "
        "tokens",
    )
    fair_share_jobs: int = Field(
        default=16,
        ge=0,
        description="jobs one owner (API key) may have in flight for a model and priority "
        "before its next ones wait in the overflow stream behind other owners' (0 = off)",
    )
    event_compact_sweep_s: float = Field(
        default=1.0,
        gt=0,
        description="how often one gateway compacts the event logs of jobs finished longer "
        "than GENQ_EVENT_COMPACT_GRACE_S ago",
    )
    placement: bool = Field(
        default=True,
        description="cache-aware placement: a job whose prompt a worker's prefix cache holds "
        "(or whose conversation key hashes to it) waits in that worker's own lane, a bounded "
        "time, instead of the shared queue",
    )
    placement_wait_s: float = Field(
        default=2.0,
        ge=0,
        description="longest a placed job waits in its worker's lane before any worker may "
        "take it (the steal deadline); a dead worker's lane is emptied at once",
    )
    placement_max_load: float = Field(
        default=1.0,
        gt=0,
        description="a worker this loaded (jobs running, waiting and just placed, over its "
        "batch size) gets no placed job: it goes to the shared queue",
    )
    placement_min_pages: int = Field(
        default=1,
        ge=1,
        description="pages of 256 tokens a worker's cache must hold of a prompt to place it",
    )
    placement_refresh_s: float = Field(
        default=0.5,
        gt=0,
        description="how often a gateway process reads workers' beats and changed cache summaries",
    )
    placement_sweep_s: float = Field(
        default=0.1,
        gt=0,
        description="how often one gateway moves jobs past the steal deadline (and a dead "
        "worker's) from worker lanes to the shared queues",
    )
    deadline_sweep_s: float = Field(
        default=1.0,
        gt=0,
        description="how often one gateway ends jobs past their deadline that no live worker "
        "will end (queued ones, those of dead workers)",
    )
    queue_models: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="models whose queues and consumer groups the gateway creates at start, "
        "before any worker of theirs has run (JSON list): a queue autoscaler such as KEDA "
        "scaling workers from zero reads the group, and a missing one is an error to it; a "
        "request for one no worker has registered yet is a 503 `model_starting`, not a 404 "
        "(`genq serve` names its model here)",
    )

    # streams: what one stream may hold, and when a client that stopped reading is let go
    stream_buffer_bytes: int = Field(
        default=262_144,
        ge=4096,
        description="live events one stream holds for a client that has not read them yet; "
        "past it the stream drops them and reads them from the job's event log as the "
        "client catches up, so a slow client costs Redis reads, not gateway memory",
    )
    stream_stall_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="a stream none of whose writes completes this long (its client stopped "
        "reading) is disconnected, as nginx's send_timeout",
    )
    stream_catchup_per_s: float = Field(
        default=5000.0,
        gt=0,
        description="after the gateway's pub/sub connection is made again (messages sent "
        "while it was down are lost), its streams each look at their job's log, this many a "
        "second rather than all at once, so many open streams do not stampede Redis",
    )
    stream_retry_s: float = Field(
        default=1.0,
        gt=0,
        description="a stream whose log read failed reads again after this long, the wait "
        "doubling while reads keep failing, up to stream_idle_poll_s",
    )
    event_page_entries: int = Field(
        default=256,
        ge=1,
        description="entries read from a job's event log at once (stream refills, the text "
        "so far of a running job)",
    )
    partial_text_max_chars: int = Field(
        default=1_000_000,
        ge=1,
        description="GET of a job without a result (running): the most characters of its "
        "text so far read from its event log; past it `text_truncated` is true",
    )
    cancel_wait_s: float = Field(
        default=1.0,
        ge=0,
        description="DELETE of a running job waits this long for its worker to stop it, "
        "then answers `running` with `cancel_requested: true`",
    )

    # gateway presence: jobs streamed with cancel-on-disconnect die with their gateway
    gateway_heartbeat_s: float = Field(
        default=1.0, gt=0, description="how often a gateway process says it is alive"
    )
    gateway_lease_s: float = Field(
        default=5.0, gt=0, description="a gateway process silent this long is gone"
    )
    orphan_grace_s: float = Field(
        default=10.0,
        ge=0,
        description="a job streamed with cancel-on-disconnect by a gateway that is gone is "
        "cancelled this long after the gateway's lease ran out, unless its client resumed "
        "it through /v1/jobs/{id}/events",
    )

    # metrics (gateway/metrics.py, gateway/fleet.py)
    metrics_require_key: bool = Field(
        default=False,
        description="GET /metrics needs an admin key (GENQ_ADMIN_KEYS); off: open, as "
        "Prometheus scrapes expect (its labels name models and workers, never jobs or keys)",
    )
    metrics_fleet_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="how often the gateway exporting the fleet's gauges (queues, workers, "
        "dead letters, batches) reads them from Redis and renews its lease",
    )
    metrics_fleet_lease_s: float = Field(
        default=15.0,
        gt=0,
        description="an exporter of the fleet's gauges silent this long is replaced by "
        "another gateway process",
    )

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
        description="429 while a model holds this many interactive jobs queued or running "
        "(native and OpenAI API alike; the lower of this and max_queued_jobs wins); 0 = no limit",
    )

    # Admission: see README "Keys, quotas and limits". Jobs count from their submission to
    # their end (queued or running); tokens are prompt + max_tokens.
    admin_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="API keys that may also see and cancel every owner's jobs, "
        "comma-separated (or a JSON list); accepted like api_keys",
    )
    admin_keys_file: Path | None = Field(
        default=None,
        description="file of admin keys (one a line, with options as in api_keys_file), "
        "read at start",
    )
    max_queued_jobs: Annotated[PriorityLimits, NoDecode] = Field(
        default=PriorityLimits(interactive=10_000, batch=1_000_000),
        description="per model and priority, all keys together: jobs queued or running "
        "(429 past it)",
    )
    max_queued_tokens: Annotated[PriorityLimits, NoDecode] = Field(
        default=PriorityLimits(),
        description="per model and priority, all keys together: prompt + max_tokens of the "
        "jobs queued or running",
    )
    max_queued_jobs_per_key: Annotated[PriorityLimits, NoDecode] = Field(
        default=PriorityLimits(interactive=1_000, batch=0),
        description="per model and priority, per API key (only while API keys are set): jobs "
        "queued or running",
    )
    max_queued_tokens_per_key: Annotated[PriorityLimits, NoDecode] = Field(
        default=PriorityLimits(),
        description="per model and priority, per API key (only while API keys are set): "
        "prompt + max_tokens of the jobs queued or running",
    )
    rate_limit_per_key: float = Field(
        default=0.0,
        ge=0,
        description="requests per second each API key may make, sustained, shared by all "
        "gateways (only while API keys are set); 0 = no limit",
    )
    rate_limit_burst: int = Field(
        default=0,
        ge=0,
        description="requests a key may make at once above its rate; 0 = one second's worth",
    )
    tokens_per_minute_per_key: int = Field(
        default=0,
        ge=0,
        description="tokens (prompt + max_tokens, charged when a job is admitted) each API key's "
        "jobs may cost per minute, shared by all gateways (only while API keys are set; batch "
        "jobs not counted); a key's `tpm=` in the keys file overrides it; 0 = no limit",
    )
    redis_memory_limit: float = Field(
        default=0.9,
        ge=0,
        le=1,
        description="refuse new jobs (503) once Redis uses this share of its maxmemory, "
        "before Redis refuses writes; 0 = no check (nor without a maxmemory)",
    )
    redis_memory_check_s: float = Field(
        default=1.0, gt=0, description="how long a gateway process trusts one memory reading"
    )
    retry_after_s: int = Field(
        default=2, ge=1, description="Retry-After of a 429 or 503 when genq cannot tell better"
    )
    quota_recheck_s: float = Field(
        default=600.0,
        gt=0,
        description="an admitted job still counted after this long is checked: one that "
        "ended unseen (e.g. by an older worker) stops counting",
    )
    quota_repair_s: float = Field(
        default=10.0, gt=0, description="how often a gateway process runs those checks"
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
    dashboard: bool = Field(
        default=True, description="serve /dashboard (behind an admin key when keys are set)"
    )
    dashboard_interval_s: float = Field(
        default=0.5,
        ge=0.05,
        description="how often a gateway process reads the fleet for its dashboard viewers "
        "(once for all of them, only while one is connected)",
    )
    dashboard_jobs: int = Field(default=50, ge=1, le=1000, description="recent jobs shown")
    dashboard_batches: int = Field(default=10, ge=0, le=200, description="recent batches shown")
    dashboard_session_s: int = Field(
        default=43_200, ge=60, description="how long the dashboard's login cookie lasts"
    )

    _default_template = field_validator("default_chat_template")(_template_text)
    _split_keys = field_validator("api_keys", "admin_keys", "cors_origins", mode="before")(
        _key_list
    )
    _split_limits = field_validator(
        "max_queued_jobs",
        "max_queued_tokens",
        "max_queued_jobs_per_key",
        "max_queued_tokens_per_key",
        mode="before",
    )(_priority_limits)
    _file_keys: KeysFile = PrivateAttr(default_factory=dict)
    """Kept apart from api_keys: settings passed on to child processes as GENQ_* never carry
    them (each child reads the file itself)."""
    _admin_file_keys: KeysFile = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _read_keys_file(self) -> GatewaySettings:
        if self.api_keys_file is not None:
            self._file_keys = _keys_file(self.api_keys_file)
        if self.admin_keys_file is not None:
            self._admin_file_keys = _keys_file(self.admin_keys_file, "GENQ_ADMIN_KEYS_FILE")
        both = self._file_keys.keys() & self._admin_file_keys.keys()
        if any(self._file_keys[k] != self._admin_file_keys[k] for k in both):
            raise ValueError(
                "a key in both GENQ_API_KEYS_FILE and GENQ_ADMIN_KEYS_FILE has other options "
                "in each"
            )
        return self

    @model_validator(mode="after")
    def _lease_outlasts_beats(self) -> GatewaySettings:
        if self.gateway_lease_s <= self.gateway_heartbeat_s:
            raise ValueError("gateway_lease_s must be longer than gateway_heartbeat_s")
        return self

    @model_validator(mode="after")
    def _metrics_settings(self) -> GatewaySettings:
        if self.metrics_fleet_lease_s <= self.metrics_fleet_interval_s:
            raise ValueError("metrics_fleet_lease_s must be longer than metrics_fleet_interval_s")
        if self.metrics_require_key and not self.admin_api_keys:
            raise ValueError(
                "metrics_require_key needs an admin key (GENQ_ADMIN_KEYS or GENQ_ADMIN_KEYS_FILE)"
            )
        return self

    @property
    def admin_api_keys(self) -> list[str]:
        """Keys that may see and cancel every job: GENQ_ADMIN_KEYS and GENQ_ADMIN_KEYS_FILE."""
        return [*self.admin_keys, *self._admin_file_keys]

    @property
    def accepted_api_keys(self) -> list[str]:
        """Every key the API accepts: GENQ_API_KEYS, GENQ_API_KEYS_FILE and the admin keys;
        none = open."""
        return [*self.api_keys, *self._file_keys, *self.admin_api_keys]

    def key_options(self, key: str) -> KeyOptions:
        """What the keys files set for `key` (nothing for a key from GENQ_API_KEYS)."""
        return self._file_keys.get(key) or self._admin_file_keys.get(key) or NO_KEY_OPTIONS

    @property
    def per_key_rates(self) -> bool:
        """Some key has a request rate or tokens-per-minute limit (while keys are set)."""
        if self.rate_limit_per_key or self.tokens_per_minute_per_key:
            return True
        files = (*self._file_keys.values(), *self._admin_file_keys.values())
        return any(o.rpm or o.tpm for o in files)


CPU_LIST = r"^[0-9][0-9,\- ]*$"
"""A Linux cpulist (`0-3,8`), as GENQ_CPUS and GENQ_ENGINE_CPUS take it."""


class EngineSettings(BaseSettings):
    model_config = _CONFIG

    engine: Literal["sim", "exllamav2", "exllamav3"] = Field(
        default="sim",
        description="sim without a model; with one, default: as its folder says "
        "(shared/model_format.py: EXL3 → exllamav3, EXL2 → exllamav2, plain fp16/bf16 → the "
        "faster of the two)",
    )
    model_dir: str | None = Field(
        default=None,
        description="the model folder (EXL2, EXL3, or plain fp16/bf16 safetensors); unset: the sim "
        "engine",
    )
    model_name: str | None = Field(
        default=None,
        description="the name clients ask for; default: the model folder's name (`sim` for sim)",
    )
    max_batch: int = Field(default=256, ge=1, description="jobs the engine generates at once")
    chat_template: str | None = Field(
        default=None,
        description="Jinja chat template (inline, or a file path) for the model card",
    )

    # exllamav2 only: its sampler
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

    # exllamav2 and exllamav3
    cache_tokens: int | None = Field(default=None, ge=256, description="default: fit the batch")
    cache_mode: Literal["FP16", "Q4", "Q6", "Q8"] = Field(
        default="FP16",
        description="the K/V cache's precision (quantized: more tokens in the same memory)",
    )
    max_seq_len: int | None = Field(default=None, ge=16, description="default: the model's")
    max_chunk_size: int = Field(
        default=2048,
        ge=16,
        description="most prompt tokens prefilled in one forward pass (clamped to the cache)",
    )
    gpu_split: str | None = Field(
        default=None, description="GB per GPU, e.g. '20,24'; default auto"
    )

    # exllamav3
    prefill_cooldown: int = Field(
        default=0,
        ge=0,
        description="exllamav3: decode steps between two prefill passes while other jobs "
        "generate; 0 = a prefill pass on every step. On an H200 (EXL3 8B, 64 and 128 streams) "
        "exllamav3's own 4 gave 28-47 % fewer tokens/s and 1.3-9.6x the time to first token "
        "(measured: docs/performance.md)",
    )
    shared_chunk_size: int | None = Field(
        default=None,
        ge=256,
        description="exllamav3: prefill chunk while other jobs generate (rounded to 256 "
        "tokens, at most max_chunk_size); default: max_chunk_size (exllamav3's own: half). "
        "512 on an H200 gave 12-29 % fewer tokens/s at 64 and 128 streams",
    )
    batched_sampling: bool = Field(
        default=True,
        description="exllamav3: sample the jobs without penalties or top logprobs in one "
        "batched pass per step (genq's GPU sampler) instead of one exllamav3 sampler launch per "
        "job. On an H200 (EXL3 8B, against the stock bare loop) the worker went from 0.93x to "
        "1.12x at 256 streams and 1.01-1.10x to 1.08-1.22x at 64-128 (measured: "
        "docs/performance.md); smaller passes: GENQ_BATCHED_SAMPLING_MIN_JOBS",
    )
    batched_sampling_min_jobs: int = Field(
        default=16,
        ge=1,
        description="exllamav3: the batched pass samples a decode step only when it serves at "
        "least this many jobs; in smaller steps each job launches its own sampler, which costs "
        "less there (0.05 ms a job against the pass's 0.54 ms at one stream, H200) and gave "
        "1.03-1.09x the tokens/s at one stream on an fp16 8B (measured: docs/performance.md)",
    )
    triton_cache_dir: str | None = Field(
        default=None,
        description="exllamav3: where Triton keeps compiled kernels (TRITON_CACHE_DIR), on a "
        "disk that outlives the worker so a restart skips the JIT; default: Triton's own "
        "(~/.triton/cache)",
    )

    torch_threads: int = Field(
        default=1,
        ge=1,
        description="exllamav2 and exllamav3: torch's CPU threads in the engine process "
        "(torch.set_num_threads). The generator's step is bound by the one thread launching "
        "kernels; torch's default pool (one thread per CPU, or per CPU of a pinned worker) "
        "spins beside it on the generator's small CPU tensors and slowed an exllamav3 "
        "64-stream step from 43 to 75 ms on an H200 (measured: docs/performance.md)",
    )

    engine_cpus: str | None = Field(
        default=None,
        pattern=CPU_LIST,
        description="CPUs the engine process runs on (Linux cpulist, e.g. 7); default: its "
        "worker's. Its step is one thread launching kernels, for hosts that keep a core for "
        "it; on an H200 host the gain was within that host's drift (measured: "
        "docs/performance.md)",
    )
    step_profile_s: float = Field(
        default=0.0,
        ge=0,
        description="every this many seconds while it steps, the engine process logs an "
        "`engine profile` line: its steps and their time since the last line, and what genq's "
        "hook spent in them on the GPU engines (the constraint masks' wait, their copy, the "
        "tokens' consumes, the edits, the batched pass); 0: never",
    )

    # sim
    sim_step_ms: float = Field(
        default=20.0, ge=0, description="sim engine: milliseconds per decode step"
    )
    sim_prefill_ms_per_1k: float = Field(
        default=5.0, ge=0, description="sim engine: milliseconds of prefill per 1,000 prompt tokens"
    )
    sim_prefill_chunk_tokens: int = Field(
        default=0,
        ge=0,
        description="sim engine: prefill one job after another, at most this many prompt "
        "tokens a step, each step taking their prefill time on top of its decode (as a GPU "
        "engine does); 0: every job's prefill runs beside the others', costing no step time",
    )
    sim_max_seq_len: int = Field(
        default=8192, ge=16, description="sim engine: its context length in tokens"
    )
    sim_cache_tokens: int = Field(
        default=262_144,
        ge=0,
        description="sim engine: its prefix cache, in tokens (pages of 256 named by their "
        "hash chain, least recently used dropped first; a job's cached prompt pages cost no "
        "prefill time and count as usage's cached tokens); 0: none",
    )
    sim_poison_marker: str | None = Field(
        default=None,
        min_length=1,
        description="test-only fault injection: the sim engine fails every attempt of a job "
        "whose prompt contains this string (off unless set)",
    )

    _template = field_validator("chat_template")(_template_text)

    @model_validator(mode="after")
    def _engine_follows_model(self) -> EngineSettings:
        """A model directory means the engine its format calls for, unless one was named."""
        if self.model_dir and "engine" not in self.model_fields_set:
            self.engine = engine_for_folder(self.model_dir)
        return self


class WorkerSettings(JobSettings, EngineSettings):
    worker_id: str | None = Field(
        default=None,
        description="this worker's id in Redis (heartbeat, consumer); default: host-pid-random",
    )
    max_attempts: int = Field(
        default=3,
        ge=1,
        description="a job runs at most this many times (its worker dying or its engine failing "
        "counts; a Redis error does not), then it is dead-lettered",
    )
    max_interruptions: int = Field(
        default=5,
        ge=0,
        description="a job interrupted by a stop of its worker (handed back to the queue "
        "unfinished) more than this many times fails with `interrupted` when a worker next "
        "takes it, instead of carrying over from restart to restart; an interruption costs no "
        "attempt",
    )
    heartbeat_s: float = Field(
        default=1.0,
        gt=0,
        description="how often a worker writes its heartbeat and renews its lease",
    )
    lease_s: float = Field(
        default=5.0,
        gt=0,
        description="a worker whose lease is this old is dead: other workers reclaim its jobs",
    )
    claim_block_ms: int = Field(
        default=1000, ge=1, description="how long a worker's blocking read of the queues waits"
    )
    redis_start_timeout_s: float = Field(
        default=120.0,
        ge=0,
        description="a worker whose Redis has not answered this long after it started gives "
        "up and exits non-zero (a wrong address fails the deploy instead of hanging; it says "
        "that it waits every few seconds meanwhile); 0 = wait for ever",
    )
    log_repair_window_s: float = Field(
        default=10.0,
        ge=0,
        description="a worker keeps the events it wrote this long, to re-send them if Redis "
        "restarts without its last writes (AOF everysec loses up to ~2 s on a host crash)",
    )
    log_summary_interval_s: float = Field(
        default=60.0,
        ge=0,
        description="a worker logs a summary line this often: jobs running and finished, "
        "tokens/s, batch slots and KV cache pages in use, claims waiting; 0 = never",
    )
    flush_interval_ms: float = Field(
        default=15.0,
        ge=0,
        description="least time between event flushes (first tokens and "
        "job ends go at once); tokens produced meanwhile fold into one event per job",
    )
    batch_flush_interval_ms: float = Field(
        default=100.0,
        ge=0,
        description="least time between event flushes of batch-priority jobs (their first "
        "tokens and ends wait for it too; cancels and failures go at once), and how long a "
        "running one's tokens wait before they are written: fewer, larger writes per job "
        "(one for a job this short), where nobody waits on each token",
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
    interactive_reserve: int = Field(
        default=16,
        ge=0,
        description="batch slots a worker keeps free for interactive jobs (at most a quarter "
        "of its batch), so one arriving behind a batch backlog starts at once",
    )
    owner_reserve: int = Field(
        default=4,
        ge=0,
        description="slots a worker keeps from the owner (API key) holding the most of its "
        "batch while another owner's jobs started on it within owner_reserve_window_s (at "
        "most a quarter of its batch; 0 = off): that owner's next job starts at once, not "
        "when a slot of the first comes free",
    )
    owner_reserve_window_s: float = Field(
        default=30.0,
        gt=0,
        description="how long after another owner's last job started a worker keeps the "
        "owner reserve",
    )
    overflow_share: int = Field(
        default=4,
        ge=1,
        description="when a priority's queue and its overflow (owners past their fair share) "
        "both have work, every Nth claim of it takes from the overflow",
    )
    engine_process: bool = Field(
        default=True,
        description="run the engine in a process of its own, beside the worker's I/O process "
        "(false: on a thread of the worker process, sharing its interpreter: tests, debugging)",
    )
    engine_stall_s: float = Field(
        default=30.0,
        gt=0,
        description="an engine process that holds jobs and sends no step for this long is "
        "killed and restarted (its jobs handed back, as when it dies)",
    )
    detokenize: Literal["engine", "worker"] = Field(
        default="engine",
        description="where a job's text is made and its stop strings matched: in the engine, "
        "or in the worker's I/O process from the token ids (the engine stops on stop tokens "
        "and lengths; a stop string found by the worker cancels the job in the engine)",
    )
    engine_gc_in_steps: bool = Field(
        default=True,
        description="the engine process's garbage collector runs while it steps (false: "
        "only while it has no job)",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="port of the worker's own HTTP server: /healthz and /readyz for probes, "
        "/metrics for Prometheus; unset = no server. The launcher gives its Nth process port + N",
    )
    metrics_host: str | None = Field(
        default=None, description="address that server binds; default: every interface"
    )

    # worker processes (the launcher)
    cpu_affinity: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="pin each launched worker process to cores of its own (on its GPU's NUMA "
        "node where known); auto: when the launcher runs several exllamav2 processes",
    )
    auto_procs_max: int = Field(
        default=1,
        ge=1,
        description="--procs-per-gpu auto: the most worker processes per GPU with GPU sampling "
        "(fewer where memory or cores allow fewer; 4 with GPU sampling off); the processes "
        "sweep on docs/performance.md is what sets it (2 processes: 0.72x one on multi-turn "
        "chat, 0.99-1.11x at 256 streams)",
    )
    restart_limit: int = Field(
        default=5,
        ge=0,
        description="the launcher restarts a worker process that dies at most this many times "
        "within GENQ_RESTART_WINDOW_S; one more death stops that process alone (the others go "
        "on, the gateways' /readyz names it); once none is left, the launcher exits non-zero, "
        "so that systemd or Kubernetes sees the crash loop (0: never restart)",
    )
    gpu_memory_gib: float | None = Field(
        default=None,
        gt=0,
        description="GiB of each GPU the launcher shares among its worker processes (weights, "
        "cache, overhead); default: what NVML or nvidia-smi says is free before they start",
    )
    restart_window_s: float = Field(
        default=600.0,
        gt=0,
        description="the window GENQ_RESTART_LIMIT counts one worker process's restarts in; "
        "deaths further apart are restarted without end",
    )
    cpus: str | None = Field(
        default=None,
        pattern=CPU_LIST,
        description="CPUs this worker process runs on (Linux cpulist, e.g. 0-3,16-19); the "
        "launcher sets it per process",
    )


class Settings(GatewaySettings, WorkerSettings):
    """Every section: `genq serve` (gateway and worker in one place) and the tools."""
