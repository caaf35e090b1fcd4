"""The metrics one process reads of another, against a real engine's /metrics: every name the
router and the operator ask for is in its exposition, and each reader, scraping it as it does
in operation, gets every number it looks for (the optional ones included)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.server.settings import ServerSettings
from kvfleet.operator import metrics_scraper
from kvfleet.operator.latency import LATENCY_METRICS
from kvfleet.operator.metrics_scraper import Scraper, Target
from kvfleet.router import engine_load
from kvfleet.telemetry import metric_names
from tests.support.lora_adapters import write_peft_adapter
from tests.support.net import http_call
from tests.support.servers import engine_server

MODEL = "tiny"
ADAPTER = "tiny-lora"


@pytest.fixture(scope="module")
def engine(model_dirs, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """A CPU engine with a LoRA adapter (whose series the router reads) that has finished one
    request of the base model and one of the adapter: its latency histograms and its adapters'
    series have samples."""
    adapter = write_peft_adapter(
        model_dirs["llama"], tmp_path_factory.mktemp("contract") / "adapter", rank=4
    )
    settings = ServerSettings(host="127.0.0.1", port=0, served_model_name=[MODEL])
    args = EngineArgs(model=str(model_dirs["llama"]), dtype="float32", max_num_seqs=8,
                      enable_lora=True, lora_modules=[f"{ADAPTER}={adapter}"])  # fmt: skip
    with engine_server(args, settings) as server:
        for model in (MODEL, ADAPTER):
            body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 2}
            status, _, answer = http_call(server.url + "/v1/completions", body)
            assert status == 200, answer
        yield server


def _exposition(url: str) -> str:
    status, _, body = http_call(url + "/metrics")
    assert status == 200
    return body.decode()


def test_every_name_a_reader_asks_for_is_exported(engine) -> None:
    families = list(text_string_to_metric_families(_exposition(engine.url)))
    samples = {s.name for f in families for s in f.samples}
    read = {
        "router": set(engine_load.NAMES),
        "operator": set(metrics_scraper.ENGINE_NAMES),
        "latency target": {f"{h}_bucket" for h in LATENCY_METRICS.values()},
    }
    for reader, names in read.items():
        assert names <= samples, f"the {reader} reads what the engine lacks: {names - samples}"
    # The engine exports the table's names and no other (prometheus_client adds the creation
    # time of each counter and histogram as a gauge of its own, <name>_created).
    exported = {f.name.removesuffix("_created") for f in families}
    assert exported == set(metric_names.ENGINE_METRICS)
    assert all(metric_names.MODEL_NAME in s.labels for f in families for s in f.samples)


def test_the_start_is_exported_phase_by_phase(engine) -> None:
    """A CPU engine's start: every phase it runs (no warm-up or graphs on the CPU), each a
    positive number of seconds."""
    [family] = [
        f
        for f in text_string_to_metric_families(_exposition(engine.url))
        if f.name == metric_names.STARTUP_SECONDS
    ]
    phases = {s.labels[metric_names.STARTUP_PHASE]: s.value for s in family.samples}
    assert set(phases) == {
        "process",
        "config",
        "tokenizer",
        "weights",
        "memory_profile",
        "kv_cache",
        "http",
    }
    assert all(seconds > 0 for seconds in phases.values()), phases


@pytest.mark.asyncio
async def test_the_router_reads_the_engines_load_whole(engine) -> None:
    async with aiohttp.ClientSession() as session, session.get(engine.url + "/metrics") as r:
        lines = await engine_load.read_samples(r, engine_load.MAX_BODY_BYTES)
    report = engine_load.report_of(lines, own_at_scrape=0)
    assert (report.running, report.waiting, report.max_num_seqs) == (0, 0, 8)
    assert report.adapters is not None and ADAPTER in report.adapters.gpu, report


@pytest.mark.asyncio
@pytest.mark.parametrize("latency", sorted(LATENCY_METRICS))
async def test_the_operator_reads_every_engine_signal(engine, latency: str) -> None:
    target = Target("engine-0", engine.url + metrics_scraper.METRICS_PATH)
    async with Scraper() as scraper:
        (pod,) = await scraper.engines([target], LATENCY_METRICS[latency])
    assert pod.error is None
    assert (pod.running, pod.waiting) == (0, 0)
    assert pod.kv_cache_usage is not None and 0 <= pod.kv_cache_usage <= 1
    assert pod.cached_blocks is not None
    assert pod.latency is not None and pod.latency[-1][1] == 2  # the two requests
