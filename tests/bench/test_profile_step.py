"""bench/profile_step.py on a tiny Llama on the CPU: the free and JSON-constrained modes on one
engine, the grammar's host time reported for the constrained steps only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.scripts import load_bench_script

profile_step = load_bench_script("profile_step")


def test_free_and_json_modes_on_one_engine(
    model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    rc = profile_step.main(
        [
            *("--model", str(model_dirs["llama"]), "--dtype", "float32", "--batch", "4"),
            *("--context", "8", "--steps", "3", "--max-model-len", "256", "--modes", "free,json"),
            *("--host-profile", "5", "--grammar-threads", "0,1"),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    line = r"\[(\w+), async\] wall per decode step: .*grammar bitmask \(host\): ([\d.]+)"
    bitmask = dict(re.findall(line, out))
    assert set(bitmask) == {"free", "json"}, out
    # A free batch only checks that no row has a grammar; a constrained one computes masks.
    assert float(bitmask["json"]) > float(bitmask["free"]), out
    assert re.search(r"json / free wall per step \(async\): \d+\.\d{3}", out), out
    # --grammar-threads: one JSON run per executor size, its mask times' spread reported.
    assert re.findall(r"max [\d.]+; (\w+) threads\)", out) == ["engine", "1"], out
    assert len(re.findall(r"json / free wall per step", out)) == 2, out
    assert (
        len(re.findall(r"garbage collection: \d+ passes \(\d+ full\), [\d.]+ ms a step", out)) == 3
    )

    # --host-profile: each run's steps under Python's profiler, costliest functions first.
    assert len(re.findall(r"function calls.* in [\d.]+ seconds", out)) == 3, out
    assert len(re.findall(r"Ordered by: internal time", out)) == 3, out


def test_the_pytorch_bitmask_op_is_a_choice(
    model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    rc = profile_step.main(
        [
            *("--model", str(model_dirs["llama"]), "--dtype", "float32", "--batch", "2"),
            *("--context", "8", "--steps", "2", "--max-model-len", "256", "--modes", "json"),
            *("--bitmask-op", "pytorch"),
        ]
    )
    assert rc == 0
    assert "[json, async] wall per decode step" in capsys.readouterr().out
    # The engine's own bitmask op is back once the run ends.
    from kvfleet.engine import sampler, structured_output

    assert sampler.apply_bitmask is structured_output.apply_bitmask


def test_each_mode_runs_under_each_engine_loop(
    model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    rc = profile_step.main(
        [
            *("--model", str(model_dirs["llama"]), "--dtype", "float32", "--batch", "2"),
            *("--context", "8", "--steps", "2", "--max-model-len", "256", "--modes", "free"),
            *("--scheduling", "async,sync"),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    line = (
        r"\[free, (\w+)\] wall per decode step: ([\d.]+) ms; the host waiting for the tokens "
        r"\(ModelRunner.resolve[^)]*\): ([\d.]+) ms"
    )
    waits = re.findall(line, out)
    assert [loop for loop, _, _ in waits] == ["async", "sync"], out
    assert all(float(wait) <= float(wall) for _, wall, wait in waits), out


def test_an_unknown_mode_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        profile_step.main(["--model", "unused", "--modes", "free,xml"])
    assert exc.value.code == 2
    assert "--modes: xml; choose from free, json" in capsys.readouterr().err


def test_an_unknown_engine_loop_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        profile_step.main(["--model", "unused", "--scheduling", "async,eager"])
    assert exc.value.code == 2
    assert "--scheduling: 'async,eager'; choose from async, sync" in capsys.readouterr().err


def test_device_idle_is_the_time_between_the_device_work() -> None:
    from types import SimpleNamespace

    import torch

    def event(start: float, end: float, name: str, device=torch.autograd.DeviceType.CUDA):
        return SimpleNamespace(
            time_range=SimpleNamespace(start=start, end=end), name=name, device_type=device
        )

    events = [
        event(0, 100, "a"),
        event(50, 120, "b"),  # overlaps a: no gap
        event(500, 600, "c"),  # 380 us after b
        event(200, 900, "host", torch.autograd.DeviceType.CPU),  # not device work
        event(700, 800, "d"),  # 100 us after c
    ]
    line = profile_step.device_idle(events, steps=2)
    assert line.startswith("device idle between its work: 0.240 ms a step"), line
    assert "380 us after b before c; 100 us after c before d" in line, line
