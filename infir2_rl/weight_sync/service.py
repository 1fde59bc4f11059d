"""The weight-sync service: push the trainer's weights to every engine, versioned, then verify a sample.

A push, given the trainer's HF-named tensors (or ``BucketRef``s the trainer actor already put in the
object store, or ``IpcBucket``s of CUDA IPC handles) and a version:

1. The version must be above the last pushed one (the first push may be any version >= 0), so a stale
   push is refused here before any engine sees it; engines refuse older buckets on their own too.
2. Buckets (``buckets.py``) go out one at a time through the transport: every engine loads bucket i
   before bucket i+1 is sent (one ``ray.get`` per bucket wave), which bounds object-store memory to one
   bucket. Push time is the metric ``weight_sync/push_s``.
3. Self-check (the verl#7986 lesson: FP8 layers silently wrong after a reload): the tensors of
   ``self_check_layers`` decoder layers are read back from one engine and compared byte for byte with
   what was sent. Layers and engine rotate from push to push, so over a run every layer of every
   engine is covered. An engine that keeps a tensor in another dtype than it was sent (a BF16 engine
   sent FP32 master weights) is compared against the sent tensor cast to that dtype, a deterministic
   cast. In the same round trip every engine's ``health().weight_version`` must equal the version.
   Any difference raises ``WeightSyncError`` naming the tensor. With ``IpcBucket``s the sent bytes are
   read back from the trainer (``sent=``: ``TrainerGroup.read_export``), which still holds them.

``push_from(trainer, fp8, version)`` is what the RL stage calls: ``object_store`` brings the exported
tensors to this process and pushes them; ``cuda_ipc`` has every trainer rank keep its export on its GPU
and send handles (``transport.py``), then releases the export once the push and self-check are done.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from infir2_rl.actors.remote import Call, call_all
from infir2_rl.config.components import WeightSyncConfig
from infir2_rl.types import PushStats, WeightBucket, WeightSyncError
from infir2_rl.weight_sync.buckets import build_buckets
from infir2_rl.weight_sync.transport import BucketRef, IpcBucket, Transport, make_transport, share_buckets

# Names -> the bytes that were sent under them (CPU or GPU tensors), for the self-check.
SentReader = Callable[[Sequence[str]], Mapping[str, Tensor]]
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def same_bytes(sent: Tensor, held: Tensor) -> bool:
    """True when ``held`` is bit-identical to ``sent`` (cast to ``held``'s dtype first if they differ)."""
    if tuple(sent.shape) != tuple(held.shape):
        return False
    if sent.dtype != held.dtype:
        sent = sent.to(held.dtype)
    a = sent.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    b = held.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(a, b)


class WeightSource(Protocol):
    """What ``push_from`` needs from a trainer (``actors.trainer_group.TrainerGroup``)."""

    def export_weights(self, fp8: bool = True) -> list[tuple[str, Tensor]]: ...

    def export_ipc_buckets(self, fp8: bool, max_bytes: int, version: int) -> list[IpcBucket]: ...

    def read_export(self, names: Sequence[str]) -> Mapping[str, Tensor]: ...

    def release_export(self) -> None: ...


class WeightSyncService:
    """Pushes weights to a fixed set of engines (Ray actor handles or local ``EngineBackend`` objects)."""

    def __init__(
        self, engines: Sequence[Any], cfg: WeightSyncConfig, transport: Transport | None = None
    ) -> None:
        if not engines:
            raise ValueError("WeightSyncService needs at least one engine")
        self.engines = list(engines)
        self.cfg = cfg
        self.transport = transport or make_transport(cfg)
        self.last_version: int | None = None
        self.num_pushes = 0

    @property
    def max_bucket_bytes(self) -> int:
        return self.cfg.bucket_size_mb * 1024 * 1024

    def push_from(self, trainer: WeightSource, fp8: bool, version: int) -> PushStats:
        """Export the trainer's weights (FP8 linears with ``fp8``) and push them; see the module docstring."""
        if self.transport.name != "cuda_ipc":
            return self.push(trainer.export_weights(fp8), version)
        try:
            buckets = trainer.export_ipc_buckets(fp8, self.max_bucket_bytes, version)
            return self.push(buckets, version, sent=trainer.read_export)
        finally:
            trainer.release_export()  # the engines hold copies now; the trainer frees its GPU buckets

    def push(
        self,
        weights: Iterable[tuple[str, Tensor]] | Sequence[BucketRef] | Sequence[IpcBucket],
        version: int,
        sent: SentReader | None = None,
    ) -> PushStats:
        """Send one version to every engine and verify it; see the module docstring.

        ``sent`` reads back the sent bytes for the self-check when ``weights`` are ``IpcBucket``s.
        """
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(
                f"version={version}: pushes must increase; the last one pushed was {self.last_version}"
            )
        if version < 0:
            raise ValueError(f"version={version}: weight versions are >= 0")
        buckets: list[Any]
        if isinstance(weights, Sequence) and weights and isinstance(weights[0], (BucketRef, IpcBucket)):
            buckets = list(weights)
            if any(b.version != version for b in buckets):
                raise ValueError(
                    f"buckets of versions {sorted({b.version for b in buckets})} pushed as {version}"
                )
            if isinstance(buckets[0], IpcBucket) and sent is None and self.cfg.self_check_layers:
                raise ValueError(
                    "pushing IpcBuckets needs sent= (the trainer's read_export) for the self-check"
                )
        elif self.transport.name == "cuda_ipc":  # tensors on this process's GPU, held here for the push
            named: Iterable[tuple[str, Tensor]] = weights  # type: ignore[assignment]
            buckets, held = share_buckets(build_buckets(named, self.max_bucket_bytes, version, device=None))
            sent = sent or (lambda names: self._sent_tensors(held, set(names)))
        else:
            buckets = build_buckets(weights, self.max_bucket_bytes, version)  # type: ignore[arg-type]
        start = time.perf_counter()
        for bucket in buckets:
            try:
                self.transport.send(self.engines, bucket, self.cfg.timeout_s)
            except Exception as exc:
                if type(exc).__name__ == "GetTimeoutError":
                    raise WeightSyncError(
                        f"push of version {version} hung on bucket {bucket.index} for more than"
                        f" weight_sync.timeout_s={self.cfg.timeout_s}"
                    ) from exc
                raise
        seconds = time.perf_counter() - start
        self.last_version = version
        stats = PushStats(
            version=version,
            seconds=seconds,
            bytes=sum(b.num_bytes for b in buckets),
            num_buckets=len(buckets),
            num_tensors=sum(len(b.names) for b in buckets),
        )
        self._self_check(buckets, version, stats, sent)
        self.num_pushes += 1
        return stats

    def _checked_names(self, all_names: list[str]) -> list[str]:
        if self.cfg.self_check_layers == 0:
            return []
        layers = sorted({n for n in (layer_of(x) for x in all_names) if n is not None})
        if not layers:
            return list(all_names)  # no decoder layers in these names (small test models): check everything
        k = min(self.cfg.self_check_layers, len(layers))
        first = (self.num_pushes * k) % len(layers)
        chosen = {layers[(first + j) % len(layers)] for j in range(k)}
        return [x for x in all_names if layer_of(x) in chosen]

    def _self_check(
        self,
        buckets: Sequence[WeightBucket | BucketRef | IpcBucket],
        version: int,
        stats: PushStats,
        sent_reader: SentReader | None,
    ) -> None:
        start = time.perf_counter()
        names = self._checked_names([n for b in buckets for n in b.names])
        engine_index = self.num_pushes % len(self.engines)
        calls = [Call(e, "health") for e in self.engines]
        if names:
            calls.append(Call(self.engines[engine_index], "read_weights", (names,)))
        results = call_all(calls, self.cfg.timeout_s)
        for i, health in enumerate(results[: len(self.engines)]):
            if health.weight_version != version:
                raise WeightSyncError(
                    f"engine {i} reports weight version {health.weight_version} after pushing {version}"
                )
        if names:
            held: dict[str, Tensor] = results[-1]
            if sent_reader is not None:
                sent = sent_reader(names)
            else:
                sent = self._sent_tensors(buckets, set(names))  # type: ignore[arg-type]
            for name in names:
                if name not in held or not same_bytes(sent[name], held[name]):
                    raise WeightSyncError(
                        f"self-check failed after pushing version {version}: engine {engine_index} holds {name}"
                        " with different bytes than were sent (corrupted or mis-loaded weights)"
                    )
            stats.num_checked, stats.checked_engine = len(names), engine_index
        stats.check_seconds = time.perf_counter() - start

    @staticmethod
    def _sent_tensors(buckets: Sequence[WeightBucket | BucketRef], names: set[str]) -> dict[str, Tensor]:
        needed = [b for b in buckets if names.intersection(b.names)]
        refs = [b.ref for b in needed if isinstance(b, BucketRef)]
        fetched: list[WeightBucket] = []
        if refs:
            import ray

            fetched = ray.get(refs)
        local = [b for b in needed if isinstance(b, WeightBucket)]
        return {n: t for b in local + fetched for n, t in zip(b.names, b.tensors) if n in names}
