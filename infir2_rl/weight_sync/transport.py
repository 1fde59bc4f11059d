"""How a bucket gets from the trainer to every engine: the ``Transport`` seam and its object-store implementation.

``ObjectStoreTransport`` (the only one implemented): the bucket is ``ray.put`` once and every engine
actor's ``update_weights`` receives the same ObjectRef, so Ray ships it to each node once and engines on
one node read it from shared memory. Works for CPU and GPU engines (tensors travel as CPU bytes; the
engine copies them onto its device). Local engine objects (no Ray) get the bucket directly.

Not implemented yet, behind the same ``send`` seam: ``cuda_ipc`` (colocated GPUs: hand engines CUDA IPC
handles of the trainer's device tensors, no host copy) and ``nccl`` (separate GPUs: broadcast each bucket
from trainer rank 0 into the engines' process group, with a timeout). Choosing them raises a ValueError.

``BucketRef`` lets the trainer actor put its buckets in the object store itself (``put_buckets``) and hand
the driver only small descriptors, so weights never pass through the driver process.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from infir2_rl.config.components import WeightSyncConfig
from infir2_rl.rollout.remote import Call, call_all, is_actor
from infir2_rl.weight_sync.buckets import build_buckets
from infir2_rl.weight_sync.types import WeightBucket


@dataclass
class BucketRef:
    """A bucket already in Ray's object store, described without its tensors."""

    version: int
    index: int
    num_buckets: int
    names: list[str]
    num_bytes: int
    # ray.ObjectRef of the WeightBucket.
    ref: Any


def put_buckets(named_tensors: Iterable[tuple[str, Tensor]], max_bytes: int, version: int) -> list[BucketRef]:
    """``build_buckets`` then ``ray.put`` each one (call inside the trainer actor that owns the weights)."""
    import ray

    return [
        BucketRef(b.version, b.index, b.num_buckets, list(b.names), b.num_bytes, ray.put(b))
        for b in build_buckets(named_tensors, max_bytes, version)
    ]


class Transport(Protocol):
    """Delivers one bucket to every engine and returns when all of them have loaded it."""

    name: str

    def send(self, engines: Sequence[Any], bucket: WeightBucket | BucketRef, timeout_s: float) -> None: ...


class ObjectStoreTransport:
    name = "object_store"

    def send(self, engines: Sequence[Any], bucket: WeightBucket | BucketRef, timeout_s: float) -> None:
        payload: Any = bucket.ref if isinstance(bucket, BucketRef) else bucket
        if isinstance(bucket, WeightBucket) and any(is_actor(e) for e in engines):
            import ray

            payload = ray.put(bucket)  # once; every actor resolves the same object
        call_all([Call(e, "update_weights", (payload,)) for e in engines], timeout_s)


def make_transport(cfg: WeightSyncConfig) -> Transport:
    if cfg.transport == "object_store":
        return ObjectStoreTransport()
    raise ValueError(
        f"weight_sync.transport={cfg.transport!r} is not implemented yet: use 'object_store' (CPU and GPU);"
        " cuda_ipc and nccl are planned behind weight_sync.transport.Transport"
    )
