"""The host KV tier's hit rate without a GPU: the engine's real Scheduler, KVCacheManager,
BlockPool and HostBlockIndex driven by the fleet's chat workload (bench/fleet/workload.py, the
same sessions as ``bench/gpu_run.sh cpu-kv-tier``) on a virtual clock, no model. Each step takes
``--step-ms`` plus ``--token-us`` per token it computes; a copy (to or from the host tier) is
seen complete ``--copy-steps`` steps after it was queued; every sampled token is a fresh id,
and a turn's history carries the workload's scripted replies, as the bench sends them. Words
are ``--tokens-per-word`` tokens each (the bench's dummy tokenizer makes a 2,000-word system
prompt about 4k tokens).

Reported per run (tier off, then on): device, host and total hit rates as the engine counts
them (vllm:prefix_cache_* and vllm:external_prefix_cache_*), and where every prompt token of a
request's first lookup went: found on the device or in the host tier; missed because it was
never computed before (a system prompt's first sight, a turn's new tokens), because it was
computed but is in neither tier now, or because it sits in a tier behind a block that is in
neither; or never looked up (the last token, which must run, and the partial block). And the
tokens requests started with beyond those their first lookup counted (a later lookup's, after a
copy back: blocks computed meanwhile by another request), which no counter shows::

    python bench/host_kv_tier_sim.py                       # the H200 bench's shape
    python bench/host_kv_tier_sim.py --seconds 300         # more revisits
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import sys
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleet.workload import VOCABULARY, Phase, Session, Workload, make_workload

from kvfleet.engine.block_pool import KVBlock
from kvfleet.engine.kv_cache_manager import KVCacheManager
from kvfleet.engine.kv_transfers import KVTransfers, TransfersDone
from kvfleet.engine.request import Request
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.scheduler import Scheduler
from kvfleet.protocol.kv_events import BlockStored

# Where a prompt token of a request's first lookup went.
KINDS = ("device", "host", "new", "lost", "behind a gap", "not looked up")


@dataclass
class Run:
    stats: dict[str, int]
    where: Counter[str]
    ttfts: list[float] = field(default_factory=list)
    requests: int = 0
    uncounted: int = 0


class Tokens:
    """Words to token ids, ``per_word`` each; a run tag's tokens lead every system prompt."""

    def __init__(self, per_word: int) -> None:
        self.per_word = per_word
        self.ids = {w: i * per_word for i, w in enumerate(VOCABULARY)}
        self.special = len(VOCABULARY) * per_word  # role markers, then sampled tokens

    def text(self, words: str) -> list[int]:
        return [self.ids[w] + k for w in words.split() for k in range(self.per_word)]

    def prompt(self, workload: Workload, session: Session, turn: int) -> list[int]:
        out: list[int] = []
        for i, message in enumerate(workload.messages(session, turn, "run")):
            role = ("system", "user", "assistant").index(message["role"])
            body = message["content"].removeprefix("[run] ")
            out += [self.special + role, self.special + 3 + i % 2, *self.text(body)]
        return [*out, self.special + 2]  # the assistant's turn begins


class ObservedKV(KVCacheManager):
    """The engine's KV cache manager, noting where the tokens of each request's lookups are
    (its first lookup's is the one the engine counts) and every block hash ever cached."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int) -> None:
        super().__init__(num_blocks, block_size, True, num_host_blocks)
        self.seen: set[bytes] = set()
        self.looked: dict[str, Counter[str]] = {}
        self.pool.events.enabled = True

    def note_cached(self) -> None:
        for event in self.pool.events.drain():
            if isinstance(event, BlockStored) and event.medium == "gpu":
                self.seen.update(bytes.fromhex(h) for h in event.block_hashes)

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        hits, num_cached = super().get_computed_blocks(req)
        if req.num_cached_tokens < 0:
            self.note_cached()
            self.looked[req.request_id] = self.where_tokens(req, len(hits))
        return hits, num_cached

    def where_tokens(self, req: Request, device_hits: int) -> Counter[str]:
        """Where each prompt token of this lookup is: the run of device hits, then the host
        tier's run after it (get_host_blocks), then each missed block by why."""
        bs = self.block_size
        usable = (req.num_tokens - 1) // bs  # as get_computed_blocks stops
        host_run = len(self.get_host_blocks(req, device_hits))
        out = Counter({"device": device_hits * bs, "host": host_run * bs})
        out["not looked up"] = req.num_tokens - usable * bs
        for block_hash in req.block_hashes[device_hits + host_run : usable]:
            if block_hash not in self.seen:
                kind = "new"
            elif block_hash in self.pool.cached or (
                self.host is not None and self.host.lookup(block_hash) is not None
            ):
                kind = "behind a gap"
            else:
                kind = "lost"
            out[kind] += bs
        return out


def simulate(workload: Workload, ns: argparse.Namespace, host_blocks: int) -> Run:
    kv = ObservedKV(ns.gpu_blocks, ns.block_size, host_blocks)
    sched = Scheduler(kv, ns.max_num_seqs, ns.max_num_batched_tokens)
    tokens = Tokens(ns.tokens_per_word)
    where: Counter[str] = Counter()
    run = Run({}, where)
    events: list[tuple[float, int, int]] = []  # (time, session, turn)
    for s in workload.sessions:
        heapq.heappush(events, (s.start, s.index, 0))
    sessions = {s.index: s for s in workload.sessions}
    arrivals: dict[str, float] = {}
    ids = itertools.count(tokens.special + 16)
    now = 0.0
    # Each step's copies, complete once --copy-steps steps (it among them) have run.
    copies: deque[KVTransfers] = deque(KVTransfers() for _ in range(ns.copy_steps))
    while events or sched.has_unfinished():
        while events and events[0][0] <= now:
            _, index, turn = heapq.heappop(events)
            prompt = tokens.prompt(workload, sessions[index], turn)
            rid = f"{index}-{turn}"
            params = SamplingParams(max_tokens=workload.max_tokens, ignore_eos=True)
            sched.add_request(Request(rid, prompt, params, frozenset(), workload.max_tokens))
            arrivals[rid] = now
        sched.transfers_done(done_of(copies.popleft()))
        out = sched.schedule()
        copies.append(out.kv_transfers)
        for rid in out.started:
            counted = kv.looked.pop(rid, None)
            if counted is not None:
                where.update(counted)
            req = sched.requests[rid]
            if not req.num_preemptions:
                # Tokens it starts with beyond those its first lookup counted (a later one's).
                run.uncounted += req.num_computed_tokens - req.num_cached_tokens
        if out.empty and not sched.loading and not any(copies):
            if not events:
                break
            now = max(now, events[0][0])
            continue
        sched.advance(out)
        now += (ns.step_ms + out.num_batched_tokens * ns.token_us / 1000) / 1000
        sampled = {r.request_id: next(ids) for r, _ in out.scheduled if r.num_pending}
        for req in sched.update(out, sampled):
            if req.num_output_tokens == 1:
                run.ttfts.append(now - arrivals[req.request_id])
            if req.status.finished:
                index, turn = map(int, req.request_id.split("-"))
                run.requests += 1
                if turn + 1 < len(sessions[index].users):
                    think = sessions[index].thinks[turn]
                    heapq.heappush(events, (now + think, index, turn + 1))
        sched.take_finished()
    s = sched.stats
    run.stats = {
        "queries": s.prefix_cache_queries,
        "device": s.prefix_cache_hits,
        "host": s.host_cache_hits,
    }
    return run


def done_of(copies: KVTransfers) -> TransfersDone:
    return TransfersDone(
        stored=[ticket for _, _, ticket in copies.stores],
        loaded=[(load_id, True) for load_id, _, _ in copies.loads],
    )


def report(name: str, run: Run) -> None:
    st = run.stats
    q = st["queries"] or 1
    total = sum(run.where.values()) or 1
    ttfts = sorted(run.ttfts)
    p90 = ttfts[int(0.9 * (len(ttfts) - 1))] * 1000 if ttfts else 0.0
    print(
        f"{name}: {run.requests} requests, counted hits device {st['device'] / q:.1%} "
        f"host {st['host'] / q:.1%} total {(st['device'] + st['host']) / q:.1%}, "
        f"TTFT p90 {p90:.0f} ms (virtual); tokens reused beyond those counted "
        f"{run.uncounted / q:.1%}"
    )
    print("  prompt tokens at first lookup: " + ", ".join(
        f"{k} {run.where[k] / total:.1%}" for k in KINDS))  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--rate", type=float, default=4.0, help="requests/s")
    p.add_argument("--systems", type=int, default=48)
    p.add_argument("--system-words", type=int, default=2000)
    p.add_argument("--user-words", type=int, default=60)
    p.add_argument("--reply-words", type=int, default=120)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--think", type=float, default=2.0, help="mean think time, s")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens-per-word", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-blocks", type=int, default=3813, help="the 8 GB cap's 3,813")
    p.add_argument("--host-blocks", type=int, default=16384, help="32 GiB of Llama-3.1-8B's")
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--copy-steps", type=int, default=1, help="steps a copy takes, >= 1")
    p.add_argument("--step-ms", type=float, default=8.0, help="a step's fixed time")
    p.add_argument("--token-us", type=float, default=25.0, help="time per token computed")
    ns = p.parse_args(argv)
    if ns.copy_steps < 1:
        p.error("--copy-steps must be at least 1")
    return ns


def sessions_of(ns: argparse.Namespace) -> Workload:
    return make_workload(
        [Phase(ns.seconds, ns.rate)],
        turns=ns.turns,
        systems=ns.systems,
        system_words=ns.system_words,
        user_words=ns.user_words,
        reply_words=ns.reply_words,
        think_s=ns.think,
        max_tokens=ns.max_tokens,
        seed=ns.seed,
    )


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    workload = sessions_of(ns)
    print(f"{len(workload.sessions)} sessions, {len({s.system for s in workload.sessions})} "
          f"system prompts used")  # fmt: skip
    report("tier off", simulate(workload, ns, 0))
    report("tier on ", simulate(workload, ns, ns.host_blocks))


if __name__ == "__main__":
    main()
