"""What an engine keeps between starts: the compile cache's folder (engine/compile_cache.py)
and the memory profile's result (engine/memory_profile_cache.py). Their use on the GPU is in
tests/engine/test_gpu.py."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch

from kvfleet.engine.compile_cache import (
    BuildFacts,
    cache_root,
    driver_version,
    folder_name,
    open_compile_cache,
)
from kvfleet.engine.config import EngineArgs, ModelConfig
from kvfleet.engine.memory_profile_cache import (
    MemoryProfile,
    load_profile,
    profile_key,
    profile_path,
    store_profile,
)

FACTS = BuildFacts(
    gpu="NVIDIA H200 sm_90", driver="570.124.06", cuda="12.8", torch="2.7.0", triton="3.3.0",
    kvfleet="0.1.0",
)  # fmt: skip


def test_every_fact_names_a_folder_of_its_own():
    names = {folder_name(FACTS)}
    for field in dataclasses.fields(BuildFacts):
        names.add(folder_name(dataclasses.replace(FACTS, **{field.name: "other"})))
    assert len(names) == 1 + len(dataclasses.fields(BuildFacts))
    assert folder_name(FACTS).startswith("NVIDIA-H200-sm-90-")
    assert folder_name(FACTS) == folder_name(dataclasses.replace(FACTS))


def test_driver_version_from_the_kernel_module():
    text = (
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build  "
        "(dvs-builder@U16-I3-B03-4-3)  Tue Feb 25 04:12:37 UTC 2025\nGCC version:  gcc 12.3.0\n"
    )
    assert driver_version(text) == "570.124.06"
    legacy = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.161.08  Release Build"
    assert driver_version(legacy) == "535.161.08"
    assert driver_version("no driver here") is None


@pytest.fixture
def triton_cache_env(monkeypatch):
    """TRITON_CACHE_DIR unset for the test and as it was after it, set or not."""
    monkeypatch.setenv("TRITON_CACHE_DIR", "unset")
    monkeypatch.delenv("TRITON_CACHE_DIR")


def test_the_cache_points_triton_into_its_folder(tmp_path, monkeypatch, triton_cache_env):
    monkeypatch.setenv("KVFLEET_COMPILE_CACHE_DIR", str(tmp_path / "env"))
    assert cache_root(None) == tmp_path / "env"
    assert cache_root(str(tmp_path / "flag")) == tmp_path / "flag"
    folder = open_compile_cache(tmp_path / "flag", FACTS)
    assert folder is not None and folder == tmp_path / "flag" / folder_name(FACTS)
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    assert (folder / "triton").is_dir()


def test_an_unusable_root_leaves_the_cache_off(tmp_path, triton_cache_env):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert open_compile_cache(blocker, FACTS) is None
    assert "TRITON_CACHE_DIR" not in os.environ


@pytest.fixture(scope="module")
def llama_config(model_dirs) -> tuple[ModelConfig, EngineArgs]:
    args = EngineArgs(model=str(model_dirs["llama"]), device="cpu").for_device(torch.device("cpu"))
    return ModelConfig.from_args(args, torch.device("cpu")), args


def test_the_profile_key_follows_the_model_the_batch_and_the_card(llama_config):
    mc, args = llama_config
    key = profile_key(mc, args, 80 << 30)
    assert profile_key(mc, args, 80 << 30) == key
    assert profile_key(mc, args, 141 << 30) != key
    assert profile_key(mc, args.model_copy(update={"max_num_seqs": 7}), 80 << 30) != key
    assert profile_key(mc, args.model_copy(update={"enable_lora": True}), 80 << 30) != key
    assert profile_key(mc.model_copy(update={"max_model_len": 64}), args, 80 << 30) != key
    # What does not change memory (sampling's seed) keeps the key.
    assert profile_key(mc, args.model_copy(update={"seed": 3}), 80 << 30) == key


def test_a_kept_profile_is_used_only_for_its_key_and_weights(tmp_path, caplog):
    caplog.set_level(logging.INFO, "kvfleet.engine.memory_profile_cache")
    profile = MemoryProfile(key="k" * 64, weight_bytes=1000, peak_bytes=5000)
    assert load_profile(tmp_path, profile.key, 1000) is None  # none kept yet
    store_profile(tmp_path, profile)
    assert load_profile(tmp_path, profile.key, 1000) == 5000
    assert load_profile(tmp_path, profile.key, 1001) is None  # other weights on the device
    assert "profiling again" in caplog.text
    # Another key whose name shares the file's prefix is not this one.
    assert load_profile(tmp_path, "k" * 63 + "x", 1000) is None
    store_profile(tmp_path, MemoryProfile(key=profile.key, weight_bytes=1000, peak_bytes=999))
    assert load_profile(tmp_path, profile.key, 1000) is None  # a peak below the weights
    profile_path(tmp_path, profile.key).write_text("{not json")
    assert load_profile(tmp_path, profile.key, 1000) is None
    assert list(profile_path(tmp_path, profile.key).parent.iterdir()) == [
        profile_path(tmp_path, profile.key)
    ]


def test_a_folder_that_cannot_be_written_costs_only_the_kept_profile(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store_profile(blocker, MemoryProfile(key="k", weight_bytes=1, peak_bytes=2))
    assert "could not keep the memory profile" in caplog.text
