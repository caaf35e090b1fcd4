"""Plots of fleet harness results (bench/fleet/run.py --result-json), as PNG for bench/RESULTS.md.

* ``routing.png`` from fixed-rate runs: output tok/s, TTFT p90 and the engines' prefix-cache
  hit rate (both KV tiers') against the request rate, one line per policy, the SLO drawn
  across the latency panel and each policy's rate at the SLO (bench/fleet/capacity.py) in its
  legend;
* ``ramp.png`` from a run under a ramp: offered rate, replicas (desired, ready) and each
  request's TTFT over time, with the SLO.

Each input is a result JSON, or the table run.py printed (the ``| load | policy | ...`` lines of
its output), for a run whose JSON did not survive; a table has no per-request samples, so it
feeds only the routing plot::

    python bench/fleet/plot.py --out-dir bench/fleet_plots sweep.json more.json ramp.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on the machines that draw these
import matplotlib.pyplot as plt

# bench/ for the harness's modules, run as a script or loaded by path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.capacity import capacities, fixed_rate, hit_rate, series_name

# The printed table's columns that the routing plot reads, by their heading.
TABLE_COLUMNS = {
    "output tok/s": "output_tok_s",
    "TTFT p90 ms": "ttft_p90_ms",
    "hit rate": "hit_rate",
}


def _number(cell: str) -> float | None:
    cell = cell.strip().replace(",", "")
    if cell.endswith("%"):
        return float(cell[:-1]) / 100
    return float(cell) if cell else None


def read_table(text: str) -> list[dict[str, Any]]:
    """The runs of a table run.py printed: load, policy and the columns the routing plot uses."""
    runs: list[dict[str, Any]] = []
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["load", "policy"]:
            header = cells
            continue
        if header is None or len(cells) != len(header):
            continue
        row = dict(zip(header, cells, strict=True))
        run: dict[str, Any] = {"load": row["load"], "policy": row["policy"]}
        for heading, key in TABLE_COLUMNS.items():
            run[key] = _number(row[heading])
        runs.append(run)
    if not runs:
        raise ValueError("no table of runs (a '| load | policy | ...' heading) in it")
    return runs


def read_runs(path: Path) -> tuple[list[dict[str, Any]], float | None]:
    """The runs in a result JSON or printed table, and the TTFT SLO in seconds if it says."""
    text = path.read_text()
    try:
        report = json.loads(text)
    except json.JSONDecodeError:
        return read_table(text), None
    runs = report["runs"]
    for r in runs:
        if "load" not in r:  # results from before rate sweeps: one load, the report's phases
            r["load"] = ",".join(f"{p['seconds']:g}x{p['rate']:g}" for p in report["phases"])
    return runs, next((r.get("ttft_slo_s") for r in runs if r.get("ttft_slo_s")), None)


def plot_routing(runs: list[dict[str, Any]], slo_s: float | None, out: Path) -> bool:
    series: dict[str, list[tuple[float, float, float, float | None]]] = defaultdict(list)
    for r in runs:
        rate = fixed_rate(r["load"])
        if rate is not None and r.get("output_tok_s") is not None:
            hits = hit_rate(r)
            series[series_name(r)].append((rate, r["output_tok_s"], r["ttft_p90_ms"], hits))
    if not series:
        return False
    at_slo = {c.policy: c.describe() for c in capacities(runs, slo_s)} if slo_s else {}
    fig, (tput, ttft, hits) = plt.subplots(1, 3, figsize=(15, 4.2))
    for policy, points in sorted(series.items()):
        points.sort()
        rates = [p[0] for p in points]
        label = f"{policy} ({at_slo[policy]} req/s at SLO)" if policy in at_slo else policy
        tput.plot(rates, [p[1] for p in points], marker="o", label=policy)
        ttft.plot(rates, [p[2] / 1000 for p in points], marker="o", label=label)
        known = [(p[0], p[3]) for p in points if p[3] is not None]
        hits.plot([k[0] for k in known], [k[1] * 100 for k in known], marker="o", label=policy)
    tput.set(xlabel="request rate (req/s)", ylabel="output tok/s", title="Throughput")
    ttft.set(xlabel="request rate (req/s)", ylabel="TTFT p90 (s)", title="TTFT p90", yscale="log")
    hits.set(
        xlabel="request rate (req/s)", ylabel="%", title="Prefix-cache hit rate", ylim=(0, 100)
    )
    if slo_s:
        ttft.axhline(slo_s, color="grey", linestyle="--", label=f"SLO {slo_s:g} s")
    for ax in (tput, ttft, hits):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def plot_ramp(run: dict[str, Any], phases: list[dict[str, float]], out: Path) -> None:
    fig, (load, ttft) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    t, edges, rates = 0.0, [], []
    for p in phases:
        edges += [t, t + p["seconds"]]
        rates += [p["rate"], p["rate"]]
        t += p["seconds"]
    load.plot(edges, rates, color="grey", label="offered req/s")
    load.set_ylabel("req/s")
    replicas = load.twinx()
    samples = run["replicas"]  # [seconds, desired, ready, running]
    replicas.step([s[0] for s in samples], [s[1] for s in samples], where="post",
                  label="desired", color="tab:orange")  # fmt: skip
    replicas.step([s[0] for s in samples], [s[2] for s in samples], where="post",
                  label="ready", color="tab:green")  # fmt: skip
    replicas.set_ylabel("replicas")
    replicas.set_ylim(0, max(s[1] for s in samples) + 1)
    lines = load.get_legend_handles_labels()[0] + replicas.get_legend_handles_labels()[0]
    load.legend(lines, [str(x.get_label()) for x in lines], loc="upper right")
    load.set_title(f"{run['policy']}: {run['load']}, {run['requests']} requests")
    ok = [s for s in run["samples"] if s[3] and s[1] is not None]
    ttft.scatter([s[0] for s in ok], [s[1] for s in ok], s=2, alpha=0.4, label="TTFT")
    if run.get("ttft_slo_s"):
        ttft.axhline(run["ttft_slo_s"], color="grey", linestyle="--", label="SLO")
    failed = [s[0] for s in run["samples"] if not s[3]]
    if failed:
        ttft.scatter(failed, [run["ttft_slo_s"] or 1.0] * len(failed), marker="x", color="red",
                     label=f"failed ({len(failed)})")  # fmt: skip
    ttft.set(xlabel="seconds from the start", ylabel="TTFT (s)", yscale="log")
    ttft.legend(loc="upper right")
    for ax in (load, ttft):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("inputs", nargs="+", type=Path, help="result JSON files or printed tables")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--prefix", default="", help="prepended to the PNG names")
    ns = p.parse_args(argv)
    ns.out_dir.mkdir(parents=True, exist_ok=True)
    fixed: list[dict[str, Any]] = []
    slo: float | None = None
    wrote = []
    for path in ns.inputs:
        try:
            runs, run_slo = read_runs(path)
        except (OSError, ValueError, KeyError) as e:
            p.error(f"{path}: {e}")
        slo = slo or run_slo
        fixed += [r for r in runs if fixed_rate(r["load"]) is not None]
        for r in runs:
            if fixed_rate(r["load"]) is None and "samples" in r:
                phases = [
                    {"seconds": float(s), "rate": float(x)}
                    for s, _, x in (ph.partition("x") for ph in r["load"].split(","))
                ]
                out = ns.out_dir / f"{ns.prefix}ramp.png"
                plot_ramp(r, phases, out)
                wrote.append(out)
    out = ns.out_dir / f"{ns.prefix}routing.png"
    if plot_routing(fixed, slo, out):
        wrote.append(out)
    if not wrote:
        p.error("nothing to plot: no fixed-rate runs and no ramp with samples")
    for path in wrote:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
