"""A safetensors checkpoint read by several threads (engine/models/loader.py): the tensors of
the one-reader read, in its order, the memory ahead bounded, the bandwidth logged, and a failed
or abandoned read leaving no reader behind."""

from __future__ import annotations

import logging
import shutil
import threading

import pytest
import torch
from safetensors import SafetensorError, safe_open

from kvfleet.engine.models import loader
from kvfleet.engine.models.loader import iter_checkpoint


def _readers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvfleet-read")]


@pytest.fixture
def small_groups(monkeypatch):
    """Groups of one tensor or two: the eight readers run far ahead of the loading."""
    monkeypatch.setattr(loader, "READ_GROUP_BYTES", 4096)
    in_flight: list[int] = []
    read = loader._read

    def counted(group, device):
        in_flight.append(group.nbytes)
        return read(group, device)

    monkeypatch.setattr(loader, "_read", counted)
    return in_flight


def test_threads_read_the_tensors_of_one_reader_in_its_order(model_dirs, small_groups, caplog):
    path = model_dirs["llama"]
    [file] = path.glob("*.safetensors")
    with safe_open(file, framework="pt") as f:
        expected = [(name, f.get_tensor(name)) for name in f.keys()]  # noqa: SIM118
    caplog.set_level(logging.INFO, "kvfleet.engine.models.loader")
    got = list(iter_checkpoint(path, progress=False))
    assert [n for n, _ in got] == [n for n, _ in expected]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected, strict=True))
    assert len(small_groups) > loader.READ_THREADS  # more groups than readers, all read once
    assert sum(small_groups) == sum(t.numel() * t.element_size() for _, t in expected)
    assert "GiB of weights in" in caplog.text and "8 threads" in caplog.text
    assert not _readers()


def test_skipped_tensors_are_never_read(model_dirs, small_groups):
    got = [n for n, _ in iter_checkpoint(model_dirs["llama"], skip=lambda n: "mlp" in n)]
    assert got and not any("mlp" in n for n in got)
    everything = [n for n, _ in iter_checkpoint(model_dirs["llama"])]
    assert len(got) < len(everything)


def test_reading_stays_a_bounded_number_of_groups_ahead(model_dirs, small_groups):
    stream = iter_checkpoint(model_dirs["llama"], progress=False)
    next(stream)
    # The first group's loading has not finished: at most the readers' groups have been read.
    assert len(small_groups) <= loader.READ_THREADS + 1
    stream.close()
    assert not _readers()


def test_a_broken_shard_fails_the_load_and_leaves_no_reader(model_dirs, tmp_path):
    path = tmp_path / "broken"
    shutil.copytree(model_dirs["llama"], path)
    [file] = path.glob("*.safetensors")
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])  # the header says more than the file holds
    with pytest.raises(SafetensorError, match="incomplete metadata"):
        list(iter_checkpoint(path, progress=False))
    assert not _readers()
    file.write_bytes((10**12).to_bytes(8, "little") + data[8:])
    with pytest.raises(ValueError, match="safetensors header of"):
        list(iter_checkpoint(path, progress=False))
