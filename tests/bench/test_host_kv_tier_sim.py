"""bench/host_kv_tier_sim.py on a small fleet workload: the engine's scheduler and KV cache
manager with a host tier that holds the working set serve every block computed before (none
lost, none stranded behind a gap), count each tier's hits as they are found, and leave the
device's hits where they are without the tier."""

from __future__ import annotations

from tests.support.scripts import load_script

sim = load_script("bench/host_kv_tier_sim.py")


def test_a_host_tier_holding_the_working_set_serves_every_block_computed_before() -> None:
    # 8 system prompts of ~800 tokens and their sessions' histories against 250 device blocks
    # (4,000 tokens): the working set is over twice the device's; the host tier holds it all.
    ns = sim.parse_args(["--seconds", "20", "--systems", "8", "--system-words", "400",
                         "--gpu-blocks", "250", "--host-blocks", "2000",
                         "--copy-steps", "2"])  # fmt: skip
    workload = sim.sessions_of(ns)
    off = sim.simulate(workload, ns, 0)
    on = sim.simulate(workload, ns, ns.host_blocks)
    assert off.requests == on.requests == 4 * len(workload.sessions)
    for run in (off, on):
        # The counters are the first lookups' device and host runs, and nothing more was reused.
        assert (run.stats["device"], run.stats["host"]) == (run.where["device"], run.where["host"])
        assert run.stats["queries"] == sum(run.where.values()) and run.uncounted == 0
    assert off.where["lost"] > 0.1 * off.stats["queries"]  # the device alone drops prefixes
    assert on.where["lost"] == on.where["behind a gap"] == 0
    assert on.where["new"] == off.where["new"]
    assert on.stats["device"] >= 0.95 * off.stats["device"]
