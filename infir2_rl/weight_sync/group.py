"""The trainer -> engines weight group: a process group of its own between trainer rank 0 and the engines.

Why not ``torch.distributed.new_group``: the engines are separate processes (Ray actors, or SGLang servers)
that are not in the trainer's default group, and an engine process may have no default group at all. So
the group is built standalone, without touching ``torch.distributed``'s global state: a ``TCPStore`` hosted by
the trainer's rank 0 (group rank 0), and a backend object (``ProcessGroupNCCL`` on GPUs, ``ProcessGroupGloo``
on CPU) constructed directly on it. No default group is needed on either side, and a trainer that has one
(data parallel) keeps it untouched: this group is not registered with ``torch.distributed``, so FSDP and
the trainer's collectives never see it.

Store layout, kept identical to the common ``init_custom_process_group`` recipe (SGLang's
``init_weights_update_group``, OpenRLHF, verl): ``TCPStore(master_address, master_port)`` wrapped in
``PrefixStore(group_name)``, then ``PrefixStore(group_name + "/")`` and ``PrefixStore(device + "/")`` as
``torch.distributed._new_process_group_helper`` does (device ``cuda`` for nccl, ``cpu`` for gloo). So an
SGLang server joining with ``init_weights_update_group(master_address, master_port, rank_offset,
world_size, group_name, backend="nccl")`` meets the trainer in the same keys (not run here: no GPUs).

Ranks: 0 is the trainer's sender; engine i's ranks follow (``rank_offset``: 1 + the ranks of the engines
before it; a native engine has one rank, an SGLang engine one per TP rank).

Timeouts (the trl#6913 lesson: a broadcast without one hangs forever when a peer dies): every step has one.
Joining waits at most ``timeout_s`` for the store and, with gloo, for every rank (gloo connects its full mesh
when the group is built). It runs no collective: an SGLang server's ``init_weights_update_group`` only builds
the group, so an extra collective would pair with the first bucket. NCCL creates its communicator lazily, in
the first bucket's broadcast (within that broadcast's timeout). Every broadcast is ``work.wait(timeout)``: gloo raises at the timeout (or at once when a
peer's connection closes); NCCL (torch >= 2.4) blocks the CPU until the work completes or the timeout
passes, then aborts the communicator and raises. Any failure marks the group broken: the collective
sequence can no longer be trusted, so later broadcasts refuse at once with ``WeightSyncError`` instead of
pairing bytes with the wrong bucket. The NCCL watchdog must not kill the process either: a ProcessGroupNCCL
reads ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` when it is built, and the default (3, SkipCleanUp) tears the whole
process down when a collective of the group fails or times out; this group is built with 2 (CleanUpOnly:
abort the communicator, keep the process), the trainer's own groups keep the default. The watchdog's timeout
is also set ``WATCHDOG_MARGIN_S`` later than ours, so our wait reports a stuck peer first. (From torch's source.
On two H200s, rank 0's broadcast of a 1 MiB bucket to a killed engine completed without error, so this
timeout/abort path was not reached there; the driver breaks the group instead, ``nccl.py``.)
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from infir2_rl.types import WeightSyncError

log = logging.getLogger(__name__)

# One name for the group, shared with the SGLang engine (engines/sglang: its group_name).
WEIGHT_GROUP_NAME = "infir2_weight_sync"
# The NCCL watchdog fires this much later than our own wait, which aborts first (see the module docstring).
WATCHDOG_MARGIN_S = 60.0
# TORCH_NCCL_ASYNC_ERROR_HANDLING of the weight group: CleanUpOnly (abort the communicator, keep the process).
NCCL_ERROR_HANDLING = "2"
_ENV_LOCK = threading.Lock()


def group_backend(device: torch.device) -> str:
    """The group's backend for a sender on ``device``: nccl between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def host_store(host: str, timeout_s: float) -> tuple[Any, int]:
    """The group's ``TCPStore`` served by the sender (rank 0) on a free port: ``(store, port)``."""
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, int(store.port)


class WeightGroup:
    """One rank's handle on the weight group: broadcasts from rank 0 with a timeout (see the module docstring)."""

    def __init__(
        self, pg: Any, store: Any, rank: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        self.pg, self.store = pg, store  # the store must outlive the group (NCCL keeps its keys there)
        self.rank, self.world_size, self.backend, self.timeout_s = rank, world_size, backend, timeout_s
        self.broken: str | None = None

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        *,
        backend: str,
        group_name: str = WEIGHT_GROUP_NAME,
        timeout_s: float,
        store: Any = None,
    ) -> WeightGroup:
        """Join as ``rank`` (rank 0 passes the store it hosts); gloo returns once every rank is connected."""
        from torch.distributed import PrefixStore, TCPStore

        if not 0 <= rank < world_size:
            raise ValueError(f"weight group rank {rank} outside world size {world_size}")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"weight group backend {backend!r}: use nccl (GPUs) or gloo (CPU)")
        timeout = timedelta(seconds=timeout_s)
        what = f"joining weight group {group_name!r} as rank {rank} of {world_size}"
        device = "cuda" if backend == "nccl" else "cpu"
        try:
            if store is None:
                store = TCPStore(master_address, master_port, None, False, timeout)
            prefixed = PrefixStore(
                f"{device}/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store))
            )
            pg = _make_backend(backend, prefixed, rank, world_size, timeout)
        except (RuntimeError, TimeoutError) as exc:  # DistStoreError / gloo connect errors are RuntimeErrors
            raise WeightSyncError(
                f"{what}: not every member joined within weight_sync.timeout_s={timeout_s} ({exc})"
            ) from exc
        group = cls(pg, store, rank, world_size, backend, timeout_s)
        log.info("weight group %r: rank %d of %d joined (%s)", group_name, rank, world_size, backend)
        return group

    def broadcast_(self, tensor: Tensor, what: str) -> None:
        """Broadcast ``tensor`` from rank 0 into every rank's ``tensor`` in place, within ``timeout_s``."""
        from torch.distributed import BroadcastOptions

        self.refuse_if_broken(what)
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        try:
            self.pg.broadcast([tensor], opts).wait(timedelta(seconds=self.timeout_s))
        except Exception as exc:
            self.broken = f"{what}: {str(exc).splitlines()[0][:300]}"
            raise WeightSyncError(
                f"{what}: the broadcast failed or took more than weight_sync.timeout_s={self.timeout_s}"
                f" (a peer died or never joined): {exc}"
            ) from exc

    def refuse_if_broken(self, what: str) -> None:
        if self.broken is not None:
            raise WeightSyncError(
                f"{what}: the weight group broke earlier ({self.broken}); restart the stage to rebuild it"
            )

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception as exc:  # a broken group may refuse a clean shutdown; nothing else holds it
                log.warning("weight group rank %d: shutdown failed: %s", self.rank, exc)


def _make_backend(backend: str, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
    import torch.distributed as dist

    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        return ProcessGroupGloo(store, rank, world_size, timeout)
    if not dist.is_nccl_available() or not torch.cuda.is_available():
        raise ValueError(
            "weight_sync.transport=nccl with the trainer on a GPU needs torch with NCCL and a GPU in every"
            " member of the group; this process has none"
        )
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout + timedelta(seconds=WATCHDOG_MARGIN_S)
    name = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    with _ENV_LOCK:  # read once, in the constructor: set for this group only (see the module docstring)
        before = os.environ.get(name)
        os.environ[name] = NCCL_ERROR_HANDLING
        try:
            return ProcessGroupNCCL(store, rank, world_size, opts)
        finally:
            if before is None:
                del os.environ[name]
            else:
                os.environ[name] = before
