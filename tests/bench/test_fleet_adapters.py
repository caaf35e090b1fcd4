"""The fleet harness's LoRA parts (bench/fleet): random PEFT adapters of a model config, a Zipf
choice of adapter per session, the spec the operator gets, the adapter engines' start command,
and adapter loads counted from the engines' metrics."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvfleet.operator.resources import Owner, engine_deployment
from kvfleet.operator.spec import parse_spec
from tests.support.kmock import CONFIG
from tests.support.scripts import load_script
from tests.support.tiny_model import tiny_model_path

fleet = load_script("bench/fleet/run.py")
adapters = load_script("bench/fleet/adapters.py")
pods = load_script("bench/fleet/pods.py")
workload = load_script("bench/fleet/workload.py")


def test_a_random_adapter_has_peft_names_and_the_models_shapes(tmp_path: Path) -> None:
    model = tiny_model_path()
    path = adapters.write_random_adapter(model, tmp_path / "a", rank=4, seed=1, dtype=torch.float32)
    config = json.loads((model / "config.json").read_text())
    tensors = load_file(str(path / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * config["num_hidden_layers"]
    for module, (fan_in, fan_out) in adapters.module_shapes(config).items():
        key = f"base_model.model.model.layers.0.{module}"
        assert tensors[f"{key}.lora_A.weight"].shape == (4, fan_in)
        assert tensors[f"{key}.lora_B.weight"].shape == (fan_out, 4)
    peft = json.loads((path / "adapter_config.json").read_text())
    assert (peft["peft_type"], peft["r"], peft["target_modules"]) == (
        "LORA",
        4,
        list(adapters.TARGETS),
    )


def test_sessions_pick_adapters_by_zipf_popularity_and_keep_their_text() -> None:
    phases = workload.parse_phases("200x4")
    shape = dict(turns=2, systems=2, system_words=5, user_words=3, reply_words=3, think_s=0.1,
                 max_tokens=4, seed=3)  # fmt: skip
    names = [f"a{i}" for i in range(8)]
    with_adapters = workload.make_workload(phases, adapters=names, zipf=1.0, **shape)
    plain = workload.make_workload(phases, **shape)
    assert [s.users for s in with_adapters.sessions] == [s.users for s in plain.sessions]
    assert {s.adapter for s in plain.sessions} == {None}
    counts = Counter(s.adapter for s in with_adapters.sessions)
    assert counts["a0"] > counts["a1"] > counts["a7"] > 0  # 1, 1/2, ..., 1/8 of the weight
    assert counts["a0"] > 2 * counts["a3"]


def test_the_harness_spec_with_adapters_is_valid_and_starts_the_engine_through_its_shell(
    tmp_path: Path,
) -> None:
    ns = fleet.parse_args(["--adapters", "2", "--max-loras", "2", "--adapter-rank", "8"])
    spec = fleet.inference_service(
        ns, {"adapter-00": tmp_path / "a0", "adapter-01": tmp_path / "a1"}
    )
    parsed = parse_spec("bench", spec["spec"])
    assert [a.name for a in parsed.adapters] == ["adapter-00", "adapter-01"]
    assert (parsed.engine.max_loras, parsed.engine.max_lora_rank) == (2, 8)
    deployment = engine_deployment(Owner("bench", "fleet", "u"), parsed, CONFIG)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    argv = pods.engine_command(container, "127.0.0.9", tmp_path / "cm")
    assert argv[:2] == ["/bin/sh", "-c"] and f"{tmp_path / 'cm'}/lora-modules" in argv[2]
    assert argv[argv.index("--host") + 1] == "127.0.0.9"
    with pytest.raises(ValueError):
        pods.engine_command(container, "127.0.0.9")  # a shell command needs its ConfigMap
    with pytest.raises(SystemExit):
        fleet.parse_args(["--adapters", "2", "--model", "default"])


def test_loads_are_the_adapters_that_arrive_in_an_engines_slots() -> None:
    def exposition(*gpu: str, cpu: tuple[str, ...] = ()) -> str:
        return "".join(
            f'kvfleet_engine_lora_resident{{model_name="m",lora_name="{n}",tier="{t}"}} 1\n'
            for names, t in ((gpu, "gpu"), (cpu, "cpu"))
            for n in names
        )

    assert adapters.gpu_adapters(exposition("a", "b", cpu=("c",))) == {"a", "b"}
    loads = adapters.LoadCounter()
    loads.sample([("e1", adapters.gpu_adapters(exposition("a")))])  # the baseline
    loads.sample([("e1", adapters.gpu_adapters(exposition("a", "b"))), ("e2", frozenset({"x"}))])
    loads.sample([("e1", adapters.gpu_adapters(exposition("c", "b"))), ("e2", frozenset({"y"}))])
    assert loads.loads == 3  # b, then c on e1 and y on e2 (e2's first sample is its baseline)
