"""GGUF files written from a tiny HF Llama-family checkpoint the way llama.cpp's converter writes
them: llama.cpp tensor names, q/k rows permuted for its rope layout (Llama, Mistral), norms kept
F32 and the matrices stored as the asked-for type, with the tokenizer as GGUF metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _gguf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK_NAMES[module]}.{suffix}"


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `permute` of q/k rows."""
    shape = weights.shape
    return (
        weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def _add_tokenizer(writer, model_dir: Path) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    special = {added["id"] for added in tok.get("added_tokens", [])}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_add_bos_token(True)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[cfg["bos_token"]])
    writer.add_eos_token_id(vocab[cfg["eos_token"]])
    writer.add_pad_token_id(vocab[cfg["pad_token"]])


def write_gguf(
    model_dir: Path, out: Path, qtype: str, *, arch: str = "llama", tokenizer: bool = True
) -> Path:
    """Writes ``model_dir`` (a tiny HF ``arch`` checkpoint, one safetensors file) as the GGUF
    ``out`` with its matrices stored as ``qtype`` (a GGMLQuantizationType name)."""
    import gguf
    from gguf.quants import quantize

    config = json.loads((model_dir / "config.json").read_text())
    gguf_arch = _ARCH[arch]
    n_head, n_kv_head = config["num_attention_heads"], config["num_key_value_heads"]
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}
    writer = gguf.GGUFWriter(out, gguf_arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv_head)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if tokenizer:
        _add_tokenizer(writer, model_dir)
    quant = gguf.GGMLQuantizationType[qtype]
    for name, values in load_file(model_dir / "model.safetensors").items():
        values = values.astype(np.float32)
        if gguf_arch == "llama" and ".q_proj." in name:
            values = _permute(values, n_head)
        elif gguf_arch == "llama" and ".k_proj." in name:
            values = _permute(values, n_kv_head)
        if values.ndim == 1 or quant == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name), values)
        elif quant == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(_gguf_name(name), values.astype(np.float16))
        else:
            writer.add_tensor(_gguf_name(name), quantize(values, quant), raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
