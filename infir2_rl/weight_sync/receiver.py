"""The engine side of weight sync: the version rule, and loading buckets into a torch model in place.

Version rule (``VersionGate``): an engine starts at version 0 (the checkpoint it loaded). A bucket older
than the version it holds, or older than the push it is in the middle of, raises ``StaleWeightsError``;
buckets of the current or the in-progress version are accepted; the held version becomes the push's
after its last bucket.

Loading (``WeightReceiver``): ``<p>.weight`` (float8_e4m3fn) and ``<p>.weight_scale_inv`` (float32) of an
``Fp8InferenceLinear`` are stored until both halves are there (a pair may straddle two buckets), then
copied in place (``Fp8InferenceLinear.fp8_copies``); any other tensor is copied into the parameter or buffer
of that name, cast to its dtype (a BF16 engine takes FP32 master weights). Every tensor of a bucket is
checked first and the bucket's copies then run (``buckets.copy_pairs``: large tensors one by one, the rest
as foreach copies by dtype), so a refused bucket changes no weight. Unknown names, FP8 bytes for a non-FP8 tensor, a plain weight for an FP8 linear, or a shape
change are errors: a silent skip is how peers shipped wrong weights (verl#7986). An ``IpcBucket``
(``weight_sync.transport: cuda_ipc``) is opened on the model's GPU first (``transport.open_ipc_bucket``),
loaded the same way, and dropped once the copies have finished.
With ``weight_sync.transport: nccl`` the engine joins the trainer's weight group (``join_group``) and
``receive`` takes each bucket's broadcast into a flat buffer on the model's device (``broadcast.py``), then
loads it the same way: received first, checked after, so a refused bucket still keeps the group in step.

Copy plans (``copy_plan.py``; ``cuda_ipc`` and ``nccl``): a bucket loaded tensor by tensor leaves a plan keyed by
(transport, bucket index); the next bucket of that key with the same names and layout, whose engine tensors
are still the planned ones (address, dtype, shape, strides), is copied by one launch after the version rule,
without views or per-tensor checks: those passed when the plan was made, for the same layout and tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import increment_version

from infir2_rl.fp8.linear import Fp8InferenceLinear
from infir2_rl.fp8.quant import FP8_DTYPE
from infir2_rl.types import StaleWeightsError, TensorMap, WeightBucket
from infir2_rl.weight_sync.broadcast import (
    BucketMeta,
    TensorMeta,
    bucket_offsets,
    receive_flat,
    unflatten_bytes,
)
from infir2_rl.weight_sync.buckets import copy_pairs
from infir2_rl.weight_sync.copy_plan import CopyPlan
from infir2_rl.weight_sync.digest import Digest, digests
from infir2_rl.weight_sync.group import WeightGroup
from infir2_rl.weight_sync.transport import IpcBucket, map_ipc_buffer, open_ipc_bucket


class VersionGate:
    """Tracks the held and in-progress weight versions of one engine."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.pending: int | None = None

    def admit(self, bucket: WeightBucket | IpcBucket | BucketMeta) -> bool:
        """Check ``bucket`` against the rule; True when it opens a new push."""
        if bucket.version < self.version or (self.pending is not None and bucket.version < self.pending):
            loading = f" and is loading {self.pending}" if self.pending is not None else ""
            raise StaleWeightsError(
                f"bucket of version {bucket.version} refused: the engine holds version {self.version}{loading}"
            )
        opens = bucket.version != self.pending
        self.pending = bucket.version
        return opens

    def commit(self, bucket: WeightBucket | IpcBucket | BucketMeta) -> None:
        if bucket.is_last:
            self.version, self.pending = bucket.version, None


@dataclass
class _Planned:
    """A bucket as it was sent the last time it was loaded tensor by tensor, and the plan that copies it."""

    names: list[str]
    layout: list[Any]  # as sent: an IpcBucket's layout, or a broadcast bucket's metas
    plan: CopyPlan


class WeightReceiver:
    """Loads ``WeightBucket``s into ``model`` in place and reads tensors back for the self-check."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.gate = VersionGate()
        self.fp8_modules = {n: m for n, m in model.named_modules() if isinstance(m, Fp8InferenceLinear)}
        # State-dict name -> (owning module, attribute, is a parameter). The modules stay for the model's life;
        # the tensors do not (Module.to() replaces buffers), so each load looks them up in the module's own
        # dicts: a dict lookup per tensor instead of a state_dict() walk of ~370 modules per call.
        self._slots: dict[str, tuple[nn.Module, str, bool]] = {}
        for name in model.state_dict(keep_vars=True):
            prefix, _, leaf = name.rpartition(".")
            module = model.get_submodule(prefix)
            self._slots[name] = (module, leaf, leaf in module._parameters)
        self._halves: dict[str, dict[str, Tensor]] = {}
        # cuda_ipc and nccl: per (transport, bucket index), the last bucket loaded tensor by tensor and its
        # copy plan (``_planned``).
        self._plans: dict[tuple[str, int], _Planned] = {}
        # weight_sync.transport=nccl: this engine's membership of the trainer's weight group.
        self.group: WeightGroup | None = None

    @property
    def version(self) -> int:
        return self.gate.version

    def join_group(
        self,
        address: str,
        port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> None:
        """Join the trainer's weight group as ``rank`` (gloo: returns once every member is connected)."""
        if self.group is not None:
            self.group.close()
        self.group = WeightGroup.join(
            address, port, rank, world_size, backend=backend, group_name=group_name, timeout_s=timeout_s
        )

    def receive(
        self, version: int, index: int, num_buckets: int, names: Sequence[str], metas: Sequence[TensorMeta]
    ) -> None:
        """Receive one broadcast bucket from the weight group and load it (by its copy plan when it is laid out
        as the last bucket of this index was)."""
        meta = BucketMeta(version, index, num_buckets, list(names), list(metas))
        flat = receive_flat(self.group, meta, self._device())
        key = ("nccl", index)
        plan = self._planned(key, meta.names, meta.metas)
        if plan is not None:
            self._admit(meta)
            self._run_plan(plan, meta.names, flat)
            self._commit(meta)
            return
        self.load(WeightBucket(version, index, num_buckets, meta.names, unflatten_bytes(flat, meta.metas)))
        offsets = bucket_offsets(meta.metas)[:-1]
        self._plan_next(key, meta.names, meta.metas, offsets, [str(dtype) for dtype, _ in meta.metas])

    def _tensor(self, name: str) -> Tensor | None:
        """The model's tensor of that state-dict name as it is now, or None."""
        slot = self._slots.get(name)
        if slot is None:
            return None
        module, leaf, is_param = slot
        return (module._parameters if is_param else module._buffers).get(leaf)

    def _device(self) -> torch.device:
        tensor = self._tensor(next(iter(self._slots)))
        assert tensor is not None
        return tensor.device

    def load(self, bucket: WeightBucket | IpcBucket) -> None:
        if isinstance(bucket, IpcBucket):
            self._load_ipc(bucket)
            return
        if len(bucket.names) != len(bucket.tensors):
            raise ValueError(
                f"bucket {bucket.index}: {len(bucket.names)} names but {len(bucket.tensors)} tensors"
            )
        self._admit(bucket)
        copies: list[tuple[Tensor, Tensor]] = []
        for name, tensor in zip(bucket.names, bucket.tensors):
            self._load_one(name, tensor, copies)
        # The copies run once every tensor of the bucket passed its checks (a refused bucket changes nothing):
        # large ones one by one, the rest grouped by dtype into foreach copies (``copy_pairs``; at 1.5B an FP8
        # push is 534 tensors; copy_ casts where a BF16 engine is sent FP32, and moves object-store buckets
        # from the CPU).
        copy_pairs(copies)
        self._commit(bucket)

    def _admit(self, bucket: WeightBucket | IpcBucket | BucketMeta) -> None:
        if self.gate.admit(bucket):  # a new push
            self._halves = {}

    def _commit(self, bucket: WeightBucket | IpcBucket | BucketMeta) -> None:
        if bucket.is_last and self._halves:
            raise ValueError(
                f"push of version {bucket.version} ended with FP8 linears missing a half: {sorted(self._halves)}"
            )
        self.gate.commit(bucket)

    def _load_ipc(self, bucket: IpcBucket) -> None:
        """Load a bucket from the trainer's GPU buffer: by its copy plan when it is laid out as the last bucket
        of this index was, else tensor by tensor as ``load`` does, planning the next push."""
        device = self._device()
        key = ("cuda_ipc", bucket.index)
        plan = self._planned(key, bucket.names, bucket.layout)
        if plan is not None:
            self._admit(bucket)  # the version rule, as for any bucket
            self._run_plan(plan, bucket.names, map_ipc_buffer(bucket, device))
        else:
            self.load(open_ipc_bucket(bucket, device))
        # The trainer may free or overwrite its buffer once this returns: the copies must be done.
        torch.cuda.current_stream(device).synchronize()
        if plan is not None:
            self._commit(bucket)
        else:
            offsets = [offset for _, _, offset in bucket.layout]
            self._plan_next(key, bucket.names, bucket.layout, offsets, [d for d, _, _ in bucket.layout])

    def _run_plan(self, plan: CopyPlan, names: list[str], source: Tensor) -> None:
        """Copy a bucket into the engine's tensors of ``names`` by its plan. The plan's kernel writes them behind
        autograd's back, so their version counters are bumped as an in-place copy would: what is cached by
        version (``fp8.ops``' dequantized weights, used where an FP8 GEMM is emulated) is made again, where it
        kept the first push's weights before."""
        plan.run(source, to_flat=False)
        increment_version([t for t in map(self._tensor, names) if t is not None])

    def _planned(self, key: tuple[str, int], names: list[str], layout: list[Any]) -> CopyPlan | None:
        """The plan of the bucket last loaded under ``key``, if this one has its names and layout (as sent)
        and the engine's tensors of those names are still the ones it copies into (``CopyPlan.matches``:
        address, dtype, shape, strides; ``Module.to()`` or a model reload would move them)."""
        planned = self._plans.get(key)
        if planned is None or planned.names != names or planned.layout != layout:
            return None
        targets = [self._tensor(n) for n in names]
        if any(t is None for t in targets) or not planned.plan.matches(targets):  # type: ignore[arg-type]
            return None
        return planned.plan

    def _plan_next(
        self, key: tuple[str, int], names: list[str], layout: list[Any], offsets: list[int], dtypes: list[str]
    ) -> None:
        """After a bucket was loaded tensor by tensor (each name is the engine tensor it was copied into and its
        checks passed): the plan for the next bucket laid out the same, where one launch can copy it (no cast;
        no two names of one engine tensor, e.g. tied weights, which one launch would write twice)."""
        self._plans.pop(key, None)
        targets = [self._tensor(n) for n in names]
        if any(t is None for t in targets) or len({t.data_ptr() for t in targets}) != len(targets):  # type: ignore[union-attr]
            return
        plan = CopyPlan.build(targets, offsets, dtypes)  # type: ignore[arg-type]
        if plan is not None:
            self._plans[key] = _Planned(list(names), list(layout), plan)

    def _load_one(self, name: str, tensor: Tensor, copies: list[tuple[Tensor, Tensor]]) -> None:
        """Check one sent tensor against the engine's and add its (destination, source) copy to ``copies``
        (an FP8 linear's pair once both halves are there)."""
        prefix, _, leaf = name.rpartition(".")
        module = self.fp8_modules.get(prefix)
        if module is not None and leaf in ("weight", "weight_scale_inv"):
            if leaf == "weight" and tensor.dtype != FP8_DTYPE:
                raise ValueError(
                    f"{name}: got {tensor.dtype} for an FP8 engine linear; send FP8 bytes + weight_scale_inv"
                    " (precision unified_fp8 or bf16_train_fp8_rollout)"
                )
            halves = self._halves.setdefault(prefix, {})
            halves[leaf] = tensor
            if len(halves) == 2:
                copies += module.fp8_copies(halves["weight"], halves["weight_scale_inv"])
                del self._halves[prefix]
            return
        target = self._tensor(name)
        if target is None:
            raise ValueError(f"{name}: the engine's model has no tensor of that name (sent by the trainer)")
        if tensor.dtype == FP8_DTYPE:
            raise ValueError(
                f"{name}: got FP8 bytes for a non-FP8 engine tensor; set precision=bf16 for a BF16 engine"
            )
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} sent, the engine's is {tuple(target.shape)}"
            )
        copies.append((target, tensor))

    def digests(self, names: Sequence[str]) -> dict[str, Digest]:
        """``digest.Digest`` of each of those tensors, computed on the engine's device (the self-check)."""
        named: dict[str, Tensor] = {}
        for name in names:
            tensor = self._tensor(name)
            if tensor is None:
                raise ValueError(f"{name}: the engine's model has no tensor of that name")
            named[name] = tensor
        return digests(named, list(names))

    def read(self, names: Sequence[str]) -> TensorMap:
        """CPU copies of those tensors (FP8 linears: their FP8 buffers), as a Ray-safe ``TensorMap``."""
        out = TensorMap()
        for name in names:
            tensor = self._tensor(name)
            if tensor is None:
                raise ValueError(f"{name}: the engine's model has no tensor of that name")
            out[name] = tensor.detach().to("cpu", copy=True)
        return out
