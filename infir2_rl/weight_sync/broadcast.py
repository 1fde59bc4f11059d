"""Both ends of a bucket that travels by broadcast (``weight_sync.transport: nccl``; the protocol is in ``nccl.py``).

A bucket's bytes travel through the weight group (``group.py``) as one flat ``uint8`` buffer: its tensors'
bytes back to back, no padding, in bucket order. That is SGLang's ``flattened_bucket`` layout, so an SGLang
engine receives the same broadcast (``engines/sglang/protocol.flat_bytes`` builds the same buffer). Its
metadata (names, dtypes, shapes) travels through Ray as a ``BucketMeta``: a few KB per bucket.

Sender (``BroadcastExport``, held by trainer rank 0 or by a ``TensorSource``): ``export`` cuts the tensors into
buckets (``buckets.build_buckets``, left on their device: the GPU under NCCL), copies each into its flat
buffer and keeps the buffers until ``release`` (the next export, or the end of the push), so the self-check can read back exactly the bytes that were sent. ``broadcast(i)`` sends buffer i. A
push of the same tensors as the last one fills each buffer with one launch (``copy_plan.CopyPlan``).

Receiver (``receive_flat``): allocates the flat buffer on its device and receives it; ``unflatten_bytes``
views the tensors out of it (a tensor at an offset that is not a multiple of its element size is copied out
instead: ``view`` needs aligned storage). The engine then loads it (``receiver.py``: by its copy plan when the
bucket is laid out as the last push's, else as a ``WeightBucket`` like any other): it is received first and
checked after, so a refused (stale) bucket still consumes its broadcast and the group stays in step.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from infir2_rl.weight_sync.buckets import HeldBuffer, build_buckets, view_bytes
from infir2_rl.weight_sync.copy_plan import CopyPlan
from infir2_rl.weight_sync.group import WeightGroup, group_backend, host_store

# Per tensor: its dtype and shape (what SGLang's update_weights_from_distributed takes as dtypes/shapes).
TensorMeta = tuple[torch.dtype, tuple[int, ...]]


@dataclass
class BucketMeta:
    """A broadcast bucket without its bytes: what the engines need to receive it."""

    version: int
    index: int
    num_buckets: int
    names: list[str]
    metas: list[TensorMeta]

    @property
    def num_bytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for dtype, shape in self.metas)

    @property
    def is_last(self) -> bool:
        return self.index == self.num_buckets - 1


def bucket_offsets(metas: Sequence[TensorMeta]) -> list[int]:
    """Each tensor's byte offset in a flat bucket (bytes back to back), then the bucket's size."""
    return list(
        itertools.accumulate((math.prod(shape) * dtype.itemsize for dtype, shape in metas), initial=0)
    )


def unflatten_bytes(flat: Tensor, metas: Sequence[TensorMeta]) -> list[Tensor]:
    """The tensors of a flat bucket (bytes back to back): views where aligned, copies where not."""
    offsets = bucket_offsets(metas)
    if offsets[-1] != flat.numel():
        raise ValueError(f"flat bucket of {flat.numel()} bytes, its tensors take {offsets[-1]}")
    return [view_bytes(flat, dtype, shape, o) for (dtype, shape), o in zip(metas, offsets)]


class BroadcastExport:
    """The sender's side: the weight group's rank 0 and the flat buffers of the push in flight."""

    def __init__(self) -> None:
        self.group: WeightGroup | None = None
        self._store: object = None
        self._flats: list[Tensor] = []
        self._metas: list[BucketMeta] = []
        # The buckets' flat buffers with their layouts: the bytes sent, read back for the self-check.
        self.held: list[HeldBuffer] = []
        # The last push's names, buckets and one copy plan per bucket (``copy_plan.py``), for the next push.
        self._planned_names: list[str] = []
        self._planned: list[BucketMeta] = []
        self._plans: list[CopyPlan] = []

    def open_group(self, host: str, device: torch.device, timeout_s: float) -> tuple[str, int, str]:
        """Host the group's store: ``(host, port, backend)`` for the engines to join."""
        self.close_group()
        self._store, port = host_store(host, timeout_s)
        return host, port, group_backend(device)

    def join_group(self, world_size: int, backend: str, group_name: str, timeout_s: float) -> None:
        """Join as rank 0 (gloo: returns once every engine is connected); call after ``open_group``."""
        if self._store is None:
            raise RuntimeError("join_group before open_group: the sender hosts the group's store")
        self.group = WeightGroup.join(
            "",
            0,
            0,
            world_size,
            backend=backend,
            group_name=group_name,
            timeout_s=timeout_s,
            store=self._store,
        )

    def export(
        self, named: Iterable[tuple[str, Tensor]], max_bytes: int, version: int, keep: bool = True
    ) -> list[BucketMeta]:
        """Cut ``named`` into flat buckets held until ``release``; ``keep=False`` (ranks that only take part
        in a collective export) holds nothing and returns []. A push of the last push's tensors (same names,
        and per tensor address, dtype, shape, strides) fills each bucket with one launch of that bucket's copy
        plan (``copy_plan.CopyPlan``); any other cuts and copies tensor by tensor and plans again. Either way an
        exported tensor is let go once its bucket's copy is queued (under FSDP they are gathered copies, and a
        push holds one bucket of them beyond the buckets sent)."""
        self.release()
        if not keep:
            for _ in named:  # consumed all the same: under FSDP each tensor's gather is a collective
                pass
            return []
        named = list(named)
        names = [n for n, _ in named]
        if self._plans and names == self._planned_names:
            metas = [dataclasses.replace(m, version=version) for m in self._planned]
            tensors: list[Tensor | None] = [t for _, t in named]
            spans = list(itertools.pairwise(itertools.accumulate((len(m.names) for m in metas), initial=0)))
            if all(p.matches(tensors[lo:hi]) for p, (lo, hi) in zip(self._plans, spans)):  # type: ignore[arg-type]
                del named
                for plan, m, (lo, hi) in zip(self._plans, metas, spans):
                    flat = torch.empty(m.num_bytes, dtype=torch.uint8, device=tensors[lo].device)  # type: ignore[union-attr]
                    plan.run(flat, to_flat=True)
                    tensors[lo:hi] = [None] * (hi - lo)  # freed in stream order, after the copy just queued
                    self._hold(flat, m)
                return metas
            del tensors
        self._plans = []
        buckets = build_buckets(named, max_bytes, version, device=None)
        del named  # the buckets hold the tensors now: each bucket's are let go once it is copied
        metas, plans = [], []
        for b in buckets:
            m = BucketMeta(
                b.version,
                b.index,
                b.num_buckets,
                list(b.names),
                [(t.dtype, tuple(t.shape)) for t in b.tensors],
            )
            plans.append(
                CopyPlan.build(b.tensors, bucket_offsets(m.metas)[:-1], [str(d) for d, _ in m.metas])
            )
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in b.tensors])
            b.tensors.clear()
            self._hold(flat, m)
            metas.append(m)
        if all(p is not None for p in plans):
            self._plans, self._planned_names, self._planned = plans, names, metas  # type: ignore[assignment]
        return metas

    def _hold(self, flat: Tensor, meta: BucketMeta) -> None:
        """Hold one bucket's buffer (its tensors' bytes back to back) until ``release``."""
        layout = [(str(d), shape, o) for (d, shape), o in zip(meta.metas, bucket_offsets(meta.metas))]
        self._flats.append(flat)
        self.held.append(HeldBuffer(list(meta.names), flat, layout))
        self._metas.append(meta)

    def broadcast(self, index: int, timeout_s: float) -> None:
        """Send flat bucket ``index`` to every engine (they receive it in ``receive_flat``)."""
        if self.group is None:
            raise RuntimeError("broadcast before the weight group was joined")
        self.group.refuse_if_broken(f"bucket {index}")
        if not 0 <= index < len(self._flats):
            raise ValueError(f"bucket {index}: this export holds {len(self._flats)} buckets")
        self.group.timeout_s = timeout_s
        self.group.broadcast_(self._flats[index], f"bucket {index} of version {self._metas[index].version}")

    def release(self) -> None:
        self._flats, self.held, self._metas = [], [], []

    def mark_broken(self, reason: str) -> None:
        """The driver saw this push fail (an engine died, a call timed out): later broadcasts refuse. NCCL can
        complete rank 0's side of a broadcast whose receiver is gone, so the sender cannot always see it."""
        if self.group is not None and self.group.broken is None:
            self.group.broken = reason

    def close_group(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self._store = None, None


def receive_flat(group: WeightGroup | None, meta: BucketMeta, device: torch.device) -> Tensor:
    """The engine's side of one bucket: receive its flat buffer on ``device``."""
    if group is None:
        raise RuntimeError(
            "update_weights_from_distributed before init_weights_update_group: the engine is not in the weight group"
        )
    if (group.backend == "nccl") != (device.type == "cuda"):
        raise ValueError(
            f"weight group backend {group.backend} cannot fill an engine on {device}: NCCL needs GPU engines, and"
            " a CPU trainer (gloo) CPU engines; set weight_sync.transport=object_store"
        )
    flat = torch.empty(meta.num_bytes, dtype=torch.uint8, device=device)
    group.broadcast_(flat, f"receiving bucket {meta.index} of version {meta.version}")
    return flat
