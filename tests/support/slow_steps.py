"""Engine steps made slow in a controlled way, for the liveness and shutdown tests: a step of many
tokens (a long prompt's prefill) spends a set time in torch ops, as a long prefill on a slow CPU
does, while short steps run as they are. In this process (slow_steps), or in a `kvfleet-engine`
child process: `python -m tests.support.slow_steps serve ...` with SLOW_ENV set
("where:seconds:min_tokens")."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

from kvfleet.engine.layers.attention import Attention
from kvfleet.engine.model_runner import ModelRunner

SLOW_ENV = "KVFLEET_TEST_SLOW_STEPS"

# layer: each attention layer of the step spends `seconds` first, so the step takes that times
# the layers, and an interruption (ModelRunner.interrupting) ends it at the next layer.
# step: the step spends `seconds` before its forward pass in one piece that no interruption
# reaches, as a step stuck in one op would.
Where = Literal["layer", "step"]


def busy(seconds: float) -> None:
    """Spend `seconds` in short torch ops, each of which releases the GIL, as a forward pass
    does (a time.sleep would leave the thread in Python's C code, never in torch's)."""
    a = torch.ones(128, 128)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        torch.mm(a, a)


@contextmanager
def slow_steps(where: Where, seconds: float, min_tokens: int) -> Iterator[None]:
    """Within the block, steps of at least `min_tokens` tokens are slow (see Where)."""
    if where == "layer":
        forward = Attention.forward

        def slow_layer(self, q, k, v):
            if q.shape[0] >= min_tokens:
                busy(seconds)
            return forward(self, q, k, v)

        Attention.forward = slow_layer  # type: ignore[method-assign]
        try:
            yield
        finally:
            Attention.forward = forward  # type: ignore[method-assign]
    else:
        launch = ModelRunner.launch

        def slow_launch(self, out, prev=None):
            if out.num_batched_tokens >= min_tokens:
                busy(seconds)
            return launch(self, out, prev)

        ModelRunner.launch = slow_launch  # type: ignore[method-assign]
        try:
            yield
        finally:
            ModelRunner.launch = launch  # type: ignore[method-assign]


if __name__ == "__main__":
    from kvfleet.engine.cli import main

    where, seconds, min_tokens = os.environ[SLOW_ENV].split(":")
    with slow_steps(where, float(seconds), int(min_tokens)):  # type: ignore[arg-type]
        code = main(sys.argv[1:])
    sys.exit(code)
