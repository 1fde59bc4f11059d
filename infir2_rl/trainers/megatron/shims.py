"""Three shims that let megatron-core's local layer spec run on a CPU-only machine (gloo, no CUDA).

megatron-core assumes CUDA in three places a Qwen2-shaped GPTModel reaches:

1. ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` on first use.
   Replaced (on CPU only) by the same computation on the tensor's own device: frequencies
   ``outer(positions, inv_freq)``, duplicated as ``cat(f, f)`` (or ``f0, f0, f1, f1, ...`` when interleaved),
   shaped ``[seq, 1, 1, dim]``.
2. The CUDA RNG tracker (``tensor_parallel.get_cuda_rng_tracker().fork()``) saves and restores CUDA RNG
   states. With dropout 0 (this trainer's setting) no random numbers are drawn inside a fork, so a tracker
   whose ``fork`` does nothing is exact.
3. Core attention's global memory buffer (``parallel_state.get_global_memory_buffer``) is allocated on
   CUDA. Our spec replaces megatron's ``DotProductAttention`` by ``SdpaAttention`` (attention.py), which
   never asks for that buffer, so this shim is a check rather than a patch: `install` refuses a spec
   that still uses ``DotProductAttention`` on CPU.

`install()` does nothing when CUDA is available, so GPU runs use megatron-core unchanged.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)
_installed = False


class _NoRngTracker:
    """Stand-in for megatron's CudaRNGStatesTracker on CPU: forks draw nothing when dropout is 0."""

    def __init__(self) -> None:
        self._names: set[str] = set()

    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        self._names = set()

    def get_states(self) -> dict[str, Any]:
        return {}

    def set_states(self, states: dict[str, Any]) -> None:
        pass

    def add(self, name: str, seed: int) -> None:
        self._names.add(name)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        yield


def _rotary_emb_on_own_device(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [seq, dim / 2]
    if self.rotary_interleaved:
        emb = freqs.repeat_interleave(2, dim=-1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def install() -> None:
    """Patch megatron-core for CPU (idempotent; a no-op when CUDA is available)."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.tensor_parallel import random as mcore_random

    rotary_pos_embedding.RotaryEmbedding.get_emb = _rotary_emb_on_own_device  # type: ignore[method-assign]
    mcore_random._CUDA_RNG_STATE_TRACKER = _NoRngTracker()  # type: ignore[assignment]
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _installed = True
    log.info("megatron-core CPU shims installed (rotary on CPU, no-op RNG tracker; SDPA core attention)")
