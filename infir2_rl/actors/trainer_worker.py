"""TrainerWorker: one data-parallel trainer rank, a plain class that Ray runs as an actor.

`ray.remote(TrainerWorker)` is applied only in trainer_group.py, where the actors are placed; here
the class can be built and tested in-process. Lifecycle: construct (cheap), `master_address()` on
rank 0, then `setup(addr, port)` on every rank at once (joins the process group, loads the model).

Weight export: `export_weights` returns CPU tensors (the object-store transport); `export_ipc_buckets`
(weight_sync.transport=cuda_ipc) keeps this rank's buckets on its GPU and returns CUDA IPC handles of
them, holding the shared buffers until `release_export` or the next export, so they outlive the push.
`export_broadcast_buckets` (weight_sync.transport=nccl) holds flat buffers on rank 0 that
`broadcast_bucket` sends into the weight group rank 0 hosts and joins (`open_weight_group`,
`join_weight_group`; the protocol is in weight_sync/nccl.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from infir2_rl.config import ModelConfig, OptimizerConfig, RlStageConfig, SftStageConfig, TrainerConfig
from infir2_rl.metrics import names
from infir2_rl.trainers.torch.distributed import free_port, init_process_group
from infir2_rl.types import LossFn, TensorMap, TokenBatch, TrainStats, WeightBucket
from infir2_rl.weight_sync.broadcast import BroadcastExport, BucketMeta
from infir2_rl.weight_sync.buckets import HeldBuffer, dtype_named, held_tensors
from infir2_rl.weight_sync.digest import Digest, digests
from infir2_rl.weight_sync.transport import IpcBucket, IpcExporter

if TYPE_CHECKING:
    from infir2_rl.trainers.megatron.trainer import MegatronTrainer
    from infir2_rl.trainers.torch.trainer import TorchTrainer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def pack_tensors(named: Sequence[tuple[str, Tensor]]) -> list[tuple[str, Tensor, str]]:
    """FP8 tensors as uint8 views (same bytes) plus their dtype name.

    torch 2.13 cannot unpickle float8 tensors (its legacy storage reduce loses the dtype), and Ray
    pickles tensors, so an FP8 tensor sent as is fails on the receiving side.
    """
    return [
        (name, t.view(torch.uint8), str(t.dtype)) if t.dtype in _FP8_DTYPES else (name, t, "")
        for name, t in named
    ]


def unpack_tensors(packed: Sequence[tuple[str, Tensor, str]]) -> list[tuple[str, Tensor]]:
    return [(name, t.view(dtype_named(dtype)) if dtype else t) for name, t, dtype in packed]


@dataclass
class TrainerSpec:
    """Everything a trainer rank needs to build itself (sent once to every actor)."""

    model: ModelConfig
    trainer: TrainerConfig
    optimizer: OptimizerConfig
    # Optimizer steps of the stage (the length of the lr schedule).
    total_steps: int
    seed: int = 0
    # None: FSDP2 on GPUs with several ranks, gradient all-reduce otherwise; True/False force it.
    fsdp: bool | None = None
    # torch intra-op threads of the worker process (placement.trainer_threads; 0: Ray's setting).
    torch_threads: int = 0
    # Hold a frozen reference model for the KL penalty (RL with algorithm.kl_coef > 0 only).
    reference: bool = False
    # Train the decoder linears in blockwise FP8 (the stage's precision: `train_fp8`).
    fp8: bool = True
    # RL stages with true_on_policy: forwards by the engine's batch-invariant walk (models/invariant.py).
    true_on_policy: bool = False

    @classmethod
    def from_stage(
        cls, cfg: SftStageConfig | RlStageConfig, *, total_steps: int, fsdp: bool | None
    ) -> TrainerSpec:
        """The spec of a stage's trainer ranks; a reference model only for RL with algorithm.kl_coef > 0."""
        return cls(
            model=cfg.model,
            trainer=cfg.trainer,
            optimizer=cfg.optimizer,
            total_steps=total_steps,
            seed=cfg.seed,
            fsdp=fsdp,
            torch_threads=cfg.placement.trainer_threads,
            reference=isinstance(cfg, RlStageConfig) and cfg.algorithm.needs_reference,
            fp8=cfg.train_fp8,
            true_on_policy=isinstance(cfg, RlStageConfig) and cfg.true_on_policy,
        )


class TrainerWorker:
    """One trainer rank: wraps the configured TrainerBackend (`torch` or `megatron`)."""

    def __init__(self, spec: TrainerSpec, rank: int, world_size: int) -> None:
        self.spec, self.rank, self.world_size = spec, rank, world_size
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        self._backend: TorchTrainer | MegatronTrainer | None = None
        # The last cuda_ipc export: views of GPU buffers engines may still read (see export_ipc_buckets).
        self._export: list[WeightBucket | HeldBuffer] = []
        self._ipc = IpcExporter()  # cuda_ipc: the last push's layout and copy plan
        # weight_sync.transport=nccl: the weight group (rank 0) and the flat buffers of the push in flight.
        self._broadcast = BroadcastExport()

    def master_address(self) -> tuple[str, int]:
        """This node's IP and a free port, for the rendezvous of the process group (called on rank 0)."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str = "127.0.0.1", master_port: int = 0) -> str:
        """Join the process group (several ranks) and build the backend; returns the device name."""
        from infir2_rl.trainers.torch.trainer import TorchTrainer

        if self.world_size > 1:
            init_process_group(master_addr, master_port, self.rank, self.world_size)
        torch.manual_seed(self.spec.seed)
        if self.spec.trainer.backend == "megatron":
            from infir2_rl.trainers.megatron.trainer import MegatronTrainer

            self._backend = MegatronTrainer(
                self.spec.model,
                self.spec.trainer,
                self.spec.optimizer,
                total_steps=self.spec.total_steps,
                seed=self.spec.seed,
                reference=self.spec.reference,
                fp8=self.spec.fp8,
            )
            return str(self._backend.device)
        self._backend = TorchTrainer(
            self.spec.model,
            self.spec.trainer,
            self.spec.optimizer,
            fp8=self.spec.fp8,
            total_steps=self.spec.total_steps,
            seed=self.spec.seed,
            fsdp=self.spec.fsdp,
            reference=self.spec.reference,
            true_on_policy=self.spec.true_on_policy,
        )
        return str(self._backend.device)

    @property
    def backend(self) -> TorchTrainer | MegatronTrainer:
        if self._backend is None:
            raise RuntimeError("TrainerWorker.setup() must be called before use")
        return self._backend

    def packs_sequences(self) -> bool:
        """Whether this rank runs packed micro-batches (``trainer.pack_sequences`` resolved on its device)."""
        return bool(getattr(self.backend, "pack_sequences", False))  # megatron: always padded

    def dropout(self) -> list[str]:
        """Where this rank's model drops activations in training (``TorchTrainer.dropout``; megatron: dropout 0)."""
        return list(getattr(self.backend, "dropout", []))

    def pads_to_buckets(self) -> bool:
        """Whether this rank pads each padded micro-batch to its length bucket (a trainer with layer graphs:
        ``TorchTrainer.pads_to_buckets``, ``MegatronTrainer.pads_to_buckets``)."""
        return bool(getattr(self.backend, "pads_to_buckets", False))

    def train_step(
        self, batches: Sequence[TokenBatch], loss_fn: LossFn, total_units: int, keep_logprobs: bool = False
    ) -> TrainStats:
        stats: TrainStats = self.backend.train_step(batches, loss_fn, total_units, keep_logprobs)
        # Peak memory is per rank; the group reports the maximum over ranks.
        stats.metrics[names.PERF_PEAK_MEMORY_GB] = self.backend.peak_memory_gb()
        return stats

    def memory(self) -> tuple[float, float]:
        """(peak, reserved) GiB of this rank's process since the last call (``metrics.logger.memory_gb``)."""
        from infir2_rl.metrics.logger import memory_gb

        return memory_gb(reset_peak=True)

    def make_room(self, wanted_bytes: int) -> bool:
        """Before a colocated rollout: free what this rank can for the engine's KV cache; True when it dropped
        its layer graphs (``TorchTrainer.make_room``; ``MegatronTrainer.make_room`` only returns cached blocks)."""
        return bool(self.backend.make_room(wanted_bytes))

    def forward_logprobs(
        self, batches: Sequence[TokenBatch], temperature: float, fp8: bool = True
    ) -> list[Tensor]:
        result: list[Tensor] = self.backend.forward_logprobs(batches, temperature, fp8)
        return result

    def forward_ref_logprobs(self, batches: Sequence[TokenBatch], temperature: float) -> list[Tensor]:
        result: list[Tensor] = self.backend.forward_ref_logprobs(batches, temperature)
        return result

    def evaluate_loss(self, batches: Sequence[TokenBatch], loss_fn: LossFn) -> tuple[float, int]:
        result: tuple[float, int] = self.backend.evaluate_loss(batches, loss_fn)
        return result

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        result: list[list[int]] = self.backend.generate_greedy(prompts, max_new_tokens)
        return result

    def export_weights(self, fp8: bool = True) -> list[tuple[str, Tensor]]:
        """HF-named weights (FP8 linears as weight + weight_scale_inv) on rank 0, [] on other ranks.

        Through Ray the result travels as `pack_tensors` output; call `unpack_tensors` on it.
        """
        weights = [(name, t.cpu()) for name, t in self.backend.export_weights(fp8)]
        return pack_tensors(weights) if self.rank == 0 else []  # type: ignore[return-value]

    def export_ipc_buckets(self, fp8: bool, max_bytes: int, version: int) -> list[IpcBucket]:
        """This rank's weights as buckets kept on its GPU, returned as CUDA IPC handles; the buffers are held
        until `release_export`. Called on every rank: under FSDP the export is collective, and each rank
        serves the engine on its GPU."""
        self._export = []  # free the previous export before building the next one
        shared, held = self._ipc.share(list(self.backend.export_weights(fp8)), max_bytes, version)
        self._export = list(held)
        return shared

    def _held(self, names: Iterable[str]) -> dict[str, Tensor]:
        return held_tensors(self._export, names)

    def read_export(self, names: Sequence[str]) -> TensorMap:
        """CPU copies of tensors of the held export (the bytes the engines were sent; tests and tools)."""
        return TensorMap({n: t.to("cpu", copy=True) for n, t in self._held(names).items()})

    def digest_export(self, as_dtypes: dict[str, str]) -> dict[str, Digest]:
        """Digests of tensors of the held export, computed where they are (the self-check's sent side)."""
        return digests(self._held(as_dtypes), list(as_dtypes), as_dtypes)

    def open_weight_group(self, timeout_s: float) -> tuple[str, int, str]:
        """Rank 0: host the weight group's store; ``(address, port, backend)`` for the engines."""
        import ray

        return self._broadcast.open_group(ray.util.get_node_ip_address(), self.backend.device, timeout_s)

    def join_weight_group(self, world_size: int, backend: str, group_name: str, timeout_s: float) -> None:
        """Rank 0: join the weight group as its rank 0 (gloo: returns once every engine is connected)."""
        self._broadcast.join_group(world_size, backend, group_name, timeout_s)

    def export_broadcast_buckets(self, fp8: bool, max_bytes: int, version: int) -> list[BucketMeta]:
        """This rank's weights as flat buckets on its device, held on rank 0 until `release_export`
        (other ranks take part in a collective export and hold nothing)."""
        self.release_export()
        metas = self._broadcast.export(
            self.backend.export_weights(fp8), max_bytes, version, keep=self.rank == 0
        )
        self._export = list(self._broadcast.held)
        return metas

    def broadcast_bucket(self, index: int, timeout_s: float) -> None:
        """Rank 0: send held bucket ``index`` into the weight group."""
        self._broadcast.broadcast(index, timeout_s)

    def release_export(self) -> None:
        self._export = []
        self._broadcast.release()

    def close(self) -> None:
        """Before the actor stops (``remote.stop_actors``): shut down rank 0's side of the weight group."""
        self._broadcast.close_group()

    def break_weight_group(self, reason: str) -> None:
        """Rank 0: a push failed on the driver's side; refuse later broadcasts (``BroadcastExport.mark_broken``)."""
        self._broadcast.mark_broken(reason)

    def save(self, directory: str) -> None:
        self.backend.save(Path(directory))

    def load(self, directory: str) -> None:
        self.backend.load(Path(directory))

    def save_hf(self, directory: str) -> None:
        self.backend.save_hf(Path(directory))

    def step(self) -> int:
        """Optimizer steps taken (skipped ones included)."""
        return int(self.backend.step)
