"""Model factory: Qwen2-architecture presets, a from-scratch initializer and a loader.

Every preset keeps ``hidden_size`` and ``intermediate_size`` multiples of 128, so each decoder linear
splits into whole 128x128 FP8 weight blocks (and whole 1x128 activation tiles).

Presets (parameter counts with this project's ~310-token vocabulary, embeddings tied where noted):

=====================  ======  =====  ======  =====  ==  ====  ==========================================
preset                 hidden  inter  layers  heads  kv  tied  params / bf16 size / use
=====================  ======  =====  ======  =====  ==  ====  ==========================================
tiny                     128    384      4       4    2  yes   ~0.83M; CPU demo and unit tests
small                    384   1024     12       6    2  yes   ~19M; quick GPU runs
100m                     768   2048     16      12    4  yes   ~100M; GPU smoke tests of the full loop
qwen2.5-1.5b-shape      1536   8960     28      12    2  yes   ~1.31B, 2.6 GB; benchmarks
qwen2.5-7b-shape        3584  18944     28      28    4  no    ~6.5B, 13 GB; benchmarks
=====================  ======  =====  ======  =====  ==  ====  ==========================================

The two ``-shape`` presets copy the real Qwen2.5 decoder shapes (and rope theta, norm eps, context
length) with random weights. Their vocabulary is ours, not Qwen's 151,936 tokens: the decoder stack,
which is what FP8 changes, is identical, while the embedding and lm_head are ~1.1B parameters smaller
(7B) and the model initializes and saves in seconds instead of minutes. Benchmarks that need the real
embedding cost can pass ``vocab_size=151936`` through ``overrides``.

Memory: large presets are built directly in bfloat16 (`init_model` sets the default dtype while
constructing), so initializing the 7B shape needs about 13 GB of host memory plus the same on disk;
nothing large is built unless its preset is asked for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from infir2_rl.models.tokenizer import build_tokenizer

_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True,
    },
    "small": {
        "hidden_size": 384,
        "intermediate_size": 1024,
        "num_hidden_layers": 12,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True,
    },
    "100m": {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b-shape": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b-shape": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": False,
    },
}
# Presets whose float32 copy would not fit comfortably in host memory: built and saved in bfloat16.
_BF16_BY_DEFAULT = {"100m", "qwen2.5-1.5b-shape", "qwen2.5-7b-shape"}


def preset_config(preset: str, tokenizer: PreTrainedTokenizerBase, **overrides: Any) -> Qwen2Config:
    """Qwen2Config for `preset` with vocabulary and special-token ids taken from `tokenizer`."""
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is unknown: choose one of {sorted(PRESETS)}")
    kwargs = {
        **_COMMON,
        **PRESETS[preset],
        "vocab_size": len(tokenizer),
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **overrides,
    }
    config = Qwen2Config(**kwargs)
    for name in ("hidden_size", "intermediate_size"):
        if getattr(config, name) % 128:
            raise ValueError(f"{name}={getattr(config, name)}: must be a multiple of 128 (FP8 blocks)")
    return config


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def init_model(
    out_dir: str | Path,
    preset: str = "tiny",
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> Path:
    """Write a randomly initialized Qwen2 model, its tokenizer and generation config to `out_dir`.

    `dtype=None` picks float32 for tiny/small and bfloat16 for the larger presets. The same seed gives
    the same weights. The directory loads with ``AutoModelForCausalLM.from_pretrained(out_dir)`` and
    ``AutoTokenizer.from_pretrained(out_dir)`` with ``HF_HUB_OFFLINE=1``.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir={str(out)!r} is a file: choose a new directory")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"out_dir={str(out)!r} exists and is not empty: choose a new directory or delete it")
    if dtype is None:
        dtype = torch.bfloat16 if preset in _BF16_BY_DEFAULT else torch.float32
    tokenizer = build_tokenizer()
    config = preset_config(preset, tokenizer, **overrides)
    # fork_rng leaves the caller's global RNG untouched; HF's weight init draws from the global one.
    with torch.random.fork_rng(devices=[]), _default_dtype(dtype):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def load_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load an HF directory (ours or a real checkpoint) as (model in eval mode, tokenizer), offline.

    `dtype=None` keeps the dtype the checkpoint was saved in.
    """
    if not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"path={str(path)!r} has no config.json: pass a directory written by init-model or save"
        )
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or "auto", local_files_only=True)
    cast(torch.nn.Module, model).to(device)  # cast: transformers wraps `to` in a way mypy cannot call
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model, tokenizer
