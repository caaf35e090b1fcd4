"""The command lines the operator gives the engine and router containers: the contract between
the operator and the processes it runs. Pure: no I/O.

The ports come from the manifests (resources.py), which declare them as the containers' ports.
The engine's own flags, which extraArgs are checked against, are in engine_flags.py."""

from __future__ import annotations

from kvfleet.operator.cpu_kv_cache import cpu_kv_cache_bytes
from kvfleet.operator.spec import InferenceServiceSpec, RoutingSpec, served_model_name


def engine_args(spec: InferenceServiceSpec, model_path: str | None, *, port: int) -> list[str]:
    """``kvfleet-engine`` arguments for a spec; model_path None serves the built-in default;
    port: the container port it listens on."""
    e = spec.engine
    args = ["serve"]
    if model_path is not None:
        args += ["--model", model_path]
    args += [
        "--served-model-name", served_model_name(spec),
        "--host", "0.0.0.0",
        "--port", str(port),
        "--device", "cuda" if spec.resources.gpus > 0 else "cpu",
        "--dtype", e.dtype,
        "--block-size", str(e.block_size),
        "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
        "--shutdown-timeout", str(e.shutdown_timeout_seconds),
    ]  # fmt: skip
    if spec.resources.gpus > 0:
        args += ["--gpu-memory-utilization", str(e.gpu_memory_utilization)]
    if e.max_model_len is not None:
        args += ["--max-model-len", str(e.max_model_len)]
    if e.max_num_seqs is not None:
        args += ["--max-num-seqs", str(e.max_num_seqs)]
    if e.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    if e.max_waiting_requests is not None:
        args += ["--max-waiting-requests", str(e.max_waiting_requests)]
    if e.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(e.tensor_parallel_size)]
    if e.quantization is not None:
        args += ["--quantization", e.quantization]
    if e.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", e.kv_cache_dtype]
    if e.tool_call_parser is not None:
        args += ["--tool-call-parser", e.tool_call_parser]
    if e.runner is not None:
        args += ["--runner", e.runner]
    if host_kv := cpu_kv_cache_bytes(spec):
        args += ["--cpu-kv-cache-bytes", str(host_kv)]
    if spec.adapters:
        # The adapters themselves (--lora-modules) are not here: they come from the adapters
        # ConfigMap when the container starts (resources.py), so that changing them changes
        # no pod template; running engines get them through the load and unload endpoints.
        args += [
            "--enable-lora",
            "--max-loras", str(e.max_loras),
            "--max-cpu-loras", str(e.max_cpu_loras),
            "--max-lora-rank", str(e.max_lora_rank),
            "--enable-runtime-lora-updating",
        ]  # fmt: skip
    return args + list(e.extra_args)


def router_args(
    *, port: int, engine_service: str, engine_port: int, namespace: str, routing: RoutingSpec
) -> list[str]:
    """The ``kvfleet-router`` command line: the contract between the operator and the router.

    The router listens on ``--host``/``--port`` (``/health`` and a proxy for ``/v1/*``), learns
    the engine endpoints by watching the EndpointSlices of ``--engine-service`` in
    ``--namespace`` and sends to their ``--engine-port``. The key of a request is the
    ``--session-header`` value, else the OpenAI ``user`` field (``--use-user-field``), else,
    with ``--prefix-affinity``, a hash of the first ``--prefix-length`` prompt tokens; keys map
    to engines by consistent hashing with bounded loads (``--load-factor``), falling back to the
    least-loaded engine. While no engine is ready a request waits up to ``--hold-timeout``
    seconds. The router is given no ``--model-path``: the engine's model lives on volumes it
    cannot share (ReadWriteOnce claims, an engine-image path), so it estimates tokens.
    """
    return [
        "--host", "0.0.0.0",
        "--port", str(port),
        "--engine-service", engine_service,
        "--namespace", namespace,
        "--engine-port", str(engine_port),
        "--session-header", routing.session_header,
        "--use-user-field" if routing.use_user_field else "--no-use-user-field",
        "--prefix-affinity" if routing.prefix_affinity else "--no-prefix-affinity",
        "--prefix-length", str(routing.prefix_length),
        "--load-factor", str(routing.load_factor),
        "--hold-timeout", str(routing.hold_timeout_seconds),
    ]  # fmt: skip
