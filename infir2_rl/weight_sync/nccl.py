"""``weight_sync.transport: nccl``: buckets broadcast from trainer rank 0 to engines on other GPUs.

For disaggregated placements (engines on GPUs of their own), where CUDA IPC cannot reach and the object store
would copy every byte through host memory. On CPU the same code runs over gloo (how CI tests it); on GPUs
it is NCCL. Ran on two H200s (a 1.5B push in 51 ms; docs/performance.md, "Two GPUs").

Protocol (who calls what, in which order; ``Any`` objects are Ray actor handles or local objects):

1. Once, at the first push (the RL stage's first push is at stage start), after every engine answered
   ``health()`` (so joining does not wait on an engine's start-up): the driver asks the source for
   its sender (``source.weight_sender()``: trainer rank 0, ``TrainerWorker``) and calls
   ``sender.open_weight_group(timeout_s)`` -> ``(host, port, backend)``: the sender hosts the group's TCPStore
   on a free port; backend nccl when the trainer is on a GPU, gloo on CPU. Then, concurrently:
   ``sender.join_weight_group(world_size, backend, group_name, timeout_s)`` (rank 0) and on engine i
   ``engine.init_weights_update_group(host, port, rank_offset_i, world_size, group_name, backend, timeout_s)``
   (positional; an engine backend must accept all seven). Ranks: 0 the sender, then each engine's ranks (``ranks_per_engine``: 1 for a native
   engine, the TP size for SGLang, whose TP rank r takes ``rank_offset + r``); all calls return once the group
   is built: no collective runs at joining (``group.py``: store layout, timeouts).
2. Every push: ``source.export_broadcast_buckets(fp8, max_bytes, version)`` -> ``BucketMeta``s (collective
   over the trainer's ranks under FSDP / TP; rank 0 keeps the flat buffers, ``broadcast.py``).
3. Bucket i, in order: concurrently ``sender.broadcast_bucket(i, timeout_s)`` and on every engine
   ``engine.update_weights_from_distributed(version, i, num_buckets, names, metas)`` (metas: (dtype, shape)
   per tensor; the same call the SGLang engine implements), which receives the flat buffer and loads it.
   All return before bucket i+1 starts. If any of these calls fails (other than a stale version received and
   refused, which leaves the group in step), the driver tells the sender
   (``sender.break_weight_group(reason)``) to refuse later broadcasts: NCCL can complete rank 0's side of a
   broadcast whose receiver died, so the sender cannot be relied on to notice (seen on two H200s).
4. Self-check (``service.py``): the sent bytes are read back from the sender's held export
   (``source.read_export``), then ``source.release_export()`` frees the buffers.

Timeouts: every collective has ``weight_sync.timeout_s`` inside the processes (``group.py``), and the driver
waits ``timeout_s`` plus a margin for the calls to report, so an engine that dies or never answers makes the
push raise ``WeightSyncError`` instead of hanging the trainer; the group is then broken and the stage must
be restarted (it resumes from its last checkpoint).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from torch import Tensor

from infir2_rl.actors.remote import Call, is_actor
from infir2_rl.types import StaleWeightsError, WeightSyncError
from infir2_rl.weight_sync.broadcast import BucketMeta
from infir2_rl.weight_sync.digest import Digest
from infir2_rl.weight_sync.group import WEIGHT_GROUP_NAME
from infir2_rl.weight_sync.transport import Push, WeightSource

log = logging.getLogger(__name__)

# Seconds the driver waits beyond weight_sync.timeout_s for the processes to report their own timeout.
REPORT_MARGIN_S = 30.0


class BroadcastSource(WeightSource, Protocol):
    """A ``WeightSource`` that can broadcast (``TrainerGroup``, ``TensorSource``)."""

    def weight_sender(self) -> Any: ...

    def export_broadcast_buckets(self, fp8: bool, max_bytes: int, version: int) -> list[BucketMeta]: ...


def call_concurrently(calls: Sequence[Call], timeout_s: float) -> list[Any]:
    """Run every call at once and wait for all: actors through Ray, local objects on threads (a broadcast
    blocks until its peers call, so local calls cannot run one after another). Raises ``WeightSyncError``
    past ``timeout_s``; a call's own exception is re-raised."""
    results: list[Any] = [None] * len(calls)
    actor_slots = [i for i, c in enumerate(calls) if is_actor(c.target)]
    local_slots = [i for i, c in enumerate(calls) if not is_actor(c.target)]
    refs = [getattr(calls[i].target, calls[i].method).remote(*calls[i].args) for i in actor_slots]
    deadline = time.monotonic() + timeout_s
    # Not a `with` block: its exit would wait for a hung local call (each one ends at its own timeout).
    pool = ThreadPoolExecutor(max_workers=max(len(local_slots), 1))
    futures = {i: pool.submit(getattr(calls[i].target, calls[i].method), *calls[i].args) for i in local_slots}
    try:
        if refs:
            import ray
            from ray.exceptions import GetTimeoutError

            try:
                values = ray.get(refs, timeout=max(deadline - time.monotonic(), 0.0))
            except GetTimeoutError as exc:
                raise WeightSyncError(_late(calls, timeout_s)) from exc
            for i, value in zip(actor_slots, values):
                results[i] = value
        for i, future in futures.items():
            try:
                results[i] = future.result(timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError as exc:
                raise WeightSyncError(_late(calls, timeout_s)) from exc
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return results


def _late(calls: Sequence[Call], timeout_s: float) -> str:
    return f"{sorted({c.method for c in calls})} did not return within {timeout_s:.0f} s"


class _NcclPush(Push):
    buckets: list[BucketMeta]  # type: ignore[assignment]

    def __init__(
        self, transport: NcclTransport, source: BroadcastSource, buckets: Sequence[BucketMeta]
    ) -> None:
        super().__init__(buckets)  # type: ignore[arg-type]
        self.transport, self.source = transport, source

    def send(self, engines: Sequence[Any], index: int, timeout_s: float) -> None:
        self.transport.connect(self.source, engines, timeout_s)
        b = self.buckets[index]
        calls = [Call(self.transport.sender, "broadcast_bucket", (index, timeout_s))]
        update = (b.version, b.index, b.num_buckets, b.names, b.metas)
        calls += [Call(e, "update_weights_from_distributed", update) for e in engines]
        try:
            call_concurrently(calls, timeout_s + REPORT_MARGIN_S)
        except StaleWeightsError:
            raise  # every engine received the bucket, then refused it: the group is still in step
        except Exception as exc:
            self.transport.break_group(f"bucket {index} of version {b.version}: {type(exc).__name__}")
            raise

    def read_sent(self, names: Sequence[str]) -> Mapping[str, Tensor]:
        return self.source.read_export(names)

    def digest_sent(self, as_dtypes: Mapping[str, str]) -> dict[str, Digest]:
        return self.source.digest_export(as_dtypes)

    def close(self) -> None:
        self.source.release_export()


class NcclTransport:
    """Broadcast buckets through a weight group joined once, at the first push (see the module docstring)."""

    name = "nccl"

    def __init__(self, ranks_per_engine: int = 1, group_name: str = WEIGHT_GROUP_NAME) -> None:
        if ranks_per_engine < 1:
            raise ValueError(f"ranks_per_engine={ranks_per_engine}: each engine has at least one rank")
        self.ranks_per_engine, self.group_name = ranks_per_engine, group_name
        self.sender: Any = None
        self._members: tuple[int, ...] = ()

    def open(self, source: WeightSource, fp8: bool, version: int, max_bytes: int) -> Push:
        if not hasattr(source, "export_broadcast_buckets"):
            raise TypeError(
                f"weight_sync.transport=nccl: {type(source).__name__} cannot broadcast its weights"
            )
        src: BroadcastSource = source  # type: ignore[assignment]
        buckets = src.export_broadcast_buckets(fp8, max_bytes, version)
        if any(b.version != version for b in buckets):
            src.release_export()
            raise ValueError(
                f"buckets of versions {sorted({b.version for b in buckets})} pushed as {version}"
            )
        return _NcclPush(self, src, buckets)

    def break_group(self, reason: str) -> None:
        """A send failed: the sender refuses every later broadcast into this group (its collective sequence can no
        longer be trusted). Not waited for: an actor runs it after the broadcast it may still be blocked in."""
        if self.sender is None:
            return
        if is_actor(self.sender):
            self.sender.break_weight_group.remote(reason)
        else:
            self.sender.break_weight_group(reason)

    def connect(self, source: BroadcastSource, engines: Sequence[Any], timeout_s: float) -> None:
        """Form the weight group of the source's sender and ``engines``: once per stage (the trainer's rank 0 and
        the engines stay the same); a new sender (``service.push`` wraps each call's tensors in a new
        ``TensorSource``) forms a new group, which each native engine joins in place of the old one."""
        sender = source.weight_sender()
        members = (id(sender), *map(id, engines))
        if self.sender is not None and members == self._members:
            return
        # Every engine constructed and answering first, so that joining waits for peers, not for start-up.
        call_concurrently([Call(e, "health") for e in engines], timeout_s)
        start = time.perf_counter()
        (host, port, backend), *_ = call_concurrently(
            [Call(sender, "open_weight_group", (timeout_s,))], timeout_s
        )
        world = 1 + len(engines) * self.ranks_per_engine
        calls = [Call(sender, "join_weight_group", (world, backend, self.group_name, timeout_s))]
        for i, engine in enumerate(engines):
            args = (host, port, 1 + i * self.ranks_per_engine, world, self.group_name, backend, timeout_s)
            calls.append(Call(engine, "init_weights_update_group", args))
        call_concurrently(calls, timeout_s + REPORT_MARGIN_S)
        self.sender, self._members = sender, members
        log.info(
            "weight group %r formed: %d ranks over %s at %s:%d in %.2f s",
            self.group_name, world, backend, host, port, time.perf_counter() - start,
        )  # fmt: skip
