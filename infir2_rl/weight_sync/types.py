"""What travels from the trainer to the rollout engines."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


class StaleWeightsError(RuntimeError):
    """An engine was sent weights older than the ones it already holds."""


@dataclass
class WeightBucket:
    """A bounded group of HF-named tensors of one weight version.

    FP8 decoder linears travel as two tensors: `X.weight` (float8_e4m3fn) and `X.weight_scale_inv`
    (float32, one per 128x128 block), the exact bytes the trainer trains with.
    """

    version: int
    # Position of this bucket in the push and the number of buckets in it.
    index: int
    num_buckets: int
    names: list[str]
    tensors: list[Tensor]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def is_last(self) -> bool:
        return self.index == self.num_buckets - 1
