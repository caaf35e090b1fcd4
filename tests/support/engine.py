"""Engine test helpers: HF transformers' greedy output as the reference, leak checks, the
prompts the equivalence tests share, GPU comparison helpers, and a spy on cascade decisions."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvfleet.engine.outputs import EngineStats

# Lengths from 1 to 200 tokens, on and off 16-token block boundaries.
PROMPT_LENS = (1, 7, 16, 33, 64, 100, 161, 200)
MAX_TOKENS = 32


def idle_stats(**values: Any) -> EngineStats:
    """The stats of an engine with nothing in it (every count 0, LoRA off), but `values`: what
    a metrics test exports as an engine would."""
    zeros = dict.fromkeys(EngineStats.__dataclass_fields__, 0) | {"lora": None}
    return EngineStats(**(zeros | values))


def _hf_causal_lm(model_dir: Path, gguf_file: str | None) -> Any:
    """HF transformers' model of the checkpoint in fp32, for inference only. A GGUF file's is
    shared with the next call on the same file (the last file's only): transformers parses and
    dequantizes the whole file for each load, ~13 s for the default model, which two modules
    compare the engine with."""
    from transformers import AutoModelForCausalLM

    if gguf_file is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stat = (model_dir / gguf_file).stat()
    return _hf_gguf_model(model_dir.absolute(), gguf_file, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _hf_gguf_model(model_dir: Path, gguf_file: str, mtime_ns: int, size: int) -> Any:
    # mtime and size in the key: a file written again at the same path is loaded anew.
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=gguf_file, dtype=torch.float32
    ).eval()


def hf_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    max_tokens: int,
    gguf_file: str | None = None,
    lora_dir: Path | None = None,
    **gen_kwargs,
) -> list:
    """Greedy continuation of each prompt by HF transformers, one prompt at a time (no padding),
    stopping at EOS as the engine does. ``gguf_file``: the checkpoint is that GGUF file in
    ``model_dir``. ``lora_dir``: with that PEFT LoRA adapter (PEFT applies it)."""
    if lora_dir is None:
        model = _hf_causal_lm(model_dir, gguf_file)
    else:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        # Not the shared model: PEFT adds the adapter's layers to the one it is given.
        base = AutoModelForCausalLM.from_pretrained(
            model_dir, gguf_file=gguf_file, dtype=torch.float32
        )
        model = PeftModel.from_pretrained(base, lora_dir).eval()
    eos = model.generation_config.eos_token_id
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=eos,
                **gen_kwargs,
            )[0, len(p) :].tolist()
            if eos in ids:
                ids = ids[: ids.index(eos) + 1]
            outs.append(ids)
    return outs


def hf_embeddings(
    model_dir: Path, prompts: list[list[int]], pooling: str, normalize: bool = True
) -> list[torch.Tensor]:
    """HF transformers' embedding of each prompt, one at a time (no padding), in fp32: the
    body's final hidden states (AutoModel: after its final norm), pooled (`lasttoken` or
    `mean`) and L2-normalised when asked, as sentence-transformers pools them."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            hidden = model(torch.tensor([p])).last_hidden_state[0].float()
            vec = hidden[-1] if pooling == "lasttoken" else hidden.mean(dim=0)
            outs.append(torch.nn.functional.normalize(vec, dim=-1) if normalize else vec)
    return outs


def hf_prompt_logprobs(
    model_dir: Path, prompt: list[int], gguf_file: str | None = None
) -> torch.Tensor:
    """HF transformers' log_softmax over the vocabulary at each position of the prompt, in fp32:
    row p scores prompt token p + 1."""
    model = _hf_causal_lm(model_dir, gguf_file)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_no_leak(llm) -> None:
    """Every request has left the engine and every KV block is back in the free queue."""
    stats = llm.engine.stats()
    assert llm.engine.num_requests == 0
    assert stats.num_requests_running == 0
    assert stats.num_requests_waiting == 0
    assert stats.num_free_blocks == stats.num_usable_blocks, stats
    assert stats.kv_cache_usage_perc == 0.0
    pool = llm.engine.kv_cache_manager.pool
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert not llm.engine.kv_cache_manager.req_blocks
    assert not llm.engine.runner.rows


def long_random_prompts(vocab: int = 150000) -> list[dict[str, list[int]]]:
    """Token-id prompts of 1, 17, 300 and 1000 tokens for real-size models (bf16 checks)."""
    g = torch.Generator().manual_seed(0)
    return [
        {"prompt_token_ids": torch.randint(10, vocab, (n,), generator=g).tolist()}
        for n in (1, 17, 300, 1000)
    ]


def first_token_logprob_gaps(outs: list, ref: list) -> list[tuple[int, float]]:
    """Per prompt: how many of the reference's top first-token logprobs the other run also
    returned, and the largest difference among those."""
    gaps = []
    for a, b in zip(outs, ref, strict=True):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        shared = [t for t in first_b if t in first_a]
        gaps.append((len(shared), max((abs(first_a[t] - first_b[t]) for t in shared), default=0.0)))
    return gaps


@contextmanager
def recorded_cascade_prefixes(runner) -> Iterator[list[int]]:
    """The shared-prefix length the runner picks for each graph or decode step, while inside.
    The spy is removed on the way out: it holds the runner, and the cycle would keep its (GPU)
    memory past the engine's end."""
    prefixes: list[int] = []
    choose = runner._cascade_prefix

    def spy(tables, seq_lens):
        prefixes.append(choose(tables, seq_lens))
        return prefixes[-1]

    runner._cascade_prefix = spy
    try:
        yield prefixes
    finally:
        del runner._cascade_prefix
