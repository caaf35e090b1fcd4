"""What the engine hands back: per-step deltas that front ends stream, and accumulate into the
final RequestOutput the offline API returns; and the stats snapshot the server reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # Per generated token: {token id: logprob} holding the chosen token and the top-N.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
            self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason


@dataclass(slots=True)
class RequestMetrics:
    """Monotonic timestamps (time.monotonic) of a request's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    # Set, with finished, when the engine failed this request alone: which stage failed and why;
    # error_param names the request's parameter when the failure was its own (a constraint too
    # costly to follow, say), which makes it the client's error rather than the server's.
    error: str | None = None
    error_param: str | None = None
    # With SamplingParams.prompt_logprobs, per prompt token: {token id: logprob} holding the
    # prompt's token and the top N given the tokens before it; None for the first token, which
    # nothing predicts. Arrives with the first generated token.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # An embedding request's vector (a pooling engine's): in its one, finished, output.
    embedding: list[float] | None = None

    def add(self, delta: RequestOutput) -> None:
        """Fold a step's delta (which lists only the choices that changed) into this output."""
        for d in delta.outputs:
            self.outputs[d.index].add(d)
        self.finished = delta.finished
        self.error = delta.error
        self.error_param = delta.error_param
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.metrics is not None:
            self.metrics = delta.metrics
        if delta.embedding is not None:
            self.embedding = delta.embedding


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt, as vLLM's: `outputs.embedding`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    prompt: str | None = None


# Upper bounds of the LoRA load-time histogram's buckets, in seconds.
LORA_LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class LoRAStats:
    """The adapters' state between two steps (an engine with enable_lora)."""

    running: tuple[str, ...]  # adapters of the running requests, sorted
    waiting: tuple[str, ...]  # of the waiting ones
    changed_at: float  # time.time() when either list last changed
    max_loras: int
    resident: tuple[tuple[str, str], ...]  # (adapter, "gpu" or "cpu")
    requests: tuple[tuple[str, int], ...]  # requests queued per adapter, since the start
    loads: tuple[tuple[str, int], ...]  # loads into a GPU slot
    evictions: tuple[tuple[str, int], ...]  # evictions from a GPU slot
    # Slot loads no longer than each LORA_LOAD_BUCKETS bound (cumulative), all of them, and
    # their seconds in total.
    load_buckets: tuple[int, ...]
    load_count: int
    load_seconds: float


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's state between two steps, as the server and its metrics read it."""

    num_requests_running: int  # sequences (each of a request's n counts) in the running batch
    num_requests_waiting: int  # sequences waiting to be scheduled
    kv_cache_usage_perc: float  # fraction of KV-cache blocks in use (0..1)
    num_free_blocks: int
    num_usable_blocks: int
    # Blocks holding reusable prompt prefixes, in use or not: how warm the cache is, which the
    # operator weighs when it picks the engine a scale-down removes.
    num_cached_blocks: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    host_cache_queries: int  # prompt tokens the device missed, looked up in the host tier
    host_cache_hits: int  # of those, tokens copied back from it
    num_host_cache_blocks: int  # blocks held in the host tier
    host_cache_block_bytes: int  # host memory a block there takes
    prompt_tokens: int
    generation_tokens: int
    lora: LoRAStats | None = None
