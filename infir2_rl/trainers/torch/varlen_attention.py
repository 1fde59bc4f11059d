"""Varlen (flash) attention for packed micro-batches on CUDA, as a transformers attention implementation.

A packed micro-batch is one row of N tokens holding several sequences (scoring.py). transformers' SDPA path
turns its position ids into a block-diagonal N x N boolean mask, which SDPA can only run with the
memory-efficient kernel over the whole N x N square: every sequence attends over (and pays for) the full
packed row. ``torch.nn.attention.varlen.varlen_attn`` runs flash attention over each sequence alone from the
cumulative lengths ``cu_seq`` (N + 1 offsets): the work of the sequences' own causal triangles, no mask.

``use_varlen(model, cu_seq, max_len)`` switches a model's attention to it for one call; transformers then
builds no mask (a custom implementation has no mask function) and hands the extra keyword arguments to the
attention of every layer. Where it is unavailable (CPU, a torch without the module) the packed path keeps
SDPA with the block-diagonal mask, and ``varlen_available`` says why once, loudly.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)
NAME = "infir2_varlen"


@functools.cache
def _varlen_fn() -> tuple[Any, bool, bool] | None:
    """(varlen_attn, takes window_size, takes enable_gqa), or None when this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "window_size" in params, "enable_gqa" in params


def varlen_available(device: torch.device, warn: bool = True) -> bool:
    """True when packed micro-batches on ``device`` can use varlen flash attention (logged once if not, on
    CUDA, unless ``warn`` is off: ``trainer.pack_sequences: auto`` asks before it packs)."""
    if device.type != "cuda":
        return False
    if _varlen_fn() is None:
        if warn:
            _warn_once(f"torch {torch.__version__} has no torch.nn.attention.varlen")
        return False
    return _register()


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning(
        "packed micro-batches use SDPA with a block-diagonal mask (slower: every token attends over the whole "
        "packed row): %s",
        reason,
    )


@functools.cache
def _register() -> bool:
    try:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, _varlen_attention_forward)
    except Exception as exc:  # an older transformers without the registry
        _warn_once(f"transformers cannot register an attention implementation ({exc})")
        return False
    return True


def _varlen_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention signature: q (1, Hq, N, D), k/v (1, Hkv, N, D) -> (1, N, Hq, D)."""
    fn = _varlen_fn()
    cu_seq, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if fn is None or cu_seq is None or max_len is None or query.shape[0] != 1:
        raise RuntimeError(
            f"{NAME} attention needs one packed row and cu_seq_lens_q / max_length_q (use scoring.score_tokens)"
        )
    # Flash runs in BF16/FP16 only. Under autocast SDPA would cast q/k/v (FP32 after RoPE, whose cos/sin
    # take the FP32 residual stream's dtype) to the autocast dtype; do the same here.
    dtype = query.dtype
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
    if dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeError(
            f"{NAME}: flash attention needs BF16/FP16 inputs, got {dtype} outside autocast (model.dtype float32 "
            "on a GPU): use model.dtype auto/bfloat16 or trainer.pack_sequences=false"
        )
    q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # (N, H, D)
    return varlen_causal(q, k, v, cu_seq, max_len, scaling)[None], None


def varlen_causal(
    q: Tensor, k: Tensor, v: Tensor, cu_seq: Tensor, max_len: int, scaling: float | None = None
) -> Tensor:
    """Causal flash attention over each sequence of a packed row: q (N, Hq, D), k/v (N, Hkv, D), Hkv dividing
    Hq (GQA), offsets ``cu_seq`` (sequences + 1, int32, as ``varlen_kwargs`` makes them) -> (N, Hq, D)."""
    fn = _varlen_fn()
    if fn is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    varlen_attn, has_window, has_gqa = fn
    groups = q.shape[1] // k.shape[1]
    extra: dict[str, Any] = {"window_size": (-1, 0)} if has_window else {"is_causal": True}
    if groups > 1:
        if has_gqa:
            extra["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if scaling is not None and "scale" in inspect.signature(varlen_attn).parameters:
        extra["scale"] = scaling
    elif scaling is not None and abs(scaling - q.shape[-1] ** -0.5) > 1e-12:
        raise RuntimeError(f"{NAME}: this torch's varlen_attn takes no scale and the model uses {scaling}")
    return varlen_attn(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seq, cu_seq, max_len, max_len, **extra
    )


@contextmanager
def use_varlen(model: nn.Module) -> Iterator[None]:
    """Within the block the model's attention is varlen flash attention (pass cu_seq_lens_q etc. to it)."""
    config: Any = model.config
    previous = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous


MIN_SEQUENCE_SLOTS = 16


def sequence_slots(count: int) -> int:
    """The number of sequences a padded packed row is launched with: the power of two >= ``count``, at least
    16. Each slot costs flash attention a few programs that return at once (bench/varlen_grid.py, H100, 8,192
    tokens, 1.5B heads: +0.07 ms per attention forward and backward at 16 slots, +0.33 ms at 64)."""
    return max(MIN_SEQUENCE_SLOTS, 1 << (count - 1).bit_length())


def graph_max_len(longest: int, padded_to: int) -> int:
    """The longest-sequence bound a padded packed row is launched with: an eighth of ``padded_to`` (rounded up
    to 128) when its longest real sequence fits in that, else ``padded_to``. Flash's grid has
    ceil(max_len / 128) programs per sequence slot: a row of 32 sequences of ~320 tokens launched with its
    whole length, 10,240, ran 80 per slot where 3 work, and packed 1.5B RL training ran 3% slower than padded
    (H100, bench/rl_1p5b.sh). The bound is part of the graphs' key, so it takes two values per row length,
    not one per longest sequence: a power of two >= the longest (at least 512) gave the RL-shaped batch of
    bench/train_packed.py more than the 16 shapes the graphs then held, and FP8 packed there 1.01x BF16 (this
    rule: 12 shapes, 1.05x; docs/performance.md, "Packed micro-batches")."""
    short = min(padded_to, max(128, -(-padded_to // 8 // 128) * 128))
    return short if longest <= short else padded_to


def varlen_kwargs(
    lengths: Tensor | Sequence[int], padded_to: int | None = None, device: torch.device | None = None
) -> dict[str, Any]:
    """Model keyword arguments of a packed row of sequences of these lengths (a tensor, or numbers the host
    knows: then ``device`` is where the offsets go, copied without waiting for the device).

    ``padded_to`` (the layer graphs, which replay one launch for rows of any composition): the row has
    ``padded_to`` tokens, the real ones first; the pads follow as sequences of their own of at most
    ``graph_max_len`` tokens each, the offsets are padded to ``sequence_slots`` entries by repeating the last
    (empty sequences), and the longest length is given as ``graph_max_len``. So the arguments' shapes and the
    integers depend on ``padded_to``, the slot count and which of its two bounds applies, and each real
    sequence attends over itself as before."""
    if isinstance(lengths, Tensor):
        host, device = lengths.tolist(), lengths.device  # one device sync for the integers below
    else:
        host = list(lengths)
        if device is None:
            raise ValueError("varlen_kwargs: lengths given as numbers need the device of the offsets")
    max_len = max(host, default=0)
    if padded_to is not None:
        extra = padded_to - sum(host)
        if extra < 0:
            raise ValueError(f"varlen_kwargs: {sum(host)} real tokens > padded_to={padded_to}")
        max_len = graph_max_len(max(max_len, 1), padded_to)
        host += [max_len] * (extra // max_len) + ([extra % max_len] if extra % max_len else [])
        host += [0] * (sequence_slots(len(host)) - len(host))
    offsets = torch.tensor([0, *itertools.accumulate(host)], dtype=torch.int32)
    if device.type == "cuda":  # from pinned memory the copy is queued, not waited for
        offsets = offsets.pin_memory()
    cu_seq = offsets.to(device, non_blocking=True)
    return {
        "cu_seq_lens_q": cu_seq,
        "cu_seq_lens_k": cu_seq,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }
