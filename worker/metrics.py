"""A worker process's Prometheus metrics, served at `/metrics` on its own HTTP server
(worker/http.py, `GENQ_METRICS_PORT`), labelled `model`, `worker` and `gpu`.

Names and buckets are vLLM's (vllm/v1/metrics/loggers.py) with the `genq_` prefix, so that
dashboards and alerts written for vLLM read genq with the prefix changed. Where the worker
knows what vLLM's engine knows:
  - per job, where its end is written (flush phase): queue time (submitted → started here),
    time to first token and end-to-end latency (from submission; the gateway's clock),
    prefill (started → first token) and decode (first token → end) time, prompt and
    generation tokens, and `genq_request_success_total{finished_reason}` (stop, length,
    abort for a cancel); jobs that failed or expired count in `genq_request_failure_total`;
    kept as plain numbers (`Plain`) and made metrics only when scraped;
  - per engine output with tokens: the inter-token latency (the time since the job's last
    output, spread over the tokens it brings) and the generation tokens, as plain numbers
    (`TokenStats`) made metrics only when scraped;
  - at scrape time only (no cost between scrapes): jobs running and waiting here, and the KV
    cache in use as the worker's admission counts it (worker/admission.py), never asked of
    the engine process;
  - genq's own counters: attempts started, attempts that failed (back to the queue), queue
    entries reclaimed from dead workers, jobs dead-lettered.

One recorder per `Worker`, each with its own registry: tests and `genq serve` may run
several workers in one process.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client import generate_latest as render
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from worker.engine import StepOutput
from worker.http import HttpServer, Response
from worker.jobstate import RunningJob

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0),
    *(40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The text format every Prometheus reads (prometheus_client's newest names 1.0.0)."""
LABELS = ["model", "worker", "gpu"]
ABORT = "abort"
"""vLLM's finished_reason of a request stopped by its client: genq's cancelled jobs."""

Snapshot = Callable[[], tuple[int, int, float]]
"""Jobs running, claims waiting to start, KV cache in use (0 to 1), read at scrape time."""


def buckets_1_2_5(most: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, … up to `most` (vLLM's token-count buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > most:
                return out
            out.append(float(m * scale))
        scale *= 10


class WorkerMetrics:
    def __init__(
        self, model: str = "", worker: str = "", gpu: str = "", max_seq_len: int = 8192
    ) -> None:
        # as vLLM: a `_created` series per series doubles the text (prometheus_client: untyped)
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.labels = (model, worker, gpu)
        self.snapshot: Snapshot = lambda: (0, 0, 0.0)
        self.tokens = TokenStats()
        # Per job (and per start) too, plain numbers made metrics when scraped, as per token:
        # prometheus-client's observe and inc (a lock each) were a quarter of what the worker
        # spends on a job of a few tokens (measured: docs/performance.md, "Tiny jobs").
        lat = REQUEST_LATENCY_BUCKETS
        tokens = buckets_1_2_5(max_seq_len)
        self.ttft = Plain("genq_time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.e2e = Plain("genq_e2e_request_latency_seconds", "Submission to end.", lat)
        self.queue = Plain("genq_request_queue_time_seconds", "Submission to start here.", lat)
        self.prefill = Plain("genq_request_prefill_time_seconds", "Start to first token.", lat)
        self.decode = Plain("genq_request_decode_time_seconds", "First token to end.", lat)
        self.prompt_hist = Plain("genq_request_prompt_tokens", "Prompt tokens per job.", tokens)
        self.generation_hist = Plain(
            "genq_request_generation_tokens", "Generated tokens per job.", tokens
        )
        self.prompt_tokens = Plain("genq_prompt_tokens", "Prompt tokens of jobs ended here.")
        self.prefix_queries = Plain(
            "genq_prefix_cache_queries",
            "Prompt tokens looked up in the engine's prefix cache (jobs ended here; vLLM's name).",
        )
        self.prefix_hits = Plain(
            "genq_prefix_cache_hits",
            "Prompt tokens the engine found in its prefix cache and did not prefill again.",
        )
        self.hit_ratio = (0, 0)
        """(hits, queries) since start: `genq_prefix_cache_hit_ratio` at scrape."""
        # at 0 from the start: alerts see them
        self._success = dict.fromkeys(("stop", "length", ABORT), 0)
        self._failure = dict.fromkeys(("failed", "expired"), 0)
        self.attempts = Plain("genq_attempts", "Attempts of jobs started here.")
        self.attempt_failures = Plain(
            "genq_attempt_failures", "Attempts that failed here and went back to the queue."
        )
        self.reclaims = Plain("genq_reclaims", "Queue entries taken over from dead workers.")
        self.dead_lettered = Plain("genq_dead_lettered", "Jobs dead-lettered here.")
        r.register(_Gauges(self))

    # ---- the hot path: once per engine output of a running job ----------------------------

    def output(self, run: RunningJob, out: StepOutput) -> None:
        n = len(out.token_ids)
        if not n:
            return
        now = time.perf_counter()
        tokens = self.tokens
        tokens.generated += n
        if run.last_output_s:  # the first tokens' latency is the TTFT, not an inter-token one
            gap = (now - run.last_output_s) / n
            tokens.itl_counts[bisect_left(ITL_BUCKETS, gap)] += n
            tokens.itl_sum += gap * n
        run.last_output_s = now

    # ---- once per job ----------------------------------------------------------------------

    def ended(self, run: RunningJob) -> None:
        """A job whose end this worker wrote."""
        created, started = run.spec.created_at, run.started_wall
        end, first = run.ended_wall or time.time(), run.first_token_wall
        self.e2e.observe(max(0.0, end - created))
        self.queue.observe(max(0.0, started - created))
        if first is not None:
            self.ttft.observe(max(0.0, first - created))
            self.prefill.observe(max(0.0, first - started))
            self.decode.observe(max(0.0, end - first))
        prompt = run.prompt_tokens or len(run.spec.input_ids)
        self.prompt_tokens.inc(prompt)
        cached = min(run.cached_tokens, prompt)
        self.prefix_queries.inc(prompt)
        self.prefix_hits.inc(cached)
        self.hit_ratio = (self.hit_ratio[0] + cached, self.hit_ratio[1] + prompt)
        self.prompt_hist.observe(prompt)
        self.generation_hist.observe(len(run.resumed_ids) + len(run.token_ids))
        outcome = run.outcome or "failed"
        if outcome in ("stop", "length", "cancelled"):
            reason = ABORT if outcome == "cancelled" else outcome
            self._success[reason] = self._success.get(reason, 0) + 1
        else:
            self._failure[outcome] = self._failure.get(outcome, 0) + 1

    def families(self) -> Iterator[Metric]:
        """The per-job numbers as metrics (at scrape time)."""
        labels = list(self.labels)
        for plain in (self.ttft, self.e2e, self.queue, self.prefill, self.decode):
            yield plain.family(labels)
        for plain in (self.prompt_hist, self.generation_hist, self.prompt_tokens):
            yield plain.family(labels)
        for plain in (self.prefix_queries, self.prefix_hits):
            yield plain.family(labels)
        for name, doc, by, label in (
            (
                "genq_request_success",
                "Jobs that ended here with a finish reason (abort: cancelled).",
                self._success,
                "finished_reason",
            ),
            (
                "genq_request_failure",
                "Jobs that ended here failed or expired.",
                self._failure,
                "status",
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=[*LABELS, label])
            for key, n in by.items():
                family.add_metric([*labels, key], n)
            yield family
        for plain in (self.attempts, self.attempt_failures, self.reclaims, self.dead_lettered):
            yield plain.family(labels)

    # ---- serving ---------------------------------------------------------------------------

    def render(self) -> bytes:
        return render(self.registry)

    async def respond(self) -> Response:
        return Response(200, self.render(), CONTENT_TYPE)


class Plain:
    """A counter (no `buckets`) or a histogram kept as plain numbers, made a metric family
    only when scraped; `inc` and `observe` are an addition (and a bucket index)."""

    __slots__ = ("_bounds", "buckets", "counts", "doc", "name", "sum")

    def __init__(self, name: str, doc: str, buckets: Sequence[float] = ()) -> None:
        self.name, self.doc = name, doc
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        """Per bucket: index i counts values in (bucket i-1, bucket i]; the last, above all."""
        self.sum: float = 0
        self._bounds = [*(floatToGoString(b) for b in self.buckets), "+Inf"]  # type: ignore[no-untyped-call]

    def inc(self, amount: float = 1) -> None:
        self.sum += amount

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value

    def family(self, labels: list[str]) -> Metric:
        if not self.buckets:
            counter = CounterMetricFamily(self.name, self.doc, labels=LABELS)
            counter.add_metric(labels, self.sum)
            return counter
        hist = HistogramMetricFamily(self.name, self.doc, labels=LABELS)
        cumulative = list(accumulate(self.counts))
        hist.add_metric(labels, list(zip(self._bounds, cumulative, strict=True)), self.sum)
        return hist


@dataclass(slots=True)
class TokenStats:
    """What is recorded per token, kept as plain numbers and turned into metrics only when
    scraped: prometheus_client's Histogram.observe and Counter.inc (a lock, a bucket scan)
    cost 0.7 µs a token more, about twice the engine boundary's whole cost per token
    (measured: docs/performance.md, "Metrics")."""

    generated: int = 0
    itl_counts: list[int] = field(default_factory=lambda: [0] * (len(ITL_BUCKETS) + 1))
    """Inter-token latencies per bucket: index i counts those in (bucket i-1, bucket i]."""
    itl_sum: float = 0.0

    def families(self, labels: list[str]) -> Iterator[Metric]:
        generated = CounterMetricFamily(
            "genq_generation_tokens", "Tokens generated here.", labels=LABELS
        )
        generated.add_metric(labels, self.generated)
        yield generated
        itl = HistogramMetricFamily(
            "genq_inter_token_latency_seconds", "Inter-token latency.", labels=LABELS
        )
        cumulative = list(accumulate(self.itl_counts))
        bounds = [*(repr(b) for b in ITL_BUCKETS), "+Inf"]
        itl.add_metric(labels, list(zip(bounds, cumulative, strict=True)), self.itl_sum)
        yield itl


class _Gauges:
    """The gauges read from the worker's state when scraped, and the per-token numbers."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        running, waiting, kv = self.metrics.snapshot()
        labels = list(self.metrics.labels)
        yield from self.metrics.tokens.families(labels)
        yield from self.metrics.families()

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, value)
            return family

        yield gauge("genq_num_requests_running", "Jobs running in the engine here.", running)
        yield gauge("genq_num_requests_waiting", "Claims here waiting to start.", waiting)
        hits, queries = self.metrics.hit_ratio
        yield gauge(
            "genq_prefix_cache_hit_ratio",
            "Share of prompt tokens served from the engine's prefix cache, jobs ended here "
            "since the worker started (0 to 1; the counters give it over any window).",
            hits / queries if queries else 0.0,
        )
        yield gauge(
            "genq_kv_cache_usage_perc",
            "KV-cache in use, 1 = 100 % (the worker's admission count; 0 for an engine "
            "without pages, the sim).",
            kv,
        )


class MetricsRoute:
    """`/metrics` on the worker's HTTP server from its start (while the model loads: empty),
    then the worker's recorder once it exists."""

    def __init__(self) -> None:
        self.metrics: WorkerMetrics | None = None

    def install(self, server: HttpServer) -> None:
        server.route("/metrics", self.respond)

    def attach(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics

    async def respond(self) -> Response:
        if self.metrics is None:
            return Response(200, b"", CONTENT_TYPE)
        return await self.metrics.respond()
