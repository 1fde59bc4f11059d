"""What travels from the trainer to the rollout engines.

Pickling FP8 tensors: torch 2.13 pickles a float8 tensor's storage under the legacy typed-storage path
and cannot load it back (``UntypedStorage has no attribute 'dtype'``), so a float8 tensor does not
survive Ray's object store or any ``pickle`` round trip. ``WeightBucket`` and ``TensorMap`` therefore
pickle FP8 tensors as ``uint8`` views of the same bytes plus the dtype name, and view them back on load
(zero-copy both ways; every other tensor pickles as usual).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

_FP8_DTYPES = {str(d): d for d in (torch.float8_e4m3fn, torch.float8_e5m2)}


def _pack(t: Tensor) -> tuple[Tensor, str | None]:
    name = str(t.dtype)
    return (t.view(torch.uint8), name) if name in _FP8_DTYPES else (t, None)


def _unpack(t: Tensor, dtype_name: str | None) -> Tensor:
    return t.view(_FP8_DTYPES[dtype_name]) if dtype_name is not None else t


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

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["tensors"] = [_pack(t) for t in self.tensors]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["tensors"] = [_unpack(t, d) for t, d in state["tensors"]]
        self.__dict__.update(state)


def _rebuild_tensor_map(names: list[str], packed: list[tuple[Tensor, str | None]]) -> TensorMap:
    return TensorMap({n: _unpack(t, d) for n, (t, d) in zip(names, packed)})


class TensorMap(dict[str, Tensor]):
    """A ``dict`` of named tensors that survives pickling with FP8 tensors inside (see the module docstring)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_tensor_map, (list(self.keys()), [_pack(t) for t in self.values()]))


class WeightSyncError(RuntimeError):
    """A push failed: an engine did not load it, timed out, or the read-back self-check found different bytes."""


@dataclass
class PushStats:
    """What one weight push did (returned by ``WeightSyncService.push``)."""

    version: int
    # Wall time of the transfer to every engine (all buckets loaded), seconds.
    seconds: float
    # Bytes sent once (each engine receives all of them).
    bytes: int
    num_buckets: int
    num_tensors: int
    # Tensors read back from one engine and compared byte for byte, and the time that took.
    num_checked: int = 0
    check_seconds: float = 0.0
    # Index of the engine the self-check read from (rotates push by push); -1 when none.
    checked_engine: int = -1
