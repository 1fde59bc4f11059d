"""How one weight version gets from the trainer to every engine: the ``Transport`` seam and its implementations.

A transport owns both ends of its kind of bucket: ``open(source, fp8, version, max_bytes)`` exports the trainer's
weights the way this transport needs them (``WeightSource``: a ``TrainerGroup``, or ``TensorSource`` over tensors
already in this process) and returns a ``Push``: the buckets' names and sizes, ``send(engines, i)`` delivering
bucket i to every engine, ``read_sent(names)`` giving back the sent bytes for the self-check, and ``close()``
freeing what the export held. ``WeightSyncService`` drives a ``Push`` without knowing its kind.

``ObjectStoreTransport`` (default; CPU and GPU): the trainer's tensors come to this process, are cut into
``WeightBucket``s, and each bucket is ``ray.put`` once; every engine actor's ``update_weights`` receives the same
ObjectRef, so Ray ships it to each node once and engines on one node read it from shared memory. Tensors travel
as CPU bytes; a GPU engine copies them onto its device. Local engine objects (no Ray) get the bucket directly.

``CudaIpcTransport`` (``weight_sync.transport: cuda_ipc``; trainer and engine colocated on one GPU): the
weights never leave the GPU. The trainer keeps its buckets on its device (``build_buckets(...,
device=None)``) and ``share_buckets`` copies each into one flat ``uint8`` GPU buffer (tensors at 256-byte
aligned offsets) and makes an ``IpcBucket``: the buffer's ``(rebuild_fn, args)`` from
``torch.multiprocessing.reductions.reduce_tensor`` (a CUDA IPC memory handle, a few hundred bytes) plus
each tensor's (dtype, shape, offset). The engine maps the buffer into its process (``open_ipc_bucket``:
``rebuild_fn(*args)``), views the tensors out of it, ``WeightReceiver`` copies them into its weights in
place, the engine synchronizes and drops the mapping. By default a push is one bucket, whatever
``weight_sync.bucket_size_mb`` says (``CudaIpcTransport`` says why).

Why one buffer per bucket rather than a handle per tensor: every shared storage costs an IPC event and a
ref-counter slot on the trainer side and ``cudaIpcOpenMemHandle`` + an event wait on the engine side, and
the 1.5B shape exports 535 tensors; a bucket costs one of each. The price is one device-to-device copy of
the push (~3 GB for the 1.5B shape, FP32 embeddings included: a few ms at HBM bandwidth, estimated;
``bench/weight_sync.py`` measures the whole sync). It also makes FP8 a non-question: only ``uint8``
buffers go through ``reduce_tensor`` (whether it carries float8 storages as they are is probed by
``tests/test_weight_sync_ipc.py``).

Rules that make it safe:

* Lifetime: the producer holds the buffers until every engine has loaded the push
  (``TrainerWorker.export_ipc_buckets`` keeps them until ``release_export``, which
  ``WeightSyncService.push_from`` calls after the push and its self-check).
* Which GPU: ``args`` name the producer's device index, which means nothing in the engine's process (Ray
  sets ``CUDA_VISIBLE_DEVICES`` per actor: two actors colocated on one GPU both call it cuda:0, the driver
  may call it cuda:3). So handles are keyed by the GPU's UUID and the engine swaps in its own index of that
  GPU. An engine that sees none of the trainer's GPUs (not colocated) or runs on CPU raises a ValueError
  saying to use ``object_store``. With several trainer ranks (one per GPU) every rank exports, and an
  ``IpcBucket`` carries each rank's handle (``merge_ipc_buckets``); engine i opens the one of its GPU.
* Caveats: the native engine only (SGLang engines take ``object_store``); the trainer's GPU holds the
  buffers (one copy of the exported weights) during a push; CUDA IPC of memory from
  ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` needs a torch that can share such segments.

``NcclTransport`` (``weight_sync.transport: nccl``; engines on GPUs of their own, gloo on CPU): each bucket
is broadcast from trainer rank 0 into a process group of its own with the engines; ``nccl.py`` has the
protocol, ``broadcast.py`` the bucket's two ends, ``group.py`` the group and its timeouts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from infir2_rl.actors.remote import Call, call_all, is_actor
from infir2_rl.types import WeightBucket
from infir2_rl.weight_sync.broadcast import BroadcastExport, BucketMeta
from infir2_rl.weight_sync.buckets import HeldBuffer, build_buckets, copy_pairs, dtype_named, held_tensors
from infir2_rl.weight_sync.copy_plan import CopyPlan
from infir2_rl.weight_sync.digest import Digest, digests

# Position of the storage's device index in the args of torch's rebuild_cuda_tensor (torch 2.1 .. 2.13).
_DEVICE_ARG = 6
# Byte alignment of each tensor in a shared buffer (any dtype can be viewed at such an offset).
_ALIGN = 256
_USE_OBJECT_STORE = "set weight_sync.transport=object_store"


@dataclass
class IpcBucket:
    """A bucket whose bytes stay on the trainer's GPU(s): a CUDA IPC handle of a flat buffer per GPU."""

    version: int
    index: int
    num_buckets: int
    names: list[str]
    num_bytes: int
    # GPU UUID -> reduce_tensor's (rebuild_fn, args) of the bucket's uint8 buffer made on that GPU.
    handles: dict[str, tuple[Any, tuple[Any, ...]]]
    # Per tensor: dtype name, shape, byte offset in the buffer.
    layout: list[tuple[str, tuple[int, ...], int]]

    @property
    def is_last(self) -> bool:
        return self.index == self.num_buckets - 1


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def flatten(tensors: Sequence[Tensor]) -> tuple[Tensor, list[Tensor], list[tuple[str, tuple[int, ...], int]]]:
    """Copy ``tensors`` into one uint8 buffer on their device: (buffer, views of it, layout)."""
    layout, size = _layout(tensors)
    flat = torch.empty(size, dtype=torch.uint8, device=tensors[0].device)
    views = unflatten(flat, layout)
    copy_pairs(zip(views, tensors))  # large tensors one by one, the rest as foreach copies by dtype
    return flat, views, layout


def unflatten(flat: Tensor, layout: Sequence[tuple[str, tuple[int, ...], int]]) -> list[Tensor]:
    """Views of ``flat`` (a uint8 buffer) per the layout: one ``as_strided`` per tensor on a view of the whole
    buffer in its dtype (a slice and two views per tensor cost ~3x the host time, and an FP8 push at 1.5B has
    534 tensors, viewed by the trainer and again by the engine)."""
    as_dtype: dict[str, Tensor] = {}
    views = []
    for dtype_name, shape, offset in layout:
        typed = as_dtype.get(dtype_name)
        if typed is None:
            typed = as_dtype[dtype_name] = flat.view(dtype_named(dtype_name))
        itemsize = typed.element_size()
        if offset % itemsize or offset + math.prod(shape) * itemsize > flat.numel():
            raise ValueError(
                f"layout entry {dtype_name} {shape} at byte {offset}: outside a {flat.numel()}-byte buffer or misaligned"
            )
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        views.append(typed.as_strided(shape, strides[::-1], typed.storage_offset() + offset // itemsize))
    return views


def _layout(tensors: Sequence[Tensor]) -> tuple[list[tuple[str, tuple[int, ...], int]], int]:
    """Each tensor's (dtype, shape, byte offset) in a flat buffer (offsets ``_ALIGN``-aligned), and its size."""
    layout, size = [], 0
    for t in tensors:
        layout.append((str(t.dtype), tuple(t.shape), size))
        size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return layout, size


def _handles(flat: Tensor) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """An ``IpcBucket``'s handles of ``flat``, a buffer on this rank's GPU."""
    from torch.multiprocessing.reductions import reduce_tensor

    return {gpu_uuid(flat.device): reduce_tensor(flat)}


def share_buckets(buckets: Sequence[WeightBucket]) -> tuple[list[IpcBucket], list[HeldBuffer]]:
    """IPC buckets of ``buckets``' GPU tensors, and the shared buffers, which the caller holds until every
    engine has loaded the push."""
    devices = {t.device for b in buckets for t in b.tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(
            f"weight_sync.transport=cuda_ipc: the trainer's weights are on {sorted(map(str, devices))}, CUDA IPC"
            f" shares tensors of one GPU; {_USE_OBJECT_STORE} for CPU runs"
        )
    device = devices.pop()
    shared, held = [], []
    for b in buckets:
        flat, _, layout = flatten(b.tensors)
        held.append(HeldBuffer(list(b.names), flat, layout))
        shared.append(
            IpcBucket(b.version, b.index, b.num_buckets, list(b.names), b.num_bytes, _handles(flat), layout)
        )
    torch.cuda.current_stream(device).synchronize()  # the buffers are written before another process reads
    return shared, held


class IpcExporter:
    """The trainer's side of ``cuda_ipc`` pushes (``TrainerWorker``, ``TensorSource``): ``share`` makes the
    IPC buckets of one export. A push of one bucket (the default, ``CudaIpcTransport``) whose tensors are the
    previous push's (same names, addresses, dtypes, shapes, strides: the trainer updates its weights in place)
    takes the copy plan of that push (``copy_plan.CopyPlan``): one launch fills the new buffer, and nothing is
    done per tensor on the host but the check. Anything else goes through ``build_buckets`` and
    ``share_buckets`` (and plans the next push when it is one bucket that one launch can copy)."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._layout: list[tuple[str, tuple[int, ...], int]] = []
        self._size = 0
        self._num_bytes = 0
        self._plan: CopyPlan | None = None

    def share(
        self, named: Sequence[tuple[str, Tensor]], max_bytes: int, version: int
    ) -> tuple[list[IpcBucket], list[HeldBuffer]]:
        names = [n for n, _ in named]
        tensors = [t for _, t in named]
        if self._plan is not None and names == self._names and self._plan.matches(tensors):
            if version < 0:
                raise ValueError(f"version={version}: weight versions are >= 0")
            flat = torch.empty(self._size, dtype=torch.uint8, device=tensors[0].device)
            self._plan.run(flat, to_flat=True)
            torch.cuda.current_stream(flat.device).synchronize()  # written before another process reads
            bucket = IpcBucket(version, 0, 1, names, self._num_bytes, _handles(flat), self._layout)
            return [bucket], [HeldBuffer(names, flat, self._layout)]
        self._plan = None
        shared, held = share_buckets(build_buckets(named, max_bytes, version, device=None))
        if len(shared) == 1:
            offsets = [offset for _, _, offset in shared[0].layout]
            self._plan = CopyPlan.build(tensors, offsets, [d for d, _, _ in shared[0].layout])
            self._names, self._layout, self._size = names, shared[0].layout, held[0].flat.numel()
            self._num_bytes = shared[0].num_bytes
        return shared, held


def merge_ipc_buckets(per_rank: Sequence[Sequence[IpcBucket]]) -> list[IpcBucket]:
    """One list of buckets carrying every rank's handle (each rank exported the same tensors on its GPU)."""
    first, *others = per_rank
    merged = [IpcBucket(**{**b.__dict__, "handles": dict(b.handles)}) for b in first]
    for rank_buckets in others:
        if [(b.names, b.layout) for b in rank_buckets] != [(b.names, b.layout) for b in merged]:
            raise ValueError(
                "trainer ranks exported different weight buckets; every rank must export the same"
            )
        for into, b in zip(merged, rank_buckets):
            into.handles.update(b.handles)
    return merged


def rebuild_on_this_gpu(handle: tuple[Any, tuple[Any, ...]], device_index: int) -> Tensor:
    """``rebuild_fn(*args)`` of a CUDA ``reduce_tensor`` handle, with the device index of this process."""
    fn, args = handle
    assert fn.__name__ == "rebuild_cuda_tensor", f"not a CUDA tensor handle: {fn!r}"
    return fn(*args[:_DEVICE_ARG], device_index, *args[_DEVICE_ARG + 1 :])  # type: ignore[no-any-return]


def map_ipc_buffer(bucket: IpcBucket, device: torch.device) -> Tensor:
    """The engine side: the trainer's buffer of this bucket mapped into this process (no copy)."""
    if device.type != "cuda":
        raise ValueError(
            f"weight_sync.transport=cuda_ipc sent bucket {bucket.index} to an engine on {device}: CUDA IPC"
            f" needs the engine on the trainer's GPU; {_USE_OBJECT_STORE}"
        )
    local = {gpu_uuid(torch.device("cuda", i)): i for i in range(torch.cuda.device_count())}
    uuid = next((u for u in bucket.handles if u in local), None)
    if uuid is None:
        raise ValueError(
            f"weight_sync.transport=cuda_ipc: the trainer's GPUs {sorted(bucket.handles)} are not visible to"
            f" this engine (it sees {sorted(local)}); CUDA IPC needs each engine colocated with a trainer rank"
            f" (placement.mode=colocate); {_USE_OBJECT_STORE}"
        )
    return rebuild_on_this_gpu(bucket.handles[uuid], local[uuid])


def open_ipc_bucket(bucket: IpcBucket, device: torch.device) -> WeightBucket:
    """The engine side: map the trainer's buffer into this process and view its tensors (no copy yet)."""
    tensors = unflatten(map_ipc_buffer(bucket, device), bucket.layout)
    return WeightBucket(bucket.version, bucket.index, bucket.num_buckets, list(bucket.names), tensors)


class WeightSource(Protocol):
    """What a transport exports weights from (``actors.trainer_group.TrainerGroup``, or ``TensorSource``)."""

    def export_weights(self, fp8: bool = True) -> list[tuple[str, Tensor]]: ...

    def export_ipc_buckets(self, fp8: bool, max_bytes: int, version: int) -> list[IpcBucket]: ...

    def read_export(self, names: Sequence[str]) -> Mapping[str, Tensor]: ...

    def digest_export(self, as_dtypes: Mapping[str, str]) -> dict[str, Digest]: ...

    def release_export(self) -> None: ...


class TensorSource:
    """A ``WeightSource`` over HF-named tensors already in this process (tests, tools, benchmarks); the tensors
    are pushed as they are, so ``fp8`` does not apply. For the nccl transport it is its own sender (group
    rank 0, ``broadcast.BroadcastExport``)."""

    def __init__(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self.named = list(named_tensors)
        self._held: list[WeightBucket | HeldBuffer] = []
        self._ipc = IpcExporter()
        self._broadcast = BroadcastExport()

    def export_weights(self, fp8: bool = True) -> list[tuple[str, Tensor]]:
        return self.named

    def export_ipc_buckets(self, fp8: bool, max_bytes: int, version: int) -> list[IpcBucket]:
        self._held = []
        shared, held = self._ipc.share(self.named, max_bytes, version)
        self._held = list(held)
        return shared

    def read_export(self, names: Sequence[str]) -> Mapping[str, Tensor]:
        return held_tensors(self._held, names)

    def digest_export(self, as_dtypes: Mapping[str, str]) -> dict[str, Digest]:
        return digests(dict(self.read_export(list(as_dtypes))), list(as_dtypes), dict(as_dtypes))

    def release_export(self) -> None:
        self._held = []
        self._broadcast.release()

    # ---- nccl transport (see nccl.py for the order of these calls)
    def weight_sender(self) -> TensorSource:
        return self

    def open_weight_group(self, timeout_s: float) -> tuple[str, int, str]:
        return self._broadcast.open_group("127.0.0.1", self.named[0][1].device, timeout_s)

    def join_weight_group(self, world_size: int, backend: str, group_name: str, timeout_s: float) -> None:
        self._broadcast.join_group(world_size, backend, group_name, timeout_s)

    def export_broadcast_buckets(self, fp8: bool, max_bytes: int, version: int) -> list[BucketMeta]:
        metas = self._broadcast.export(self.named, max_bytes, version)
        self._held = list(self._broadcast.held)
        return metas

    def broadcast_bucket(self, index: int, timeout_s: float) -> None:
        self._broadcast.broadcast(index, timeout_s)

    def break_weight_group(self, reason: str) -> None:
        self._broadcast.mark_broken(reason)


class Push:
    """One weight version on its way to the engines, made by ``Transport.open``."""

    def __init__(self, buckets: Sequence[WeightBucket | IpcBucket]) -> None:
        self.buckets = list(buckets)

    @property
    def names(self) -> list[str]:
        return [n for b in self.buckets for n in b.names]

    @property
    def num_bytes(self) -> int:
        return sum(b.num_bytes for b in self.buckets)

    def send(self, engines: Sequence[Any], index: int, timeout_s: float) -> None:
        """Deliver bucket ``index`` to every engine; returns when all of them have loaded it."""
        raise NotImplementedError

    def read_sent(self, names: Sequence[str]) -> Mapping[str, Tensor]:
        """The sent bytes under these names (tests and tools)."""
        raise NotImplementedError

    def digest_sent(self, as_dtypes: Mapping[str, str]) -> dict[str, Digest]:
        """Digests of the sent tensors of these names, each cast to the dtype given first (the dtype the
        engine keeps it in), computed where the sent bytes are: the self-check's other half."""
        return digests(dict(self.read_sent(list(as_dtypes))), list(as_dtypes), dict(as_dtypes))

    def close(self) -> None:
        """Free what the export holds (the engines have their own copies now)."""


class Transport(Protocol):
    name: str

    def open(self, source: WeightSource, fp8: bool, version: int, max_bytes: int) -> Push: ...


class _ObjectStorePush(Push):
    buckets: list[WeightBucket]  # type: ignore[assignment]

    def send(self, engines: Sequence[Any], index: int, timeout_s: float) -> None:
        bucket = self.buckets[index]
        payload: Any = bucket
        if any(is_actor(e) for e in engines):
            import ray

            payload = ray.put(bucket)  # once; every actor resolves the same object
        call_all([Call(e, "update_weights", (payload,)) for e in engines], timeout_s)

    def read_sent(self, names: Sequence[str]) -> Mapping[str, Tensor]:
        return held_tensors(self.buckets, names)


class ObjectStoreTransport:
    name = "object_store"

    def open(self, source: WeightSource, fp8: bool, version: int, max_bytes: int) -> Push:
        return _ObjectStorePush(build_buckets(source.export_weights(fp8), max_bytes, version))


class _IpcPush(Push):
    buckets: list[IpcBucket]  # type: ignore[assignment]

    def __init__(self, buckets: Sequence[IpcBucket], source: WeightSource) -> None:
        super().__init__(buckets)
        self.source = source

    def send(self, engines: Sequence[Any], index: int, timeout_s: float) -> None:
        # The bucket is a handle and a layout (a few KB): pickled into each call, no object-store round trip.
        call_all([Call(e, "update_weights", (self.buckets[index],)) for e in engines], timeout_s)

    def read_sent(self, names: Sequence[str]) -> Mapping[str, Tensor]:
        return self.source.read_export(names)

    def digest_sent(self, as_dtypes: Mapping[str, str]) -> dict[str, Digest]:
        return self.source.digest_export(as_dtypes)  # on the trainer's GPU: a few numbers come back

    def close(self) -> None:
        self.source.release_export()  # the trainer frees its GPU buckets


# What ``CudaIpcTransport`` asks the trainer for by default: the whole export as one buffer.
ONE_BUFFER = 1 << 62


class CudaIpcTransport:
    """``single_buffer`` (the default): one bucket per push whatever ``weight_sync.bucket_size_mb`` says. The
    trainer holds every bucket of a push until it ends anyway (``TrainerWorker.export_ipc_buckets``), so
    smaller buckets save no memory, and each one costs a Ray round trip, an IPC handle to open and a stream
    sync in the engine: at 1.5B, four 512 MiB buckets took 60 ms per push and one 37 ms (H100,
    ``bench/weight_sync.py --ipc-bucket-mb 512 4096``, docs/performance.md). ``single_buffer=False`` follows
    ``max_bytes`` (tests of the multi-bucket path)."""

    name = "cuda_ipc"

    def __init__(self, single_buffer: bool = True) -> None:
        self.single_buffer = single_buffer

    def open(self, source: WeightSource, fp8: bool, version: int, max_bytes: int) -> Push:
        buckets = source.export_ipc_buckets(fp8, ONE_BUFFER if self.single_buffer else max_bytes, version)
        try:
            if any(b.version != version for b in buckets):
                raise ValueError(
                    f"buckets of versions {sorted({b.version for b in buckets})} pushed as {version}"
                )
        except Exception:
            source.release_export()
            raise
        return _IpcPush(buckets, source)
