"""Tiny, randomly initialised Hugging Face checkpoints built locally, for tests and benchmarks.

Nothing is downloaded. :func:`build_tokenizer` trains a byte-level BPE tokenizer on a small
English corpus held in this module; :func:`build_tiny_model` builds a Llama / Mistral / Qwen2 /
Qwen3 / GPT-2 / Gemma 2 / Mixtral / Qwen3-MoE model with that tokenizer and saves both as an
ordinary Hugging Face model directory (``config.json``, ``generation_config.json``, safetensors
weights, ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``), loadable with
``AutoTokenizer`` and ``AutoModelForCausalLM``.

Weights are re-initialised so the model is a useful test oracle rather than a flat one:

* every ``nn.Linear`` (and GPT-2 ``Conv1D``) weight ~ N(0, 1/fan_in), so each attention and
  MLP block adds a contribution about as large as the residual stream; the prediction at a
  position really depends on the earlier tokens (a broken KV cache or attention mask changes
  the output);
* the embedding ~ N(0, 1) and the LM head ~ N(0, 2/fan_in), so logits have a standard
  deviation near 1.4 and the greedy top-1 / top-2 gap is typically a few tenths (median about
  0.3-0.4 on random prompts): fp32 greedy token ids from two correct implementations agree,
  near ties are rare. With ``tie_word_embeddings`` the shared matrix is N(0, 2/hidden_size),
  which keeps the logits at the same scale (the small input embedding is rescaled by the first
  RMSNorm anyway);
* a mixture of experts' stacked expert matrices like ``nn.Linear`` weights, N(0, 1/fan_in), and
  its router's too, so router logits have a standard deviation near 1 (routing depends on the
  token; near ties between the k-th and the next expert are rare);
* every norm weight (input / post-attention / final RMSNorm, Qwen3 q/k norm, GPT-2 LayerNorm)
  is ``1 + 0.1 * N(0, 1)``, so a norm that ignores its weight (or mixes up which one) is
  caught; Gemma 2's norms, applied as ``1 + weight``, store ``0.1 * N(0, 1)``; GPT-2's
  LayerNorm biases are ``0.1 * N(0, 1)`` and its learned positions N(0, 1/hidden_size);
* every projection bias (Qwen2's q/k/v, all of GPT-2's) is ``0.2 * N(0, 1)``, never zero.

Initialisation draws from a private ``torch.Generator`` seeded with ``seed`` in a fixed module
order, so the same arguments give bit-identical weights; the checkpoint is built in float32
and then cast to ``dtype``, so a bfloat16 build is the rounding of the float32 one.

Builds are idempotent: a marker file (:data:`MARKER_NAME`) holding the build arguments is
written last; a later call with the same arguments on a complete directory returns at once.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GenerationConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.pytorch_utils import Conv1D
from transformers.utils import logging as hf_logging

from kvfleet.engine.default_model import cache_dir

logger = logging.getLogger(__name__)

#: The Llama family: one config shape, one engine implementation.
ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
#: Architectures with their own config names and layer structure.
OTHER_ARCHITECTURES: tuple[str, ...] = ("gpt2", "gemma2")
ALL_ARCHITECTURES: tuple[str, ...] = ARCHITECTURES + OTHER_ARCHITECTURES
#: Mixtures of experts: kept out of ALL_ARCHITECTURES, whose session-wide fixtures build every
#: entry (and whose GPU tests run each one); their tests parametrize over this list instead.
MOE_ARCHITECTURES: tuple[str, ...] = ("mixtral", "qwen3_moe")

_CONFIG_CLASSES: dict[str, tuple[type[PretrainedConfig], str]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "mistral": (MistralConfig, "MistralForCausalLM"),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
    "gpt2": (GPT2Config, "GPT2LMHeadModel"),
    "gemma2": (Gemma2Config, "Gemma2ForCausalLM"),
    "mixtral": (MixtralConfig, "MixtralForCausalLM"),
    "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
}
# Norms HF applies as (1 + weight): initialised around 0 so their scale is still about 1.
_ZERO_CENTRED_NORMS = ("Gemma2RMSNorm",)

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Order fixes the ids: bos=0, eos=1, pad=2, im_start=3, im_end=4.
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

#: ChatML-like template. It starts with the bos token, so a rendered prompt must be tokenized
#: with ``add_special_tokens=False`` (what ``apply_chat_template(tokenize=True)`` and vLLM's
#: chat endpoint do); tokenizing a plain completion prompt prepends bos through the
#: post-processor instead.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: Written last into a finished model directory; holds the build arguments.
MARKER_NAME = "kvfleet_tiny_model.json"
# Bump when the tokenizer corpus, initialisation or file layout changes: old builds are redone.
_FORMAT_VERSION = 1

_MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

_PARAGRAPHS: tuple[str, ...] = (
    # computing
    "A computer follows instructions one step at a time, but it does so billions of times "
    "every second.",
    "The processor fetches an instruction from memory, decodes it, and then executes it.",
    "Memory is organised in pages, and the operating system maps virtual pages to physical frames.",
    "When a program needs more memory than the machine has, the system starts to swap pages "
    "to disk.",
    "A cache keeps recently used data close to the processor so that the next access is fast.",
    "Most programs spend their time in a small number of loops, so optimising those loops "
    "matters most.",
    "The graphics card has thousands of small cores that work on many numbers at the same time.",
    "A language model reads a sequence of tokens and predicts the next token in the sequence.",
    "The attention layer lets every token look back at the tokens that came before it.",
    "Keys and values from earlier tokens are stored in a cache, so they are not computed again.",
    "The scheduler decides which requests run in the next step and which requests must wait.",
    "When the cache is full, the engine can preempt a request and run it again later.",
    "Batching many requests together keeps the hardware busy and raises the throughput.",
    "Latency is the time one request takes, and throughput is the work done per second.",
    "A server listens on a port, accepts connections, and answers requests with responses.",
    "The network sends data in packets, and each packet carries an address and a payload.",
    "Files are stored in directories, and each directory can hold other directories.",
    "A database keeps records in tables and answers questions written in a query language.",
    "An index makes searching a large table much faster, at the cost of extra storage.",
    "Version control records every change to the source code, so mistakes can be undone.",
    "Tests check that the program still does what it should after every change.",
    "A compiler turns source code into machine code that the processor can run directly.",
    "An interpreter reads the program line by line and runs each statement as it goes.",
    "Threads share the same memory, so they must use locks to avoid corrupting data.",
    "A queue hands out work in the order it arrived, first in and first out.",
    "A stack keeps the most recent item on top, last in and first out.",
    "Hash tables find a value from its key in constant time on average.",
    "Sorting a list of a million numbers takes a modern machine well under a second.",
    "The kernel handles interrupts, schedules processes, and manages the devices.",
    "A container packages an application with its libraries so it runs the same everywhere.",
    "The cluster runs many containers on many machines and restarts them when they fail.",
    "An operator watches the cluster and changes it until it matches the desired state.",
    "Autoscaling adds replicas when the load rises and removes them when it falls.",
    "Logs record what the program did, and metrics record how much and how fast.",
    "A good error message says what went wrong and what the user can do about it.",
    "Floating point numbers have limited precision, so adding them in a different order can "
    "change the result.",
    "Half precision uses sixteen bits per number and halves the memory a model needs.",
    "Matrix multiplication is the core operation of every neural network.",
    "The softmax function turns a list of scores into probabilities that sum to one.",
    "Greedy decoding always picks the token with the highest probability.",
    "Sampling with a temperature makes the output more varied and less predictable.",
    "A tokenizer splits text into pieces and maps each piece to an integer id.",
    "Byte pair encoding starts from single bytes and merges the most frequent pairs.",
    # cooking
    "To bake bread, mix flour, water, salt, and yeast, then let the dough rise for an hour.",
    "Knead the dough on a floured table until it is smooth and springs back when pressed.",
    "Preheat the oven to two hundred degrees before you put the bread inside.",
    "A good soup starts with onions, carrots, and celery cooked slowly in butter.",
    "Add the stock, bring it to a boil, and then let it simmer for twenty minutes.",
    "Season the soup with salt and pepper, and taste it before you serve it.",
    "Fresh pasta needs only flour and eggs, but it takes patience to roll it thin.",
    "Boil the pasta in plenty of salted water and drain it while it is still firm.",
    "A simple tomato sauce is made with garlic, olive oil, tomatoes, and fresh basil.",
    "Rice should be rinsed until the water runs clear, then cooked with a lid on the pot.",
    "Roast the vegetables at a high heat so the edges turn brown and sweet.",
    "Whisk the eggs with a little milk, pour them into a hot pan, and stir gently.",
    "An omelette cooks in less than two minutes, so have the filling ready before you start.",
    "Chocolate cake needs butter, sugar, eggs, flour, cocoa, and a pinch of salt.",
    "Let the cake cool completely before you spread the icing on top.",
    "A sharp knife is safer than a dull one, because it does not slip on the food.",
    "Wash your hands before cooking, and keep raw meat away from the vegetables.",
    "Lemon juice brightens a dish, and a spoon of honey softens a sour sauce.",
    "Pancakes are ready to flip when small bubbles appear on the surface.",
    "Coffee tastes best when the beans are ground just before brewing.",
    "Tea leaves should steep for three to five minutes, depending on the kind of tea.",
    "The recipe serves four people and takes about forty minutes from start to finish.",
    "Store the leftovers in the fridge and eat them within three days.",
    "A salad of cucumber, tomato, onion, and olives needs only oil, vinegar, and salt.",
    "Slow cooking turns a tough piece of meat into a tender stew.",
    "Bake the cookies for twelve minutes, until the edges are golden and the middle is soft.",
    # weather and nature
    "The weather today is cloudy with a chance of rain in the afternoon.",
    "Tomorrow will be sunny and warm, with a light wind from the south.",
    "A cold front is moving in from the north, bringing snow to the mountains.",
    "The temperature will drop below zero tonight, so cover the plants in the garden.",
    "Thunderstorms are likely in the evening, with heavy rain and strong gusts of wind.",
    "After the storm, a rainbow appeared over the hills to the east.",
    "Fog often forms in the valley on calm, clear nights in autumn.",
    "The summer was the hottest on record, and the rivers ran low for months.",
    "Spring arrives early in the south, and the trees blossom in March.",
    "In winter the days are short, and the sun sets before five in the evening.",
    "The wind turned to the west, and the clouds began to break apart.",
    "Humidity makes a warm day feel hotter, because sweat evaporates more slowly.",
    "The forecast for the weekend is dry, with clear skies and cool mornings.",
    "Snow fell all night, and by morning the roads were covered in white.",
    "The sea was calm, and the boats left the harbour at first light.",
    "Birds fly south in the autumn and return when the weather warms again.",
    "The forest is quiet in the early morning, except for the sound of the stream.",
    "Mountains create their own weather, and conditions can change within minutes.",
    "A dry wind from the desert raised the dust and turned the sky orange.",
    "The moon was full, and its light was bright enough to read by.",
    # numbers and measurement
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "Eleven, twelve, thirteen, fourteen, fifteen, sixteen, seventeen, eighteen, nineteen, twenty.",
    "There are sixty seconds in a minute and sixty minutes in an hour.",
    "A day has twenty four hours, and a week has seven days.",
    "A year has twelve months and three hundred sixty five days, or one more in a leap year.",
    "One kilometre is one thousand metres, and one metre is one hundred centimetres.",
    "Water freezes at zero degrees and boils at one hundred degrees at sea level.",
    "Half of one hundred is fifty, and a quarter of one hundred is twenty five.",
    "The square of twelve is one hundred forty four, and the square root of eighty one is nine.",
    "Pi is a little more than three, about 3.14159, and it never repeats.",
    "A prime number has exactly two divisors: one and itself.",
    "The first primes are 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, and 37.",
    "Powers of two: 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096.",
    "A kilobyte is 1024 bytes, a megabyte is 1024 kilobytes, and a gigabyte is 1024 megabytes.",
    "The meeting starts at 9:30 and ends at 11:15, so it lasts one hour and forty five minutes.",
    "The train leaves at 7:05 and arrives at 8:50; the ticket costs 12.40 euros.",
    "In 2023 the company sold 15,000 units, up from 12,500 units the year before.",
    "The average of 4, 8, and 12 is 8, and their sum is 24.",
    "Ten percent of 250 is 25, and twenty percent of 250 is 50.",
    "The room is 4.5 metres long and 3.2 metres wide, so its area is 14.4 square metres.",
    # everyday life and stories
    "The library opens at nine in the morning and closes at six in the evening.",
    "She walked to the station, bought a ticket, and waited for the next train.",
    "He forgot his umbrella at home and arrived at the office soaking wet.",
    "The children played in the park until the sun went down.",
    "Our neighbours have a small dog that barks every time the postman comes.",
    "The shop on the corner sells fresh bread, milk, cheese, and newspapers.",
    "We planned a trip to the coast, but the car broke down on the way.",
    "The old man told stories about the village as it was fifty years ago.",
    "Every Sunday the family gathers for lunch at the grandparents' house.",
    "The museum has a large collection of paintings, maps, and old clocks.",
    "Please close the window before you leave, because it might rain tonight.",
    "The teacher asked the students to read the first chapter by Monday.",
    "A letter arrived this morning with a stamp from a country far away.",
    "The concert was sold out, so we listened to the music from the street.",
    "He learned to play the piano as a child and still practises every evening.",
    "The bus was late again, and the queue at the stop grew longer and longer.",
    "She opened the book, found her place, and read until midnight.",
    "The market is busiest on Saturday mornings, when the farmers bring fresh fruit.",
    "They painted the kitchen yellow and hung new curtains in the living room.",
    "I would like a cup of coffee, a glass of water, and a slice of cake, please.",
    "Could you tell me the way to the nearest post office?",
    "Thank you very much for your help; I could not have done it without you.",
    "What time is it? It is a quarter past three in the afternoon.",
    "Where are you going? I am going to the market to buy some vegetables.",
    "Why is the sky blue? Because air scatters blue light more than red light.",
    "How many people live in the city? About two million people live there.",
    # science and history
    "The earth goes around the sun once a year and turns on its axis once a day.",
    "Light from the sun takes about eight minutes to reach the earth.",
    "Plants turn sunlight, water, and carbon dioxide into sugar and oxygen.",
    "The human heart beats about seventy times a minute when the body is at rest.",
    "Sound travels faster in water than in air, and faster still in steel.",
    "An atom has a small heavy nucleus surrounded by a cloud of electrons.",
    "The printing press made books cheaper and spread new ideas across Europe.",
    "The first computers filled whole rooms and used thousands of vacuum tubes.",
    "Ancient sailors used the stars to find their way across the open sea.",
    "The steam engine changed how goods were made and how people travelled.",
    "Electricity flows through copper wires much more easily than through rubber.",
    "A magnet has a north pole and a south pole, and opposite poles attract.",
    "Gravity pulls every object toward every other object, but it is a weak force.",
    "The bridge was built in the year 1890 and is still used by cars today.",
    "Scientists test an idea by making a prediction and checking it with an experiment.",
    # code
    "def add(a, b):\n    return a + b",
    "def factorial(n):\n    if n <= 1:\n        return 1\n    return n * factorial(n - 1)",
    "for i in range(10):\n    print(i * i)",
    "while queue:\n    item = queue.pop(0)\n    process(item)",
    "class Request:\n    def __init__(self, prompt, max_tokens):\n        self.prompt = prompt\n"
    "        self.max_tokens = max_tokens",
    "import torch\nx = torch.randn(4, 8)\ny = x @ x.T\nprint(y.shape)",
    "if len(tokens) > max_len:\n    tokens = tokens[-max_len:]",
    "result = [x for x in values if x % 2 == 0]",
    "with open('data.txt') as f:\n    lines = f.read().splitlines()",
    "config = {'hidden_size': 64, 'num_layers': 2, 'vocab_size': 512}",
    "def softmax(x):\n    e = np.exp(x - x.max())\n    return e / e.sum()",
    "logger.info('loaded %d blocks in %.2f seconds', num_blocks, elapsed)",
    "try:\n    value = cache[key]\nexcept KeyError:\n    value = compute(key)\n"
    "    cache[key] = value",
    "assert output.shape == (batch_size, seq_len, hidden_size)",
    "for block_id in block_table:\n    free_blocks.append(block_id)",
    "return sorted(items, key=lambda item: item.priority, reverse=True)",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;",
    'git commit -m "Fix the off by one error in the scheduler"',
    "docker run --rm -p 8000:8000 kvfleet/engine:latest",
    "kubectl get pods -n inference -o wide",
    '{"model": "tiny", "prompt": "Hello", "max_tokens": 16, "temperature": 0.0}',
    'int main(void) {\n    printf("hello, world\\n");\n    return 0;\n}',
    "const total = items.reduce((sum, item) => sum + item.price, 0);",
    'fn main() {\n    let v: Vec<i32> = (1..=5).collect();\n    println!("{:?}", v);\n}',
    # chat-like
    "User: Hello, how are you today?\nAssistant: I am fine, thank you. How can I help you?",
    "User: What is the capital of France?\nAssistant: The capital of France is Paris.",
    "User: Write a short poem about the sea.\nAssistant: The sea is wide, the sea is deep, "
    "it sings the sailors off to sleep.",
    "User: Can you explain what a cache is?\nAssistant: A cache stores results so that they "
    "can be reused quickly.",
    "User: Translate 'good morning' into French.\nAssistant: Good morning is 'bonjour' in French.",
    "User: Summarise the story in one sentence.\nAssistant: A girl finds a lost dog and "
    "brings it home.",
    "You are a helpful assistant. Answer the question briefly and clearly.",
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs.",
    "Café, naïve, résumé, and jalapeño are words borrowed from other languages.",
)

_NUMBER_WORDS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve",
)  # fmt: skip


def _corpus_lines() -> Iterator[str]:
    """The training corpus: hand-written paragraphs plus a few deterministic generated lines."""
    yield from _PARAGRAPHS
    for a in range(1, 13):
        for b in (2, 3, 7):
            yield f"{a} times {b} is {a * b}, and {a} plus {b} is {a + b}."
    for a in range(len(_NUMBER_WORDS) - 1):
        word, nxt = _NUMBER_WORDS[a], _NUMBER_WORDS[a + 1]
        yield f"After {word} comes {nxt}; {word} is smaller than {nxt}."
    for i in range(16):
        yield f"x_{i} = weights[{i}] * inputs[{i}] + bias[{i}]  # layer {i % 4}"


def train_byte_level_bpe(vocab_size: int, special_tokens: Sequence[str] = ()) -> Tokenizer:
    """A byte-level BPE tokenizer trained on the built-in corpus: ``special_tokens`` first (ids 0,
    1, ...), the 256 byte symbols, then merges up to ``vocab_size`` or until no pair of the
    corpus occurs twice. No post-processor."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    return tok


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Trains the tiny models' tokenizer once per vocab size; returns its JSON."""
    tok = train_byte_level_bpe(vocab_size, SPECIAL_TOKENS)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tok.to_str()


def build_tokenizer(
    path: str | Path, *, vocab_size: int = 512, model_max_length: int = 1024
) -> PreTrainedTokenizerFast:
    """Trains the tiny byte-level BPE tokenizer and saves it (``save_pretrained``) into ``path``.

    The vocabulary holds ``vocab_size`` entries including the specials (``<|bos|>`` = 0,
    ``<|eos|>`` = 1, ``<|pad|>`` = 2, ``<|im_start|>`` = 3, ``<|im_end|>`` = 4) and all 256
    byte symbols, so any unicode text round-trips. Should the corpus run out of merges before
    ``vocab_size`` (only for vocabularies of several thousand) the tokenizer is smaller, like a
    real checkpoint whose embedding is padded. Encoding prepends ``<|bos|>``.
    """
    if vocab_size < _MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {_MIN_VOCAB_SIZE}, got {vocab_size}")
    path = Path(path)
    tok = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    if tok.get_vocab_size() < vocab_size:
        logger.warning(
            "tiny tokenizer corpus yields only %d of %d tokens", tok.get_vocab_size(), vocab_size
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
    logger.debug("saved tiny tokenizer (%d tokens) to %s", len(tokenizer), path)
    return tokenizer


def _build_args(
    arch: str,
    seed: int,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    max_shard_size: str | None,
    dtype: torch.dtype,
    config_overrides: dict[str, Any],
) -> dict[str, Any]:
    """The marker contents: every argument that changes the files, JSON-normalised."""
    return json.loads(
        json.dumps(
            {
                "format_version": _FORMAT_VERSION,
                "arch": arch,
                "seed": seed,
                "vocab_size": vocab_size,
                "hidden_size": hidden_size,
                "num_layers": num_layers,
                "num_heads": num_heads,
                "num_kv_heads": num_kv_heads,
                "max_position_embeddings": max_position_embeddings,
                "tie_word_embeddings": tie_word_embeddings,
                "max_shard_size": max_shard_size,
                "dtype": str(dtype).removeprefix("torch."),
                "config_overrides": config_overrides,
            },
            sort_keys=True,
            default=repr,
        )
    )


def _is_complete(path: Path, args: dict[str, Any]) -> bool:
    """Whether ``path`` holds a finished build with exactly these arguments."""
    try:
        marker = json.loads((path / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if marker != args:
        return False
    needed = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    if not all((path / name).is_file() for name in needed):
        return False
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError):
            return False
        return all((path / shard).is_file() for shard in shards)
    return (path / "model.safetensors").is_file()


def _make_config(
    arch: str,
    tokenizer: PreTrainedTokenizerFast,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    config_overrides: dict[str, Any],
) -> PretrainedConfig:
    config_cls, hf_class = _CONFIG_CLASSES[arch]
    special_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch == "gpt2":
        gpt2_kwargs: dict[str, Any] = {
            "vocab_size": vocab_size,
            "n_embd": hidden_size,
            "n_layer": num_layers,
            "n_head": num_heads,
            "n_positions": max_position_embeddings,
            "tie_word_embeddings": tie_word_embeddings,
            "architectures": [hf_class],
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            **special_ids,
            **config_overrides,
        }
        return config_cls(**gpt2_kwargs)
    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 3 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        **special_ids,
        "architectures": [hf_class],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_dropout": 0.0,
    }
    if arch in ("mistral", "mixtral"):
        # MistralConfig defaults to a 4096-token sliding window. A tiny model is full-attention
        # unless the caller asks otherwise (sliding_window=... in config_overrides), so a window
        # never applies silently.
        kwargs["sliding_window"] = None
    if arch in ("qwen3", "qwen3_moe"):
        # Qwen3Config defaults head_dim to 128 regardless of hidden_size.
        kwargs["head_dim"] = hidden_size // num_heads
    if arch == "mixtral":
        # Mixtral-8x7B's routing, 8 experts and the top 2, at the tiny width.
        kwargs.update(num_local_experts=8, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        # Qwen3-30B-A3B routes to 8 of 128 experts of a narrow width; tiny: 3 of 8, each half
        # as wide as the dense MLP. norm_topk_prob as the real one (True) by default.
        kwargs.update(
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=hidden_size,
            norm_topk_prob=True,
        )
    if arch == "gemma2":
        # Gemma2Config's defaults are gemma-2-9b's (head_dim 256, a 4096-token window). Tiny
        # ones instead, with a window short enough to matter on a 200-token prompt, and a query
        # scalar equal to head_dim as in gemma-2-2b/9b.
        del kwargs["hidden_act"]
        kwargs.update(
            head_dim=hidden_size // num_heads,
            query_pre_attn_scalar=hidden_size // num_heads,
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=32,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        )
    kwargs.update(config_overrides)
    return config_cls(**kwargs)


@torch.no_grad()
def _init_weights(model: PreTrainedModel, seed: int) -> None:
    """Re-initialises every parameter (see the module docstring) from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)

    def normal_(tensor: torch.Tensor, mean: float, std: float) -> None:
        values = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
        tensor.copy_(values * std + mean)

    output_embeddings = model.get_output_embeddings()
    done: set[int] = set()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter):
            # Mixture-of-experts weights, stacked [experts, out, in] like Linear weights.
            for stacked in (gate_up, down):
                normal_(stacked, 0.0, math.sqrt(1.0 / stacked.shape[-1]))
                done.add(id(stacked))
            continue
        if "Router" in type(module).__name__ and isinstance(weight, nn.Parameter):
            # The router's logits have a standard deviation near 1: routing depends on the
            # token, and the k-th and next expert's probabilities are rarely near ties.
            normal_(weight, 0.0, math.sqrt(1.0 / weight.shape[-1]))
        elif isinstance(module, nn.Linear | Conv1D):
            # Conv1D (GPT-2) stores its weight [in, out].
            fan_in = module.in_features if isinstance(module, nn.Linear) else module.weight.shape[0]
            gain = 2.0 if module is output_embeddings else 1.0
            if id(module.weight) not in done:
                normal_(module.weight, 0.0, math.sqrt(gain / fan_in))
            if module.bias is not None:
                normal_(module.bias, 0.0, 0.2)
                done.add(id(module.bias))
        elif isinstance(module, nn.Embedding):
            tied = output_embeddings is not None and output_embeddings.weight is module.weight
            std = math.sqrt(2.0 / module.embedding_dim) if tied else 1.0
            if name.endswith(".wpe"):
                # GPT-2's learned positions: half the variance of a tied token embedding, so
                # the token, not its position, dominates what the first LayerNorm sees.
                std = math.sqrt(1.0 / module.embedding_dim)
            if id(module.weight) not in done:
                normal_(module.weight, 0.0, std)
        elif (
            isinstance(weight, nn.Parameter)
            and weight.dim() == 1
            and ("norm" in name.lower() or isinstance(module, nn.LayerNorm))
        ):
            zero_centred = type(module).__name__ in _ZERO_CENTRED_NORMS
            normal_(weight, 0.0 if zero_centred else 1.0, 0.1)
            bias = getattr(module, "bias", None)
            if isinstance(bias, nn.Parameter):
                normal_(bias, 0.0, 0.1)
                done.add(id(bias))
        else:
            continue
        if isinstance(weight, nn.Parameter):
            done.add(id(weight))
    missed = [n for n, p in model.named_parameters() if id(p) not in done]
    if missed:
        raise RuntimeError(f"tiny model init left parameters untouched: {missed}")


def _clear_weights(path: Path) -> None:
    """Removes weights (and the marker) of an earlier build, so no stale shard survives."""
    (path / MARKER_NAME).unlink(missing_ok=True)
    for pattern in ("model*.safetensors", "model*.safetensors.index.json", "pytorch_model*"):
        for stale in path.glob(pattern):
            stale.unlink()


def build_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Builds (or finds already built) a tiny random ``arch`` checkpoint with tokenizer at ``path``.

    ``config_overrides`` go to the config class last, e.g. ``intermediate_size=256``,
    ``rope_theta=500000.0``, ``rope_scaling={"rope_type": "llama3", ...}`` or, for Mistral,
    ``sliding_window=16`` (the default here is ``None``: full attention). ``max_shard_size``
    (e.g. ``"200KB"``) splits the safetensors weights into shards with an index file.

    ``num_kv_heads`` defaults to 2 (GPT-2: ``num_heads``, it has no grouped-query attention).
    Embeddings are untied unless asked for, also for GPT-2 and Gemma 2 whose real checkpoints
    tie them: a random tied head mostly predicts the input token again, so greedy output
    degenerates into repeats and makes a weak oracle. Gemma 2 is built with ``head_dim`` and
    ``query_pre_attn_scalar`` both ``hidden_size // num_heads``, a 32-token sliding window on
    even layers and soft-caps of 50 (attention) and 30 (final logits); override any of them by
    name. Returns ``path``.
    """
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ALL_ARCHITECTURES}")
    if num_kv_heads is None:
        num_kv_heads = num_heads if arch == "gpt2" else 2
    if arch == "gpt2" and num_kv_heads != num_heads:
        raise ValueError("gpt2 has no grouped-query attention: num_kv_heads must equal num_heads")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} not divisible by num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
    path = Path(path)
    args = _build_args(
        arch,
        seed,
        vocab_size,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        max_position_embeddings,
        tie_word_embeddings,
        max_shard_size,
        dtype,
        config_overrides,
    )
    if _is_complete(path, args):
        logger.debug("tiny %s model already built at %s", arch, path)
        return path

    logger.info("building tiny %s model at %s", arch, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        tokenizer = build_tokenizer(
            staging, vocab_size=vocab_size, model_max_length=max_position_embeddings
        )
        config = _make_config(
            arch,
            tokenizer,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie_word_embeddings,
            config_overrides=config_overrides,
        )
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _init_weights(model, seed)
        model.to(dtype)
        model.eval()
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        save_kwargs: dict[str, Any] = {}
        if max_shard_size is not None:
            save_kwargs["max_shard_size"] = max_shard_size
        progress_bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(staging, **save_kwargs)
        finally:
            if progress_bars:
                hf_logging.enable_progress_bar()
        (staging / MARKER_NAME).write_text(json.dumps(args, indent=2, sort_keys=True) + "\n")

        if path.is_dir() and any(path.iterdir()):
            # Keep whatever else lives there; replace our files, marker last.
            _clear_weights(path)
            for item in sorted(staging.iterdir(), key=lambda p: p.name == MARKER_NAME):
                os.replace(item, path / item.name)
        else:
            if path.is_dir():
                path.rmdir()
            os.replace(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("built tiny %s model at %s", arch, path)
    return path


TINY_MODEL_NAME = "kvfleet-tiny-random-llama"


def tiny_model_path() -> Path:
    """The tests' and benchmarks' small random Llama, built once in the user's cache directory:
    fast on any machine, nothing downloaded, its text meaningless."""
    return build_tiny_model(
        cache_dir() / TINY_MODEL_NAME,
        "llama",
        seed=0,
        vocab_size=1024,
        hidden_size=128,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        max_position_embeddings=2048,
    )


def build_tiny_embedding_model(
    path: str | Path,
    pooling: str = "lasttoken",
    *,
    arch: str = "qwen3",
    normalize: bool = True,
    is_matryoshka: bool = False,
    **model_args: Any,
) -> Path:
    """A tiny random embedding checkpoint laid out as Qwen3-Embedding ships: a bare ``arch``
    body's weights (``layers.0...``, ``norm.weight``, GPT-2's ``h.0...``; no ``lm_head``) under
    a config.json that still names the causal LM (``Qwen3ForCausalLM``), and
    sentence-transformers files (``modules.json``, ``1_Pooling/config.json`` with ``pooling`` as
    its mode: ``lasttoken`` or ``mean``, and a Normalize module when ``normalize``).
    ``is_matryoshka`` declares Matryoshka dimensions in config.json. ``model_args`` go to
    build_tiny_model. Returns ``path``; rebuilt every call."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    causal = build_tiny_model(path.with_name(path.name + "-causal-lm"), arch, **model_args)
    # The body's names in the causal LM's checkpoint start with HF's base-model prefix.
    prefix = "transformer." if arch == "gpt2" else "model."
    path.mkdir(parents=True, exist_ok=True)
    for item in causal.iterdir():
        if item.suffix != ".safetensors" and item.name != MARKER_NAME and item.is_file():
            shutil.copy(item, path / item.name)
    body = {
        name.removeprefix(prefix): tensor
        for name, tensor in load_file(causal / "model.safetensors").items()
        if not name.startswith("lm_head.")
    }
    save_file(body, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    if is_matryoshka:
        config["is_matryoshka"] = True
    (path / "config.json").write_text(json.dumps(config, indent=2))
    st = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"})
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    pooling_config = {
        # GPT-2's config.json calls it n_embd.
        "word_embedding_dimension": config.get("hidden_size", config.get("n_embd")),
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_lasttoken": pooling == "lasttoken",
    }
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2))
    return path
