"""A model load made slow in a controlled way, for the tests of a signal during the load: loading
the weights first spends a set time in torch ops, as a large checkpoint's load does, in a
`kvfleet-engine` child process: `python -m tests.support.slow_load serve ...` with SLOW_LOAD_ENV
set to the seconds. It writes LOADING to stderr as the slow part begins."""

from __future__ import annotations

import os
import sys

SLOW_LOAD_ENV = "KVFLEET_TEST_SLOW_LOAD"
LOADING = "slow load: loading the weights"


if __name__ == "__main__":
    from kvfleet.engine import model_runner
    from kvfleet.engine.cli import main
    from tests.support.slow_steps import busy

    seconds = float(os.environ[SLOW_LOAD_ENV])
    load_weights = model_runner.load_weights

    def slow_load_weights(*args, **kwargs):
        sys.stderr.write(LOADING + "\n")
        sys.stderr.flush()
        busy(seconds)
        return load_weights(*args, **kwargs)

    model_runner.load_weights = slow_load_weights
    sys.exit(main(sys.argv[1:]))
