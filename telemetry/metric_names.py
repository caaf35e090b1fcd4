"""The names of the metrics one kvfleet process exports and another reads: the engine's (vLLM's
names, so that dashboards, KEDA triggers and the Gateway API Inference Extension read kvfleet
engines unchanged) and the router's gauge the operator scales from zero by. The exporters and
every reader name them from here, so that a rename cannot leave a reader looking for a series
that no longer exists; tests/telemetry/test_metric_contract.py scrapes a real engine with the
readers. Counters are named without the ``_total`` the exposition adds."""

from __future__ import annotations

# The label every engine series carries: the served model name (the first one).
MODEL_NAME = "model_name"
# The labels of vllm:cache_config_info, after model_name.
CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks", "enable_prefix_caching")
# Of vllm:request_success: stop, length, abort.
FINISHED_REASON = "finished_reason"
# Of kvfleet_engine_structured_outputs_available: why the engine runs without them.
UNAVAILABLE_REASON = "reason"

# The engine's state, read at scrape time.
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
PREFIX_CACHE_BLOCKS = "kvfleet_engine_prefix_cache_blocks"
MAX_NUM_SEQS = "kvfleet_engine_max_num_seqs"
CACHE_CONFIG_INFO = "vllm:cache_config_info"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
# The host tier of the prefix cache (--cpu-kv-cache-bytes): vLLM counts the tokens its KV
# connectors (CPU offloading among them) are asked for and find under these names; here, the
# prompt tokens the device cache missed, and of those, the tokens copied back from host memory.
# The blocks the tier holds and the host memory they take.
EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries"
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"
CPU_KV_CACHE_BLOCKS = "kvfleet_engine_cpu_kv_cache_blocks"
CPU_KV_CACHE_USAGE_BYTES = "kvfleet_engine_cpu_kv_cache_usage_bytes"
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
PREEMPTIONS = "vllm:num_preemptions"

# Structured outputs.
STRUCTURED_OUTPUTS_AVAILABLE = "kvfleet_engine_structured_outputs_available"
GRAMMAR_CACHE_ENTRIES = "kvfleet_engine_grammar_cache_entries"
GRAMMAR_CACHE_BYTES = "kvfleet_engine_grammar_cache_bytes"
GRAMMAR_COMPILES = "kvfleet_engine_grammar_compiles"
GRAMMAR_COMPILER_CRASHES = "kvfleet_engine_grammar_compiler_crashes"

# Requests: an outcome counter and latency histograms.
REQUEST_SUCCESS = "vllm:request_success"
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "vllm:request_queue_time_seconds"
REQUEST_PREFILL_TIME = "vllm:request_prefill_time_seconds"
REQUEST_DECODE_TIME = "vllm:request_decode_time_seconds"
REQUEST_INFERENCE_TIME = "vllm:request_inference_time_seconds"

ENGINE_METRICS = (
    RUNNING, WAITING, KV_CACHE_USAGE, PREFIX_CACHE_BLOCKS, MAX_NUM_SEQS, CACHE_CONFIG_INFO,
    PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, EXTERNAL_PREFIX_CACHE_QUERIES,
    EXTERNAL_PREFIX_CACHE_HITS, CPU_KV_CACHE_BLOCKS, CPU_KV_CACHE_USAGE_BYTES, PROMPT_TOKENS,
    GENERATION_TOKENS, PREEMPTIONS,
    STRUCTURED_OUTPUTS_AVAILABLE, GRAMMAR_CACHE_ENTRIES, GRAMMAR_CACHE_BYTES, GRAMMAR_COMPILES,
    GRAMMAR_COMPILER_CRASHES, REQUEST_SUCCESS, TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY,
    E2E_REQUEST_LATENCY, REQUEST_QUEUE_TIME, REQUEST_PREFILL_TIME, REQUEST_DECODE_TIME,
    REQUEST_INFERENCE_TIME, "vllm:lora_requests_info", "kvfleet_engine_lora_resident",
    "kvfleet_engine_lora_requests", "kvfleet_engine_lora_loads", "kvfleet_engine_lora_evictions",
    "kvfleet_engine_lora_load_seconds", "kvfleet_engine_kv_event_subscribers",
    "kvfleet_engine_kv_events_published", "kvfleet_engine_kv_event_subscribers_dropped",
    "kvfleet_engine_startup_seconds",
)  # fmt: skip

# KV events (GET /kv_events): the subscribers connected, the events published to them, and the
# subscribers disconnected for falling behind.
KV_EVENT_SUBSCRIBERS = "kvfleet_engine_kv_event_subscribers"
KV_EVENTS_PUBLISHED = "kvfleet_engine_kv_events_published"
KV_EVENT_SUBSCRIBERS_DROPPED = "kvfleet_engine_kv_event_subscribers_dropped"

# The seconds each phase of an engine's start took (process, config, weights, memory_profile,
# kv_cache, warm_up, graph_capture, http; graph_capture_after_ready while serving), by phase.
STARTUP_SECONDS = "kvfleet_engine_startup_seconds"
STARTUP_PHASE = "phase"

# The router's requests waiting for a ready engine: the operator scales a service from zero by it.
ROUTER_HELD_REQUESTS = "kvfleet_router_held_requests"
# Precise prefix scoring (issue 41): the router's index of the engines' KV events.
ROUTER_KV_EVENTS_APPLIED = "kvfleet_router_kv_events_applied"
ROUTER_KV_RESYNCS = "kvfleet_router_kv_resyncs"
ROUTER_KV_STALE_ENGINES = "kvfleet_router_kv_stale_engines"
ROUTER_KV_INDEXED_BLOCKS = "kvfleet_router_kv_indexed_blocks"
ROUTER_PREFIX_SCORING = "kvfleet_router_prefix_scoring"

# LoRA adapters. vllm:lora_requests_info as vLLM exports it: one gauge series whose labels name
# the adapters of the running and the waiting requests (comma-separated) and the engine's
# max_loras; its value is the time of the last change. The router reads which adapters an engine
# holds from kvfleet_engine_lora_resident: one series per adapter held, labelled by its name and
# the tier that holds it ("gpu": in a GPU slot, ready for a batch; "cpu": in host memory).
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
LORA_REQUESTS_INFO_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")
LORA_RESIDENT = "kvfleet_engine_lora_resident"
LORA_NAME = "lora_name"
LORA_TIER = "tier"
# Per adapter (lora_name): requests queued, loads into a GPU slot, evictions from one; and the
# time a load into a slot takes (from disk when host memory had no copy).
LORA_REQUESTS = "kvfleet_engine_lora_requests"
LORA_LOADS = "kvfleet_engine_lora_loads"
LORA_EVICTIONS = "kvfleet_engine_lora_evictions"
LORA_LOAD_SECONDS = "kvfleet_engine_lora_load_seconds"
