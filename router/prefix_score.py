"""Precise prefix scoring: the engine for a request from how much of its prompt each engine holds
(kv_index.py) and how loaded each is, in one rule. Pure; the Balancer (proxy.py) calls it.

    score(e) = cached(e) / blocks  -  W_LOAD * load(e)
    load(e)  = max(requests(e) / batch(e), kv_usage(e))

``cached(e)``: the prompt's leading blocks engine e holds (a host-memory block weighs
kv_index.CPU_BLOCK_WEIGHT); ``blocks``: the prompt's full blocks. ``requests(e)``: running +
waiting as the engines report them, with this router's own since (engine_load.estimated_load);
``batch(e)``: the engine's max_num_seqs where it reports one, else the load bound's capacity;
``kv_usage(e)``: the fraction of its KV cache in use (0 without a report). load(e) is how full
the tighter of its two capacities is: 0 idle, 1 a full batch or a full cache, above 1 requests
queue.

W_LOAD = 1: a whole prompt cached is worth exactly one full engine. An engine holding all of a
prompt beats an idle one holding none until its batch (or cache) is full, where the saved
prefill (milliseconds) no longer pays for the wait for a batch slot (a whole generation, seconds);
a small cached prefix (a shared system prompt's first blocks) is outweighed by a small load
difference, so requests that share only a little spread by load.

Only engines within the bounded-load cap (hash_ring.HashRing.capacity, or with a free batch slot)
are candidates, as with approximate routing; an engine whose view is stale is scored as
approximate routing sees it (all of the prompt where the request's key has its home on the ring,
none elsewhere). Equal scores go to a known prefix before an assumed one, then to the engine met
first on the ring from the request's key (its session, user or prefix key): session affinity is
the tie-breaker, and replicas that see the same events and loads choose the same engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

W_LOAD = 1.0


@dataclass(frozen=True)
class EngineState:
    """What the rule knows of one candidate engine."""

    cached_blocks: float
    requests: int
    batch: int
    kv_usage: float = 0.0
    # cached_blocks assumed as approximate routing would (the engine's view is stale), not known.
    assumed: bool = False

    @property
    def load(self) -> float:
        return max(self.requests / max(self.batch, 1), self.kv_usage)


def score(state: EngineState, blocks: int) -> float:
    """The rule above; ``blocks`` > 0."""
    return state.cached_blocks / blocks - W_LOAD * state.load


@dataclass(frozen=True)
class Scored:
    endpoint: str
    score: float
    cached_blocks: float
    assumed: bool


def ranked(order: Sequence[str], states: Mapping[str, EngineState], blocks: int) -> list[Scored]:
    """``order`` (candidates in ring order from the request's key) by score, highest first; at
    equal scores a known prefix before an assumed one, then ring order (the first met wins)."""
    if blocks < 1:
        raise ValueError("scoring needs a prompt of at least one block")
    scored = [
        Scored(ep, score(st, blocks), st.cached_blocks, st.assumed)
        for ep, st in ((ep, states[ep]) for ep in order)
    ]
    return sorted(scored, key=lambda s: (-s.score, s.assumed))  # stable: then ring order
