"""A small byte-level BPE tokenizer with a ChatML chat template, built locally (no downloads).

Layout, chosen to behave like Qwen2's tokenizer at a scale a 1M-parameter model can afford:

- Base alphabet: the 256 byte-level symbols, so any UTF-8 text (including real datasets) round-trips.
- Pre-tokenizer: Qwen2's split regex, in which ``\\p{N}`` matches one digit at a time, so every digit is
  always its own token. Arithmetic needs that: with multi-digit tokens, "68" and "6","8" would be
  unrelated symbols and carries could not be learned digit by digit.
- Merges: a few dozen learned with `tokenizers`' BPE trainer from the project's own synthetic corpus
  (question and answer phrases such as " answer", "boxed"), so common words cost one token.
- Added tokens: ``<|endoftext|>`` (padding), ``<|im_start|>``, ``<|im_end|>`` (end of a turn and the eos
  token: generation stops there) as special tokens; ``<think>`` and ``</think>`` as normal added tokens,
  so decoding with ``skip_special_tokens=True`` keeps them (the reward looks for ``</think>``).

The object is a transformers `Qwen2Tokenizer` built from our vocabulary and merges: that is the class
`AutoTokenizer` picks for a ``qwen2`` model directory (it rebuilds the pipeline from vocab and merges:
NFC normalizer, the split regex, byte-level), so what we build and what loads back encode identically.

The chat template is Qwen2's ChatML without the default system prompt (it would cost ~20 tokens per
sample): ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, and ``add_generation_prompt``
appends ``<|im_start|>assistant\\n``. An assistant turn therefore ends with the eos token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2 import Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from infir2_rl.data.synthetic import tokenizer_corpus

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
# Qwen2's pre-tokenizer pattern (words, single digits, punctuation runs, newlines, spaces), taken from
# transformers so that merges are learned on exactly the pieces `Qwen2Tokenizer` produces.
SPLIT_PATTERN: str = PRETOKENIZE_REGEX
# Number of learned merges on top of the 256 byte symbols; keeps the vocabulary near 300.
NUM_MERGES = 50
MODEL_MAX_LENGTH = 32768

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _learn_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train BPE merges on the synthetic corpus, with the same normalizer/pre-tokenizer Qwen2 uses."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + NUM_MERGES,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=alphabet,
    )
    # The think tags become added tokens, so merges spent on them would be wasted; the role names
    # appear in every rendered turn, so they are worth a merge each.
    texts = [t.replace(THINK_START, " ").replace(THINK_END, " ") for t in tokenizer_corpus()]
    texts += ["user", "assistant", "system"] * 500
    tok.train_from_iterator(texts, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    return dict(model["vocab"]), [tuple(m) for m in model["merges"]]


def build_tokenizer(out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Build the project tokenizer (deterministic) and, if `out_dir` is given, save it there.

    It is a transformers `Qwen2Tokenizer` (a fast, `tokenizers`-backed tokenizer): that is the class
    `AutoTokenizer` picks for a `qwen2` model directory, so the object built here and the one loaded
    back with ``AutoTokenizer.from_pretrained(out_dir)`` (offline) encode identically.
    """
    vocab, merges = _learn_vocab_and_merges()
    # Passed as one dict: transformers' stubs type `merges` as strings and `unk_token` as non-optional,
    # while the fast backend takes (left, right) pairs and Qwen2 checkpoints have no unk token.
    options: dict[str, Any] = {
        "vocab": vocab,
        "merges": merges,
        "unk_token": None,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "extra_special_tokens": [IM_START],
        "model_max_length": MODEL_MAX_LENGTH,
    }
    tokenizer = Qwen2Tokenizer(**options)
    # Not special: `decode(..., skip_special_tokens=True)` must keep them for the reward.
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_START, THINK_END)])
    tokenizer.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer
