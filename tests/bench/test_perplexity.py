"""bench/perplexity.py: HF's strided windows score every token after the first exactly once, and
on the real default model the FP8 paths' perplexity over a short window stays within issue 21's
bounds of the baseline's (fp8 KV 1%, W8A8 3%)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.scripts import load_bench_script

perplexity = load_bench_script("perplexity")


@pytest.mark.parametrize(
    ("num_tokens", "window", "stride"), [(10, 4, 2), (10, 4, 3), (9, 16, 8), (2, 2, 1), (33, 8, 7)]
)
def test_windows_score_every_token_after_the_first_once(num_tokens, window, stride) -> None:
    spans = perplexity.windows(num_tokens, window, stride)
    scored = [t for w in spans for t in range(w.first_scored, w.end)]
    assert scored == list(range(1, num_tokens))
    assert all(w.end - w.begin <= window for w in spans)
    assert spans[-1].end == num_tokens


def test_perplexity_of_known_logprobs() -> None:
    """A scorer that gives token t the logprob -t/100 wherever it appears: the mean NLL is the
    mean of t/100 over the scored tokens, whatever the windows."""
    ids = list(range(50))

    def score(prompts: list[list[int]]) -> list[list[float | None]]:
        return [[None] + [-t / 100 for t in p[1:]] for p in prompts]

    ppl, count = perplexity.perplexity(ids, 16, 5, score)
    assert count == 49
    assert ppl == pytest.approx(math.exp(sum(range(1, 50)) / 100 / 49))


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="stride"):
        perplexity.windows(10, 4, 4)
    with pytest.raises(SystemExit):
        perplexity.parse_args(["--variants", "baseline,fp4"])


@pytest.fixture(scope="module")
def short_window(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every variant over the text's first 160 tokens (two windows), one short greedy answer."""
    out = tmp_path_factory.mktemp("ppl") / "ppl.json"
    rc = perplexity.main(
        [
            *("--model", str(smollm2_gguf), "--device", "cpu", "--max-text-tokens", "160"),
            *("--window", "160", "--stride", "80", "--num-prompts", "1", "--max-tokens", "4"),
            *("--out", str(out)),
        ]
    )
    assert rc == 0
    results = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == set(perplexity.VARIANTS)
    assert results["baseline"]["scored_tokens"] == 159
    return results


def test_fp8_kv_cache_within_the_goal(short_window: dict) -> None:
    """Issue 21: fp8 KV within 1% of the baseline. Calibrated k/v scales meet it (measured
    -0.90% here, +0.75% over 2k tokens of the text); scales of 1.0 (a GGUF carries none) stay
    within 2% (+0.99% here, +1.18% over the text)."""
    assert abs(short_window["fp8-kv-scaled"]["ppl_delta"]) <= perplexity.GOALS["fp8-kv-scaled"]
    assert abs(short_window["fp8-kv"]["ppl_delta"]) <= 2 * perplexity.GOALS["fp8-kv"]


def test_fp8_weights_stay_near_the_baseline(short_window: dict) -> None:
    """A guard against a broken W8A8 path (a wrong scale costs far more than this): measured
    +3.8% alone and +7.2% with an fp8 KV cache on this window."""
    assert 0 <= short_window["fp8-w8a8"]["ppl_delta"] <= 0.06
    assert 0 <= short_window["fp8-both"]["ppl_delta"] <= 0.10


@pytest.mark.xfail(
    strict=True,
    reason="issue 21's W8A8 goal (3%) is missed on SmolLM2-135M: +3.8% on this window, +5.0% "
    "over 2k tokens of the text, of which the fp8 weights alone cost +3.3% (bench/RESULTS.md); "
    "an XPASS means it is met: drop this mark",
)
def test_fp8_weights_within_the_goal(short_window: dict) -> None:
    for name in ("fp8-w8a8", "fp8-both"):
        assert short_window[name]["ppl_delta"] <= perplexity.GOALS[name], name


def test_the_weights_only_diagnostic_leaves_the_served_path_as_it_was(short_window: dict) -> None:
    """fp8-weights-only (W8A8's weights, activations unquantized) costs perplexity of its own
    and not W8A8's; once it has run, the engine's fp8 linear is the served one again."""
    from kvfleet.engine.layers import fp8, linear

    weights_only = short_window["fp8-weights-only"]["ppl_delta"]
    assert 0 < weights_only != short_window["fp8-w8a8"]["ppl_delta"]
    assert linear.fp8_linear is fp8.fp8_linear
