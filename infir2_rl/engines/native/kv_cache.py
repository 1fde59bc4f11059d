"""Slot KV cache: one preallocated buffer, one slot of ``max_len`` positions per running sequence.

Layout per layer: keys and values (num_slots + 1, KVH, max_len, D); the extra last slot is scratch, where
padding rows of a graph batch and finished rows write and read (``SCRATCH`` = num_slots). A sequence keeps
its slot from prefill to its last token, so nothing is ever moved or re-laid out; a finished sequence's
slot is simply handed to the next one (continuous batching). Static rather than paged: simple, and the
memory is bounded by ``num_slots * max_len`` (1.5B shape, 256 slots x 2,304 positions in BF16: 16.9 GB; 64
slots x 16,640: 28.9 GiB with the scratch slot). The scheduler gives it one slot per row of the call
(``Scheduler._ensure``).
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots, self.max_len = num_slots, max_len
        self.scratch = num_slots
        shape = (num_layers, 2, num_slots + 1, num_kv_heads, max_len, head_dim)
        self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.k: list[Tensor] = [self.buffer[i, 0] for i in range(num_layers)]
        self.v: list[Tensor] = [self.buffer[i, 1] for i in range(num_layers)]
        # The decode attention's per-(row, KV head) count of finished splits (attention.decode_triton): zeros,
        # and every launch leaves them so. The layers' launches run one after another and share it.
        self.arrivals = torch.zeros((num_slots + 1) * num_kv_heads, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
