"""Prometheus metrics under vLLM's names, labelled `model_name`.

One custom collector in a private `CollectorRegistry` renders everything at scrape time:
counters and histograms from per-model accumulators the engine feeds, gauges from a
snapshot of the fleet. Doing it this way instead of with `prometheus_client.Histogram`
lets a step record "N tokens, all with this inter-token latency" in one call: every
continuing sequence of a step waited the same time for its token, and with hundreds of
running sequences per step per-token `observe()` calls would cost more CPU than the rest
of the step.

The exposed names are exactly vLLM's (v1 engine): counters are declared without `_total`
because the exposition format appends it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

FINISH_REASONS = ("stop", "length", "abort")

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so dashboards and recording rules
# written against vLLM read the emulator unchanged.
TTFT_BUCKETS_SECONDS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS_SECONDS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_SECONDS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def token_count_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 buckets up to the model's context length."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        scale *= 10


class WeightedHistogram:
    """Histogram accumulator that can record one value many times in O(log buckets)."""

    __slots__ = ("bounds", "bucket_counts", "count", "sum")

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(float(b) for b in bounds)
        self.bucket_counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        if times <= 0:
            return
        # `le` buckets are inclusive: a value equal to a bound belongs to that bound.
        self.bucket_counts[bisect_left(self.bounds, value)] += times
        self.count += times
        self.sum += value * times

    def cumulative_buckets(self) -> list[tuple[str, float]]:
        running = 0
        out = []
        for bound, n in zip(self.bounds, self.bucket_counts, strict=False):
            running += n
            out.append((floatToGoString(bound), float(running)))
        out.append(("+Inf", float(self.count)))
        return out


class ModelMetrics:
    """Counters and histograms of one model, fed by its replicas."""

    def __init__(self, model_name: str, context_length: int):
        self.model_name = model_name
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        self.preemptions = 0
        # vLLM's prefix-cache counters, in tokens: prompt tokens looked up, and of them the
        # ones found cached (vllm:prefix_cache_queries / vllm:prefix_cache_hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        token_buckets = token_count_buckets(context_length)
        self.ttft_seconds = WeightedHistogram(TTFT_BUCKETS_SECONDS)
        self.inter_token_latency_seconds = WeightedHistogram(TOKEN_LATENCY_BUCKETS_SECONDS)
        self.request_time_per_output_token_seconds = WeightedHistogram(
            TOKEN_LATENCY_BUCKETS_SECONDS
        )
        self.e2e_request_latency_seconds = WeightedHistogram(REQUEST_LATENCY_BUCKETS_SECONDS)
        self.request_queue_time_seconds = WeightedHistogram(REQUEST_LATENCY_BUCKETS_SECONDS)
        self.request_prefill_time_seconds = WeightedHistogram(REQUEST_LATENCY_BUCKETS_SECONDS)
        self.request_decode_time_seconds = WeightedHistogram(REQUEST_LATENCY_BUCKETS_SECONDS)
        self.request_inference_time_seconds = WeightedHistogram(REQUEST_LATENCY_BUCKETS_SECONDS)
        self.request_prompt_tokens = WeightedHistogram(token_buckets)
        self.request_generation_tokens = WeightedHistogram(token_buckets)
        self.iteration_tokens = WeightedHistogram(ITERATION_TOKENS_BUCKETS)

    # -- called by the engine -------------------------------------------------------------

    def record_step(
        self,
        *,
        prefill_tokens: int,
        generated_tokens: int,
        first_token_ttfts_seconds: Iterable[float],
        inter_token_latency_seconds: float,
        continuing_tokens: int,
        recomputed_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> None:
        """`prefill_tokens` are new prompts' tokens, `cached_tokens` of them served from the
        prefix cache (counted as prompt tokens, as vLLM does, but not computed in the step);
        `recomputed_tokens` are prefilled again after a preemption: they cost step time but
        are not counted as prompt tokens twice."""
        self.prompt_tokens += prefill_tokens
        self.generation_tokens += generated_tokens
        self.iteration_tokens.observe(
            prefill_tokens - cached_tokens + recomputed_tokens + generated_tokens
        )
        for ttft_seconds in first_token_ttfts_seconds:
            self.ttft_seconds.observe(ttft_seconds)
        self.inter_token_latency_seconds.observe(inter_token_latency_seconds, continuing_tokens)

    def record_prefix_cache(self, *, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_cache_queries += queried_tokens
        self.prefix_cache_hits += hit_tokens

    def record_preemption(self) -> None:
        self.preemptions += 1

    def record_finished(
        self,
        *,
        finish_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        e2e_seconds: float,
        queue_seconds: float | None,
        prefill_seconds: float | None,
        decode_seconds: float | None,
    ) -> None:
        self.request_success[finish_reason] = self.request_success.get(finish_reason, 0) + 1
        self.e2e_request_latency_seconds.observe(e2e_seconds)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        if queue_seconds is not None:
            self.request_queue_time_seconds.observe(queue_seconds)
        if prefill_seconds is not None:
            self.request_prefill_time_seconds.observe(prefill_seconds)
        if decode_seconds is not None:
            self.request_decode_time_seconds.observe(decode_seconds)
            if prefill_seconds is not None:
                self.request_inference_time_seconds.observe(prefill_seconds + decode_seconds)
            if generation_tokens > 1:
                self.request_time_per_output_token_seconds.observe(
                    decode_seconds / (generation_tokens - 1)
                )


@dataclass(frozen=True)
class ModelGauges:
    """Instantaneous state of one model's fleet, read at scrape time."""

    model_name: str
    running: int
    waiting: int
    kv_cache_usage_fraction: float
    replicas_by_state: dict[str, int]
    step_lag_seconds: float


# (exposed name without _total/_bucket suffix, help, attribute of ModelMetrics)
_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
     "ttft_seconds"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
     "inter_token_latency_seconds"),
    # The older name of the same per-token interval; vLLM still emits both.
    ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
     "inter_token_latency_seconds"),
    ("vllm:request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request.",
     "request_time_per_output_token_seconds"),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
     "e2e_request_latency_seconds"),
    ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
     "request_queue_time_seconds"),
    ("vllm:request_prefill_time_seconds",
     "Histogram of time spent in PREFILL phase for request.", "request_prefill_time_seconds"),
    ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
     "request_decode_time_seconds"),
    ("vllm:request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request.", "request_inference_time_seconds"),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
     "request_prompt_tokens"),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.",
     "request_generation_tokens"),
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
     "iteration_tokens"),
)  # fmt: skip

REPLICA_STATES = ("ready", "starting", "draining")
# The faults that can be active (faults.ACTIVE_MODES; a crash leaves nothing to scrape).
FAULT_GAUGE_MODES = ("hang", "slow", "wrong_output")


class EmulatorCollector:
    def __init__(
        self,
        models: Callable[[], Iterable[ModelMetrics]],
        gauges: Callable[[], Iterable[ModelGauges]],
        fault_mode: Callable[[], str] | None = None,
    ):
        self._models = models
        self._gauges = gauges
        self._fault_mode = fault_mode

    def describe(self) -> list[Metric]:
        # Nothing to pre-declare; returning [] keeps the registry from calling collect()
        # at registration time, before the fleet exists.
        return []

    def collect(self) -> Iterable[Metric]:
        yield from _gauge_families(self._gauges())
        if self._fault_mode is not None:
            yield _fault_family(self._fault_mode())
        models = list(self._models())
        yield from _counter_families(models)
        yield from _histogram_families(models)


_LABELS = ["model_name"]


def _gauge_families(gauges: Iterable[ModelGauges]) -> tuple[Metric, ...]:
    """The fleet's state now, per model: requests running and waiting, KV-cache use, replicas
    by state, and how late the engine steps run."""
    running = GaugeMetricFamily(
        "vllm:num_requests_running", "Number of requests in model execution batches.",
        labels=_LABELS,
    )  # fmt: skip
    waiting = GaugeMetricFamily(
        "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
        labels=_LABELS,
    )  # fmt: skip
    kv_usage = GaugeMetricFamily(
        "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
        labels=_LABELS,
    )  # fmt: skip
    replicas = GaugeMetricFamily(
        "emulator_replicas", "Emulated engine replicas by state.",
        labels=["model_name", "state"],
    )  # fmt: skip
    lag = GaugeMetricFamily(
        "emulator_step_lag_seconds",
        "How late the most recent engine step started against its deadline; a growing "
        "value means the emulator, not the modelled engine, is the bottleneck.",
        labels=_LABELS,
    )
    for g in gauges:
        running.add_metric([g.model_name], g.running)
        waiting.add_metric([g.model_name], g.waiting)
        kv_usage.add_metric([g.model_name], g.kv_cache_usage_fraction)
        for state in REPLICA_STATES:
            replicas.add_metric([g.model_name, state], g.replicas_by_state.get(state, 0))
        lag.add_metric([g.model_name], g.step_lag_seconds)
    return running, waiting, kv_usage, replicas, lag


def _fault_family(mode: str) -> Metric:
    """Which injected fault is active in this process (1), the others 0."""
    fault = GaugeMetricFamily(
        "emulator_fault_active",
        "1 for the injected fault now active in this emulator process, else 0.",
        labels=["mode"],
    )
    for name in FAULT_GAUGE_MODES:
        fault.add_metric([name], 1.0 if mode == name else 0.0)
    return fault


def _counter_families(models: Sequence[ModelMetrics]) -> tuple[Metric, ...]:
    """Tokens, finished requests, preemptions and prefix-cache lookups, per model."""
    prompt = CounterMetricFamily(
        "vllm:prompt_tokens", "Number of prefill tokens processed.", labels=_LABELS
    )
    generation = CounterMetricFamily(
        "vllm:generation_tokens", "Number of generation tokens processed.", labels=_LABELS
    )
    success = CounterMetricFamily(
        "vllm:request_success", "Count of successfully processed requests.",
        labels=["model_name", "finished_reason"],
    )  # fmt: skip
    preemptions = CounterMetricFamily(
        "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
        labels=_LABELS,
    )  # fmt: skip
    # Counters in tokens, as vLLM's v1 PrometheusStatLogger declares them.
    prefix_queries = CounterMetricFamily(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        labels=_LABELS,
    )
    prefix_hits = CounterMetricFamily(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        labels=_LABELS,
    )
    for m in models:
        prefix_queries.add_metric([m.model_name], m.prefix_cache_queries)
        prefix_hits.add_metric([m.model_name], m.prefix_cache_hits)
        prompt.add_metric([m.model_name], m.prompt_tokens)
        generation.add_metric([m.model_name], m.generation_tokens)
        for reason, n in m.request_success.items():
            success.add_metric([m.model_name, reason], n)
        # KV is reserved on admission, so only priority preemption ever happens.
        preemptions.add_metric([m.model_name], m.preemptions)
    return prompt, generation, success, preemptions, prefix_queries, prefix_hits


def _histogram_families(models: Sequence[ModelMetrics]) -> Iterable[Metric]:
    """vLLM's histograms, per model, from the accumulators (_HISTOGRAMS)."""
    for name, documentation, attribute in _HISTOGRAMS:
        family = HistogramMetricFamily(name, documentation, labels=_LABELS)
        for m in models:
            histogram: WeightedHistogram = getattr(m, attribute)
            family.add_metric(
                [m.model_name], histogram.cumulative_buckets(), sum_value=histogram.sum
            )
        yield family


def build_registry(collector: EmulatorCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
