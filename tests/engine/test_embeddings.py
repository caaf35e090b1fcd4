"""An embedding model (--runner pooling): each prompt's vector equals HF transformers' pooled
final hidden states (fp32) whether the prompts run batched together or a long one in chunks,
with last-token and mean pooling, from the prefix cache or not; Matryoshka dimensions where the
checkpoint declares them; the runner chosen from the checkpoint; refusals of what the other
runner does."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from kvfleet.engine.llm import LLM
from kvfleet.engine.request import InvalidRequestError
from kvfleet.engine.sampling_params import SamplingParams
from tests.support.engine import assert_no_leak, hf_embeddings
from tests.support.tiny_model import build_tiny_embedding_model

# The acceptance bound: fp32 on both sides, vectors of norm 1.
ATOL = 1e-5
# A budget of 48 tokens a step: the 200-token prompt runs in five chunks, next to the others.
CHUNK = 48


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 16, 37, 200)]


@pytest.fixture(scope="module")
def last_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("embedding-models")
    return build_tiny_embedding_model(root / "last", "lasttoken", is_matryoshka=True)


@pytest.fixture(scope="module")
def mean_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("embedding-models")
    return build_tiny_embedding_model(root / "mean", "mean", normalize=False)


@pytest.fixture(scope="module")
def last_llm(last_dir: Path):
    # No --runner: the sentence-transformers files make it an embedding model.
    with LLM(str(last_dir), device="cpu", dtype="float32", max_num_batched_tokens=CHUNK) as llm:
        yield llm


def _assert_close(got: list[float], want: torch.Tensor) -> None:
    diff = (torch.tensor(got) - want).abs().max().item()
    assert len(got) == len(want) and diff < ATOL, diff


def test_last_token_pooling_matches_hf(last_llm, last_dir, prompts):
    assert last_llm.engine.model_config.runner == "pooling"
    want = hf_embeddings(last_dir, prompts, "lasttoken")
    outs = last_llm.embed([{"prompt_token_ids": p} for p in prompts])
    for out, ref in zip(outs, want, strict=True):
        _assert_close(out.outputs.embedding, ref)
        assert abs(torch.tensor(out.outputs.embedding).norm().item() - 1.0) < 1e-5
    assert_no_leak(last_llm)

    # Again: the prompts' full blocks now come from the prefix cache; the vectors do not change.
    again = last_llm.embed([{"prompt_token_ids": p} for p in prompts])
    for out, ref in zip(again, want, strict=True):
        _assert_close(out.outputs.embedding, ref)
    assert last_llm.engine.stats().prefix_cache_hits >= 192
    assert_no_leak(last_llm)


@pytest.fixture(scope="module")
def mean_llm(mean_dir: Path):
    # --runner given, as it may be: the checkpoint would choose pooling by itself.
    with LLM(str(mean_dir), runner="pooling", device="cpu", dtype="float32",
             max_num_batched_tokens=CHUNK) as llm:  # fmt: skip
        yield llm


def test_mean_pooling_matches_hf_in_chunks(mean_llm, mean_dir, prompts):
    want = hf_embeddings(mean_dir, prompts, "mean", normalize=False)
    for _ in range(2):  # the second time its prefix is cached, and must not be taken
        outs = mean_llm.embed([{"prompt_token_ids": p} for p in prompts])
        for out, ref in zip(outs, want, strict=True):
            _assert_close(out.outputs.embedding, ref)
    assert mean_llm.engine.stats().prefix_cache_hits == 0
    assert_no_leak(mean_llm)


# The other families, each in one of the two layouts an embedding checkpoint comes in: a bare
# body with sentence-transformers files, or a causal LM's checkpoint (its head left unread)
# served with --runner pooling; last-token and mean pooling each twice.
FAMILIES = [
    ("gpt2", "body", "mean"),
    ("gemma2", "causal", "lasttoken"),
    ("mixtral", "body", "lasttoken"),
    ("qwen3_moe", "causal", "mean"),
]


@pytest.mark.parametrize(("arch", "layout", "pooling"), FAMILIES)
def test_every_family_pools_as_hf(arch, layout, pooling, model_dirs, prompts, tmp_path):
    if layout == "body":
        model_dir = build_tiny_embedding_model(tmp_path / arch, pooling, arch=arch)
        args = {}
    else:
        model_dir = model_dirs[arch]
        args = {"runner": "pooling", "pooling_type": "LAST" if pooling == "lasttoken" else "MEAN"}
    want = hf_embeddings(model_dir, prompts, pooling)
    with LLM(str(model_dir), device="cpu", dtype="float32", max_num_batched_tokens=CHUNK,
             **args) as llm:  # fmt: skip
        assert llm.engine.model_config.runner == "pooling"
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts])
        for out, ref in zip(outs, want, strict=True):
            _assert_close(out.outputs.embedding, ref)
        assert_no_leak(llm)


def test_matryoshka_dimensions(last_llm, last_dir, prompts):
    full = hf_embeddings(last_dir, prompts[3:4], "lasttoken", normalize=False)[0]
    out = last_llm.embed({"prompt_token_ids": prompts[3]}, dimensions=16)[0]
    _assert_close(out.outputs.embedding, torch.nn.functional.normalize(full[:16], dim=-1))
    with pytest.raises(InvalidRequestError, match="between 1 and") as e:
        last_llm.embed({"prompt_token_ids": prompts[3]}, dimensions=65)
    assert e.value.param == "dimensions"


def test_dimensions_refused_without_matryoshka(mean_llm):
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        mean_llm.embed("hello", dimensions=16)
    # The model's own size is no truncation.
    assert len(mean_llm.embed("hello", dimensions=64)[0].outputs.embedding) == 64


def test_each_runner_refuses_the_other_s_requests(last_llm, model_dirs):
    with pytest.raises(InvalidRequestError, match="embedding model") as e:
        last_llm.generate("hello", SamplingParams(max_tokens=2))
    assert e.value.param == "model"
    with LLM(str(model_dirs["qwen3"]), device="cpu", dtype="float32") as llm:
        assert llm.engine.model_config.runner == "generate"
        with pytest.raises(InvalidRequestError, match="--runner pooling"):
            llm.embed("hello")
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        last_llm.embed({"prompt_token_ids": [5, 100000]})
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        last_llm.embed({"prompt_token_ids": [5] * 1025})
    assert_no_leak(last_llm)


def test_runner_choice(model_dirs, last_dir, tmp_path):
    # An architecture the engine does not serve, refused before any weight is read.
    config = json.loads((model_dirs["llama"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"architectures": ["BertModel"]}))
    with pytest.raises(ValueError, match=r"--runner pooling supports GPT2LMHeadModel, .*BertModel"):
        LLM(str(tmp_path), runner="pooling", device="cpu")
    with pytest.raises(ValueError, match="--pooling-type applies to --runner pooling"):
        LLM(str(model_dirs["llama"]), pooling_type="MEAN", device="cpu")
    # A causal LM's checkpoint served for its hidden states: the LM head is left out; MEAN
    # overrides the checkpoint's (none here: the default would be LAST).
    with LLM(str(model_dirs["qwen3"]), runner="pooling", pooling_type="MEAN", device="cpu",
             dtype="float32") as llm:  # fmt: skip
        pooler = llm.engine.model_config.pooler
        assert pooler is not None and pooler.pooling_type == "MEAN" and pooler.normalize
        assert len(llm.embed("hello")[0].outputs.embedding) == 64


def test_pooling_from_sentence_transformers_files(tmp_path):
    from types import SimpleNamespace

    from kvfleet.engine.pooling import resolve_pooler

    config = SimpleNamespace(hidden_size=64, matryoshka_dimensions=[16, 32])
    # No files: Qwen3-Embedding's last token, normalised.
    assert resolve_pooler(tmp_path, config, None).pooling_type == "LAST"
    st = "sentence_transformers.models."
    modules = [
        {"type": st + "Transformer", "path": ""},
        {"type": st + "Pooling", "path": "1_Pooling"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    pooling = tmp_path / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    pooler = resolve_pooler(tmp_path, config, None)
    assert (pooler.pooling_type, pooler.normalize) == ("MEAN", False)  # no Normalize module
    assert resolve_pooler(tmp_path, config, "LAST").pooling_type == "LAST"
    # Declared sizes only; the model's own always.
    assert pooler.check_dimensions(16) is None and pooler.check_dimensions(64) is None
    assert "one of [16, 32]" in (pooler.check_dimensions(24) or "")
    pooling.write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(ValueError, match=r"pooling_mode_cls_token.*--pooling-type"):
        resolve_pooler(tmp_path, config, None)
