"""What a trainer backend sends the engines at a weight sync, shared by the torch and megatron backends.

The engines compute in ``model.dtype``, the same compute dtype as the trainer, and cast every dense tensor they
receive to it (``weight_sync.receiver``). So a dense tensor (embeddings, norms, biases, a BF16 run's linears) is
sent already in that dtype: the same bytes land, in half the traffic at BF16 (at the Qwen2.5-1.5B shape the FP32
embedding alone was 0.93 GB of a 3.18 GB push). FP8 bytes and their FP32 ``weight_scale_inv`` go as they are.
A tied lm_head is not sent: an engine with tied embeddings reads its lm_head from the embedding it receives.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

TIED_HEAD = "lm_head.weight"


def for_engines(
    named: Iterable[tuple[str, Tensor]], compute_dtype: torch.dtype, tied_embeddings: bool
) -> Iterator[tuple[str, Tensor]]:
    """``named`` as the engines take it (see the module docstring)."""
    for name, tensor in named:
        if tied_embeddings and name == TIED_HEAD:
            continue
        if (
            tensor.dtype != compute_dtype
            and tensor.is_floating_point()
            and tensor.element_size() > 1
            and not name.endswith("weight_scale_inv")
        ):
            tensor = tensor.to(compute_dtype)
        yield name, tensor
