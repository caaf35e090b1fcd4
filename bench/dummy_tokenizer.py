"""A tokenizer for a dummy-weight benchmark model, so a server can take and return text.

``bench/models/*`` hold a real checkpoint's ``config.json`` only. Random weights sample any id
below ``vocab_size``, so every one of them must be a token that decodes. This writes a copy of
the config plus a byte-level BPE tokenizer trained on :mod:`tests.support.tiny_model`'s corpus
(a few hundred merges: English text takes about as many tokens as with a real tokenizer),
padded with filler tokens (decoding to `` <id>``) to exactly ``vocab_size``, with the model
family's special tokens at the ids the config names and the family's chat template::

    python bench/dummy_tokenizer.py bench/models/gemma-2-2b-it /tmp/gemma-2-2b-it
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, models, processors
from transformers import PreTrainedTokenizerFast

# The repository root, for the tests' tiny-model builder and its corpus (tests/support).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.tiny_model import train_byte_level_bpe

logger = logging.getLogger("bench.dummy_tokenizer")

# The corpus runs out of pairs seen twice long before this many tokens.
_LEARNED_TOKENS = 4096

#: Gemma 2's turn format; like Gemma's own template it has no system role and rejects one.
GEMMA2_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ raise_exception('Gemma 2 has no system role: put the instructions in a user turn') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


@dataclass(frozen=True)
class Family:
    """A model family's special tokens. ``bos``, ``eos`` and ``pad`` go to the ids the config
    names (the first id of an ``eos_token_id`` list); ``fixed`` ones, which a config does not
    name, to the real tokenizer's ids."""

    bos: str | None
    eos: str
    pad: str | None = None
    fixed: dict[int, str] = field(default_factory=dict)
    add_bos: bool = False  # prepended when text is encoded, as the real tokenizer does
    chat_template: str | None = None


FAMILIES: dict[str, Family] = {
    "gemma2": Family(
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        fixed={106: "<start_of_turn>", 107: "<end_of_turn>"},
        add_bos=True,
        chat_template=GEMMA2_CHAT_TEMPLATE,
    ),
    "gpt2": Family(bos="<|endoftext|>", eos="<|endoftext|>"),
    # Llama 3 and 3.1: the header and end-of-turn tokens at the real tokenizer's ids.
    "llama": Family(
        bos="<|begin_of_text|>",
        eos="<|end_of_text|>",
        fixed={128006: "<|start_header_id|>", 128007: "<|end_header_id|>", 128009: "<|eot_id|>"},
        add_bos=True,
        chat_template=LLAMA3_CHAT_TEMPLATE,
    ),
}


def family_of(config: dict[str, Any]) -> Family:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"no dummy tokenizer for model_type {model_type!r}; have {list(FAMILIES)}")
    return FAMILIES[model_type]


def special_tokens(config: dict[str, Any], family: Family) -> dict[int, str]:
    """Special token of each reserved id; every id the config names must get one."""
    eos = config.get("eos_token_id")
    eos_ids = list(eos) if isinstance(eos, list) else [eos]
    specials = dict(family.fixed)
    for token_id, token in (
        (config.get("bos_token_id"), family.bos),
        (eos_ids[0], family.eos),
        (config.get("pad_token_id"), family.pad),
    ):
        if token_id is None or token is None:
            continue
        if specials.setdefault(token_id, token) != token:
            raise ValueError(f"id {token_id} would be both {specials[token_id]} and {token}")
    if len(set(specials.values())) != len(specials):
        raise ValueError(f"one special token at two ids: {specials}")
    unnamed = [i for i in eos_ids if i not in specials]
    if unnamed:
        raise ValueError(f"eos ids {unnamed} of the config are no special token of the family")
    too_big = [i for i in specials if not 0 <= i < config["vocab_size"]]
    if too_big:
        raise ValueError(f"special ids {too_big} outside the vocabulary")
    return specials


def build_dummy_tokenizer(config: dict[str, Any]) -> PreTrainedTokenizerFast:
    """The tokenizer for ``config`` (a parsed config.json); see the module docstring."""
    family = family_of(config)
    vocab_size = int(config["vocab_size"])
    specials = special_tokens(config, family)
    room = vocab_size - len(specials)
    trained = train_byte_level_bpe(min(room, _LEARNED_TOKENS))
    learned = sorted(trained.get_vocab().items(), key=lambda kv: kv[1])
    if len(learned) > room:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the 256 byte symbols")
    free_ids = iter([i for i in range(vocab_size) if i not in specials])
    vocab = dict(specials)
    # The shorter iterable first: zip then stops without taking an id it cannot use.
    for (token, _), i in zip(learned, free_ids, strict=False):
        vocab[i] = token
    for i in free_ids:
        vocab[i] = f"Ġ<{i}>"  # Ġ is the byte-level symbol of a space
    token_to_id = {token: i for i, token in vocab.items()}
    if len(token_to_id) != vocab_size:
        raise RuntimeError("two ids got the same token string")
    merges = [tuple(m) for m in json.loads(trained.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=token_to_id, merges=merges))
    tok.pre_tokenizer = trained.pre_tokenizer
    tok.decoder = trained.decoder
    # Already in the vocabulary, so they keep their ids; marked special, they are never split.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for _, t in sorted(specials.items())]
    )
    placed = set(specials.values())
    if family.add_bos and family.bos in placed:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A",
            pair=f"{family.bos} $A $B:1",
            special_tokens=[(family.bos, token_to_id[family.bos])],
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=family.bos if family.bos in placed else None,
        eos_token=family.eos,
        pad_token=family.pad if family.pad in placed else None,
        additional_special_tokens=list(family.fixed.values()),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = family.chat_template
    return tokenizer


def write_model_dir(src: str | Path, dst: str | Path) -> Path:
    """Copies ``src``'s config.json into ``dst`` and saves its dummy tokenizer there."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    tokenizer = build_dummy_tokenizer(config)
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "config.json", dst / "config.json")
    tokenizer.save_pretrained(dst)
    logger.info("wrote %s: config.json and a %d-token dummy tokenizer", dst, len(tokenizer))
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", type=Path, help="directory with the real model's config.json")
    p.add_argument("out", type=Path, help="directory to write config.json and the tokenizer to")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    write_model_dir(args.model, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
