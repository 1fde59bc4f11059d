"""The weight-sync service: push the trainer's weights to every engine, versioned, then verify a sample.

The loop's protocol: the RL stage pushes after every optimizer step (``push_from(trainer, fp8, version=step)``)
and engines generate the next batch only from the pushed version. A push, given a weight source (the trainer
group, or ``transport.TensorSource`` over local tensors via ``push``) and a version:

1. The version must be above the last pushed one (the first push may be any version >= 0), so a stale
   push is refused here before any engine sees it; engines refuse older buckets on their own too.
2. The transport (``transport.py``) exports the weights in its own kind of bucket (``buckets.py``: bounded
   groups of tensors; CUDA IPC: handles of GPU buffers), and the buckets go out one at a time: every engine
   loads bucket i before bucket i+1 is sent (one ``ray.get`` per bucket wave), which bounds object-store
   memory to one bucket. Push time is the metric ``weight_sync/push_s``.
3. Self-check (the verl#7986 lesson: FP8 layers silently wrong after a reload): the tensors of
   ``self_check_layers`` decoder layers held by one engine are compared with what was sent, by digest
   (``digest.py``: dtype, shape and three exact integer sums over the bytes, each computed on the device that
   holds the tensor, so a few numbers travel instead of the layers: reading them back cost 0.42 s per push
   at 1.5B). The engine rotates from push to push and the layer window moves on after each round
   of engines, so every layer of every engine is checked once in engines x ceil(layers / self_check_layers)
   pushes (moving both on every push skipped windows whenever the two counts shared a factor: with 8 engines
   and 28 layers, 14 layers of each engine were never read back); the tensors outside the layers (embedding,
   final norm, untied lm_head) are checked with layer 0's window. An engine that keeps a tensor in another
   dtype than it was sent (a BF16 engine sent FP32 master weights) is compared against the sent tensor cast
   to that dtype, a deterministic cast. In the same round trip every engine's ``health().weight_version``
   must equal the version. Any difference raises ``WeightSyncError`` naming the tensor. The sent side's
   digests come from the transport's push (with CUDA IPC and NCCL, computed by the trainer on its GPU, which
   still holds its export until the push is closed).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from infir2_rl.actors.remote import Call, call_all
from infir2_rl.config.components import WeightSyncConfig
from infir2_rl.types import PushStats, WeightSyncError
from infir2_rl.weight_sync.digest import Digest
from infir2_rl.weight_sync.nccl import NcclTransport
from infir2_rl.weight_sync.transport import (
    CudaIpcTransport,
    ObjectStoreTransport,
    Push,
    TensorSource,
    Transport,
    WeightSource,
)

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


def make_transport(cfg: WeightSyncConfig, ranks_per_engine: int = 1) -> Transport:
    """The transport ``cfg.transport`` names. ``auto`` is resolved by the RL stage from the placement
    (``stages.rl_setup.resolve_transport``); a service built without one gets the object store, which works
    for every placement. ``ranks_per_engine``: an engine's ranks in the nccl weight group (SGLang: its TP)."""
    if cfg.transport in ("auto", "object_store"):
        return ObjectStoreTransport()
    if cfg.transport == "cuda_ipc":
        return CudaIpcTransport()
    if cfg.transport == "nccl":
        return NcclTransport(ranks_per_engine)
    # The config type refuses other names; this guards a name added there but not here.
    raise ValueError(
        f"weight_sync.transport={cfg.transport!r}: no such transport; use object_store, cuda_ipc or nccl"
    )


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

    def push_from(self, source: WeightSource, fp8: bool, version: int) -> PushStats:
        """Export the source's weights (FP8 linears with ``fp8``) and push them; see the module docstring."""
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(
                f"version={version}: pushes must increase; the last one pushed was {self.last_version}"
            )
        if version < 0:
            raise ValueError(f"version={version}: weight versions are >= 0")
        from ray.exceptions import GetTimeoutError  # lazy: local engines need no Ray until here

        push = self.transport.open(source, fp8, version, self.max_bucket_bytes)
        try:
            start = time.perf_counter()
            for index in range(len(push.buckets)):
                try:
                    push.send(self.engines, index, self.cfg.timeout_s)
                except GetTimeoutError as exc:
                    raise WeightSyncError(
                        f"push of version {version} hung on bucket {index} for more than"
                        f" weight_sync.timeout_s={self.cfg.timeout_s}"
                    ) from exc
            self.last_version = version
            stats = PushStats(
                version=version,
                seconds=time.perf_counter() - start,
                bytes=push.num_bytes,
                num_buckets=len(push.buckets),
                num_tensors=len(push.names),
            )
            self._self_check(push, version, stats)
        finally:
            push.close()
        self.num_pushes += 1
        return stats

    def push(self, weights: Iterable[tuple[str, Tensor]], version: int) -> PushStats:
        """Push HF-named tensors of this process as they are (tests, tools, benchmarks)."""
        return self.push_from(TensorSource(weights), fp8=True, version=version)

    def _checked_names(self, all_names: list[str]) -> list[str]:
        if self.cfg.self_check_layers == 0:
            return []
        layers = sorted({n for n in (layer_of(x) for x in all_names) if n is not None})
        if not layers:
            return list(all_names)  # no decoder layers in these names (small test models): check everything
        k = min(self.cfg.self_check_layers, len(layers))
        rounds = self.num_pushes // len(self.engines)  # every engine had this many checks (module docstring)
        first = (rounds * k) % len(layers)
        chosen = {layers[(first + j) % len(layers)] for j in range(k)}
        # The tensors outside the layers (embedding, which is the tied lm_head too, final norm, an untied
        # lm_head) ride with layer 0's window, once per rotation: they were never checked.
        outside = layers[0] in chosen
        return [x for x in all_names if layer_of(x) in chosen or (outside and layer_of(x) is None)]

    def _self_check(self, push: Push, version: int, stats: PushStats) -> None:
        start = time.perf_counter()
        names = self._checked_names(push.names)
        engine_index = self.num_pushes % len(self.engines)
        calls = [Call(e, "health") for e in self.engines]
        if names:
            calls.append(Call(self.engines[engine_index], "weight_digests", (names,)))
        results = call_all(calls, self.cfg.timeout_s)
        for i, health in enumerate(results[: len(self.engines)]):
            if health.weight_version != version:
                raise WeightSyncError(
                    f"engine {i} reports weight version {health.weight_version} after pushing {version}"
                )
        if names:
            held: dict[str, Digest] = results[-1]
            sent = push.digest_sent({n: held[n].dtype for n in names if n in held})
            for name in names:
                if name not in held or held[name] != sent.get(name):
                    raise WeightSyncError(
                        f"self-check failed after pushing version {version}: engine {engine_index} holds {name}"
                        " with different bytes than were sent (corrupted or mis-loaded weights; digest "
                        f"{held.get(name)} held, {sent.get(name)} sent)"
                    )
            stats.num_checked, stats.checked_engine = len(names), engine_index
        stats.check_seconds = time.perf_counter() - start
