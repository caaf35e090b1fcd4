"""bench/throughput.py on a tiny Llama on the CPU: HF static baselines at several batch sizes in
one run, and the prefix cache serving a prefix every prompt shares."""

from __future__ import annotations

import gc
import json
import logging
import weakref
from pathlib import Path

import pytest

from tests.support.scripts import load_bench_script

throughput = load_bench_script("throughput")


def test_baselines_at_several_batch_sizes_and_a_shared_prefix(
    model_dirs: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engines = weakref.WeakSet()

    class TrackedLLM(throughput.LLM):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            engines.add(self.engine)

    monkeypatch.setattr(throughput, "LLM", TrackedLLM)
    out = tmp_path / "throughput.json"
    with caplog.at_level(logging.INFO, logger="bench.throughput"):
        rc = throughput.main(
            [
                *("--model", str(model_dirs["llama"]), "--dtype", "float32", "--num-prompts", "6"),
                *("--input-len", "4", "12", "--output-len", "2", "5", "--prefix-len", "48"),
                *("--max-model-len", "128", "--baselines", "hf-static", "--hf-batch-size", "1"),
                *("2", "--baseline-num-prompts", "3", "--result-json", str(out), "--step-stats"),
            ]
        )
    assert rc == 0
    assert "decode steps:" in caplog.text
    # The step spies are gone with the run: nothing keeps the engine (its GPU memory, on a GPU)
    # alive into the baselines.
    gc.collect()
    assert len(engines) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["name"] for r in results] == ["kvfleet", "hf-static-bs1", "hf-static-bs2"]
    kv, bs1, bs2 = results
    assert kv["requests"] == 6 and bs1["requests"] == bs2["requests"] == 3
    assert bs1["output_tokens"] == bs2["output_tokens"] and bs1["output_tok_s"] > 0
    # The warm-up's prompts filled the cache: every prompt finds at least the 48 shared tokens
    # (three full blocks) there.
    assert kv["extra"]["cached_prompt_tokens"] >= 6 * 48
    assert (
        kv["extra"]["prefix_cache_hit_rate"]
        == kv["extra"]["cached_prompt_tokens"] / (kv["prompt_tokens"])
    )
    assert "kvfleet prefix cache:" in capsys.readouterr().out
