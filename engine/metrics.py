"""Prometheus metrics under vLLM's names, so existing dashboards, KEDA triggers and the Gateway
API Inference Extension read kvfleet engines unchanged. Every series carries `model_name`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.kv_event_stream import KVEventStreams
from kvfleet.engine.outputs import LORA_LOAD_BUCKETS, EngineStats, LoRAStats, RequestOutput
from kvfleet.engine.startup_timing import StartupTimer
from kvfleet.engine.structured_output import GrammarStats
from kvfleet.telemetry import metric_names

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


def _gauge(name: str, doc: str, label: list[str], value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=[metric_names.MODEL_NAME])
    g.add_metric(label, value)
    return g


def _counter(name: str, doc: str, label: list[str], value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=[metric_names.MODEL_NAME])
    c.add_metric(label, value)
    return c


class _EngineStateCollector(Collector):
    """Gauges and counters read at scrape time from the stats the engine publishes between steps,
    so they can never drift from it."""

    def __init__(self, stats: Callable[[], EngineStats], args: EngineArgs, model_name: str) -> None:
        # EngineCore resolved them for the device (EngineArgs.for_device).
        if args.max_num_seqs is None:
            raise ValueError("the engine's state needs arguments resolved by EngineArgs.for_device")
        self.stats = stats
        self.args = args
        self.max_num_seqs = args.max_num_seqs
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.stats()
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return _gauge(name, doc, label, value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return _counter(name, doc, label, value)

        yield gauge(metric_names.RUNNING, "Requests in the running batch.",
                    s.num_requests_running)  # fmt: skip
        yield gauge(metric_names.WAITING, "Requests waiting to be scheduled.",
                    s.num_requests_waiting)  # fmt: skip
        yield gauge(metric_names.KV_CACHE_USAGE, "Fraction of KV-cache blocks in use (0..1).",
                    s.kv_cache_usage_perc)  # fmt: skip
        yield gauge(metric_names.PREFIX_CACHE_BLOCKS,
                    "KV-cache blocks holding reusable prompt prefixes, in use or not.",
                    s.num_cached_blocks)  # fmt: skip
        # Routers read it to tell an engine with free batch slots (a request starts at once)
        # from one that queues it.
        yield gauge(metric_names.MAX_NUM_SEQS, "Requests the engine runs in one batch at most.",
                    self.max_num_seqs)  # fmt: skip
        info = GaugeMetricFamily(
            metric_names.CACHE_CONFIG_INFO,
            "KV-cache configuration.",
            labels=[metric_names.MODEL_NAME, *metric_names.CACHE_CONFIG_LABELS],
        )
        args = self.args
        info.add_metric(
            [
                self.model_name,
                str(args.block_size),
                str(int(s.num_usable_blocks)),
                str(args.enable_prefix_caching),
            ],
            1.0,
        )
        yield info
        yield counter(metric_names.PREFIX_CACHE_QUERIES,
                      "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)  # fmt: skip
        yield counter(metric_names.PREFIX_CACHE_HITS,
                      "Prompt tokens found in the device's prefix cache (the host tier's hits "
                      "are external_prefix_cache_hits).", s.prefix_cache_hits)  # fmt: skip
        yield counter(metric_names.EXTERNAL_PREFIX_CACHE_QUERIES,
                      "Prompt tokens the device's prefix cache missed, looked up in the host "
                      "tier.", s.host_cache_queries)  # fmt: skip
        yield counter(metric_names.EXTERNAL_PREFIX_CACHE_HITS,
                      "Prompt tokens copied back from the host tier instead of computed.",
                      s.host_cache_hits)  # fmt: skip
        yield gauge(metric_names.CPU_KV_CACHE_BLOCKS, "KV blocks held in the host tier.",
                    s.num_host_cache_blocks)  # fmt: skip
        yield gauge(metric_names.CPU_KV_CACHE_USAGE_BYTES,
                    "Host memory the KV blocks held in the host tier take.",
                    s.num_host_cache_blocks * s.host_cache_block_bytes)  # fmt: skip
        yield counter(metric_names.PROMPT_TOKENS, "Prompt tokens processed.", s.prompt_tokens)
        yield counter(metric_names.GENERATION_TOKENS, "Tokens generated.", s.generation_tokens)
        yield counter(metric_names.PREEMPTIONS, "Requests preempted.", s.num_preemptions)


class _LoRACollector(Collector):
    """The adapters' series, read at scrape time from the published stats: empty families for
    an engine without LoRA."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(
        self,
    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        lora: LoRAStats | None = self.stats().lora
        m = self.model_name
        model, name = metric_names.MODEL_NAME, metric_names.LORA_NAME
        info = GaugeMetricFamily(
            metric_names.LORA_REQUESTS_INFO,
            "LoRA adapters of the running and the waiting requests, and max_loras; the value is "
            "the time of the last change.",
            labels=[model, *metric_names.LORA_REQUESTS_INFO_LABELS],
        )
        resident = GaugeMetricFamily(
            metric_names.LORA_RESIDENT,
            "LoRA adapters the engine holds, by tier (gpu: in a slot; cpu: in host memory).",
            labels=[model, name, metric_names.LORA_TIER],
        )
        counters = [
            (metric_names.LORA_REQUESTS, "Requests queued per LoRA adapter.", "requests"),
            (metric_names.LORA_LOADS, "LoRA adapter loads into a GPU slot.", "loads"),
            (metric_names.LORA_EVICTIONS, "LoRA adapter evictions from a GPU slot.", "evictions"),
        ]
        families = [CounterMetricFamily(n, doc, labels=[model, name]) for n, doc, _ in counters]
        load_time = HistogramMetricFamily(
            metric_names.LORA_LOAD_SECONDS,
            "Time to copy a LoRA adapter into a GPU slot from its host copy.",
            labels=[model],
        )
        if lora is not None:
            running, waiting = ",".join(lora.running), ",".join(lora.waiting)
            info.add_metric([m, running, waiting, str(lora.max_loras)], lora.changed_at)
            for adapter, tier in lora.resident:
                resident.add_metric([m, adapter, tier], 1.0)
            for family, (_, _, field) in zip(families, counters, strict=True):
                for adapter, count in getattr(lora, field):
                    family.add_metric([m, adapter], count)
            buckets = [
                (str(bound), count)
                for bound, count in zip(LORA_LOAD_BUCKETS, lora.load_buckets, strict=True)
            ]
            buckets.append(("+Inf", lora.load_count))
            load_time.add_metric([m], buckets, lora.load_seconds)
        yield info
        yield resident
        yield from families
        yield load_time


class _KVEventsCollector(Collector):
    """KV events' subscribers and what they were sent, read at scrape time (zeros when the
    engine runs with --no-kv-events)."""

    def __init__(self, streams: KVEventStreams | None, model_name: str) -> None:
        self.streams = streams
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        label = [self.model_name]
        s = self.streams
        yield _gauge(metric_names.KV_EVENT_SUBSCRIBERS, "Subscribers to the engine's KV events.",
                     label, len(s.subscribers) if s is not None else 0)  # fmt: skip
        yield _counter(metric_names.KV_EVENTS_PUBLISHED,
                       "KV events (stored, removed, cleared) published to subscribers.", label,
                       s.events_published if s is not None else 0)  # fmt: skip
        yield _counter(metric_names.KV_EVENT_SUBSCRIBERS_DROPPED,
                       "KV-event subscribers disconnected for falling behind.", label,
                       s.dropped if s is not None else 0)  # fmt: skip


class _GrammarCollector(Collector):
    """Structured outputs: whether the engine has them (and why not), and its grammar cache,
    read at scrape time."""

    def __init__(
        self, stats: Callable[[], GrammarStats] | None, unavailable: str | None, model_name: str
    ) -> None:
        self.stats = stats
        self.unavailable = unavailable
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        label = [self.model_name]
        available = GaugeMetricFamily(
            metric_names.STRUCTURED_OUTPUTS_AVAILABLE,
            "1 when the engine serves structured outputs; 0 with the reason why not.",
            labels=[metric_names.MODEL_NAME, metric_names.UNAVAILABLE_REASON],
        )
        available.add_metric([*label, self.unavailable or ""], 0.0 if self.unavailable else 1.0)
        yield available
        if self.stats is None:
            return
        s = self.stats()
        yield _gauge(metric_names.GRAMMAR_CACHE_ENTRIES, "Compiled grammars cached.", label,
                     s.cache_entries)  # fmt: skip
        yield _gauge(metric_names.GRAMMAR_CACHE_BYTES,
                     "Bytes the cached grammars hold, as the grammar sandbox measured them.",
                     label, s.cache_bytes)  # fmt: skip
        yield _counter(metric_names.GRAMMAR_COMPILES,
                       "Constraints compiled (grammar cache misses).", label,
                       s.compiles)  # fmt: skip
        yield _counter(metric_names.GRAMMAR_COMPILER_CRASHES,
                       "Constraints that crashed or overran a grammar sandbox worker (each one a "
                       "400).", label, s.crashes)  # fmt: skip


class _StartupCollector(Collector):
    """The seconds each phase of the engine's start took (StartupTimer), read at scrape time:
    the graphs captured after ready add to theirs while the engine serves."""

    def __init__(self, startup: StartupTimer, model_name: str) -> None:
        self.startup = startup
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            metric_names.STARTUP_SECONDS,
            "Seconds each phase of the engine's start took (graph_capture_after_ready: the "
            "CUDA graphs captured while serving, so far).",
            labels=[metric_names.MODEL_NAME, metric_names.STARTUP_PHASE],
        )
        for phase, seconds in list(self.startup.seconds.items()):
            family.add_metric([self.model_name, phase], seconds)
        yield family


class EngineMetrics:
    """Per-request latency histograms and outcomes, fed by the engine loop after each step; the
    engine's state, read from its published stats once collect_state has been called."""

    def __init__(self, args: EngineArgs, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.args = args
        self.model_name = model_name
        labels = [metric_names.MODEL_NAME]
        self.request_success = Counter(
            metric_names.REQUEST_SUCCESS,
            "Finished requests by finish reason.",
            [metric_names.MODEL_NAME, metric_names.FINISHED_REASON],
            registry=self.registry,
        )
        self.ttft = Histogram(
            metric_names.TIME_TO_FIRST_TOKEN,
            "Time to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            metric_names.INTER_TOKEN_LATENCY,
            "Time between successive tokens of a request.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            metric_names.E2E_REQUEST_LATENCY,
            "Arrival to last token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            metric_names.REQUEST_QUEUE_TIME,
            "Arrival to first scheduling.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        # vLLM's phases of a request: scheduled to first token (the prefill, with any wait for
        # its grammar's first mask), first token to finish, scheduled to finish.
        self.prefill_time = Histogram(
            metric_names.REQUEST_PREFILL_TIME,
            "First scheduling to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.decode_time = Histogram(
            metric_names.REQUEST_DECODE_TIME,
            "First token to last token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inference_time = Histogram(
            metric_names.REQUEST_INFERENCE_TIME,
            "First scheduling to last token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._last_token_time: dict[str, float] = {}

    def collect_state(self, stats: Callable[[], EngineStats]) -> None:
        """Export the engine's state, as `stats` returns it, at every scrape."""
        self.registry.register(_EngineStateCollector(stats, self.args, self.model_name))
        self.registry.register(_LoRACollector(stats, self.model_name))

    def collect_startup(self, startup: StartupTimer) -> None:
        """Export the seconds of each phase of the engine's start."""
        self.registry.register(_StartupCollector(startup, self.model_name))

    def collect_grammar(
        self, stats: Callable[[], GrammarStats] | None, unavailable: str | None
    ) -> None:
        """Export structured outputs' availability and, when available, the grammar cache."""
        self.registry.register(_GrammarCollector(stats, unavailable, self.model_name))

    def collect_kv_events(self, streams: KVEventStreams | None) -> None:
        """Export the KV events' subscribers and counts."""
        self.registry.register(_KVEventsCollector(streams, self.model_name))

    def on_step(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        m = self.model_name
        for out in outputs:
            rid = out.request_id
            last = self._last_token_time.get(rid)
            timing = out.metrics
            scheduled = timing.first_scheduled_time if timing is not None else None
            first_token = timing.first_token_time if timing is not None else None
            if last is None and timing is not None:
                # An embedding request has no tokens, so no time to its first.
                if out.embedding is None:
                    self.ttft.labels(m).observe(now - timing.arrival_time)
                if scheduled is not None:
                    self.queue_time.labels(m).observe(scheduled - timing.arrival_time)
                    if first_token is not None:
                        self.prefill_time.labels(m).observe(first_token - scheduled)
            elif last is not None:
                self.itl.labels(m).observe(now - last)
            if out.finished:
                self._last_token_time.pop(rid, None)
                if timing is not None:
                    self.e2e.labels(m).observe(now - timing.arrival_time)
                if scheduled is not None:
                    self.inference_time.labels(m).observe(now - scheduled)
                if first_token is not None:
                    self.decode_time.labels(m).observe(now - first_token)
                # One count per request; the last choice to end decides the reason.
                reason = out.outputs[-1].finish_reason if out.outputs else None
                self.request_success.labels(m, reason or "stop").inc()
            else:
                self._last_token_time[rid] = now

    def on_abort(self, request_id: str) -> None:
        self._last_token_time.pop(request_id, None)
        self.request_success.labels(self.model_name, "abort").inc()
