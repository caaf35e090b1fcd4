"""Adapters' copies into their GPU slots, in flight: each is one copy of a host image queued on
the device's stream without the host waiting (LoRALayers.load), so the image must live until
the device has read it, whatever the host tier does with its copy meanwhile (an adapter may be
dropped from host memory right after its slot load was issued). A load keeps its image until
an event recorded after the copy has completed. Being on the stream the steps run on, a copy
into a slot also waits for the steps before it that may still read the slot.

The time of a load is the copy's on the device, between events recorded around it, read once
it completed (a step or so later): the host's time to queue it says nothing. On the CPU the
copy is synchronous and timed on the host."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvfleet.engine.layers.lora import LoRALayers


@dataclass(frozen=True)
class _InFlight:
    name: str
    image: torch.Tensor  # kept alive until `done` completes
    started: torch.cuda.Event
    done: torch.cuda.Event


class SlotLoads:
    """The slot loads of one rank's LoRA layers not yet completed on the device, and the
    seconds of those that were."""

    def __init__(self, layers: LoRALayers, timed: bool) -> None:
        """`timed`: keep each load's seconds for take_seconds (rank 0, which reports them)."""
        self.layers = layers
        self.timed = timed
        self.on_gpu = layers.buffer.is_cuda
        self.in_flight: list[_InFlight] = []
        self.seconds: list[tuple[str, float]] = []

    def load(self, slot: int, name: str, image: torch.Tensor) -> None:
        """Queue the copy of adapter `name`'s image into `slot`."""
        self.settle()
        if not self.on_gpu:
            started = time.perf_counter()
            self.layers.load(slot, image)
            if self.timed:
                self.seconds.append((name, time.perf_counter() - started))
            return
        started_event = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True)
        started_event.record()
        self.layers.load(slot, image)
        done.record()
        self.in_flight.append(_InFlight(name, image, started_event, done))

    def settle(self) -> None:
        """Let go of the images of the copies the device completed (query only, no wait),
        keeping their seconds."""
        pending = []
        for load in self.in_flight:
            if not load.done.query():
                pending.append(load)
            elif self.timed:
                self.seconds.append((load.name, load.started.elapsed_time(load.done) / 1000))
        self.in_flight = pending

    def take_seconds(self) -> list[tuple[str, float]]:
        """(adapter name, seconds) of each load completed since the last call."""
        self.settle()
        seconds, self.seconds = self.seconds, []
        return seconds
