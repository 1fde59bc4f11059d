"""TrainerGroup: N TrainerWorker actors in one placement group, driven as one data-parallel trainer.

Every call fans out to all ranks and is gathered with a single `ray.get` (`remote.gather`: a rank's death wins over
the errors it caused in its peers). A global batch is cut into
contiguous row shards, one per rank, and each shard into micro-batches (microbatch.py); the loss
weights use the global unit count, so the result does not depend on the number of ranks.

    with placed_trainer_group(cfg, total_steps=100) as group:  # places actors, forms the process group
        stats = group.train_step(batch, loss_fn, total_units)
        logp  = group.forward_logprobs(batch, temperature)  # B x L, aligned like batch.input_ids
        ref   = group.forward_ref_logprobs(batch, temperature)  # the same under the reference (kl_coef > 0)
        sync.push_from(group, fp8, version)                 # weight export for WeightSyncService (WeightSource;
                                                            # weight_sync.transport=nccl: rank 0 broadcasts)
        group.save(path); group.load(path); group.save_hf(path)
        group.shutdown()
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from torch import Tensor

from infir2_rl.actors.placement import Placement, reserve_for
from infir2_rl.actors.remote import gather, stop_actors
from infir2_rl.actors.trainer_worker import TrainerSpec, TrainerWorker, unpack_tensors
from infir2_rl.config import RlStageConfig, SftStageConfig
from infir2_rl.metrics import names
from infir2_rl.trainers.microbatch import (
    compact,
    merge_rows,
    row_lengths,
    shard_micro_batches,
    shard_rows,
    unshuffle_rows,
)
from infir2_rl.types import LossFn, TokenBatch, TrainStats
from infir2_rl.weight_sync.broadcast import BucketMeta
from infir2_rl.weight_sync.digest import Digest
from infir2_rl.weight_sync.transport import IpcBucket, merge_ipc_buckets

log = logging.getLogger(__name__)


class TrainerGroup:
    """Data-parallel trainer actors in the trainer slots of a reserved ``Placement`` (the caller's: an RL stage
    shares it with the engines; ``placed_trainer_group`` reserves one of its own)."""

    def __init__(
        self,
        cfg: SftStageConfig | RlStageConfig,
        placement: Placement,
        *,
        total_steps: int,
        fsdp: bool | None = None,
    ) -> None:
        # Ranks of one model replica (megatron TP x CP, consecutive ranks) take the same micro-batches.
        self.model_parallel = 1
        if cfg.trainer.backend == "megatron":
            from infir2_rl.trainers.megatron.model import resolve_stage_spec

            # Refuses what cannot run (no megatron-core, te without TE, ...) before any actor starts.
            resolve_stage_spec(cfg)
            self.model_parallel = cfg.trainer.model_parallel_size
        self.num_workers = cfg.trainer.num_workers
        self.trainer_cfg = cfg.trainer
        slots = len(placement.plan.trainer.bundles)
        if slots < self.num_workers:
            raise ValueError(
                f"trainer.num_workers={self.num_workers}: the placement plan has {slots} trainer slots"
            )
        if fsdp is None and cfg.trainer.backend == "torch":
            from infir2_rl.trainers.torch import distributed as D

            fsdp = D.resolve_data_parallel(
                cfg.trainer.data_parallel, self.num_workers, placement.plan.use_gpu,
                lambda: D.count_parameters(cfg.model.path),
            )  # fmt: skip
        elif fsdp is None and placement.plan.use_gpu and self.num_workers > 1:
            fsdp = True  # megatron: collective export (its ranks hold shards)
        self.fsdp = fsdp
        # Every rank takes part in an export where it is collective: FSDP and megatron TP gather shards, and
        # megatron's te spec sums the distributed optimizer's FP32 master shards over the data-parallel ranks
        # (a worker resolves "auto" itself, so only "local" is known not to).
        self.collective_export = (
            bool(fsdp)
            or self.model_parallel > 1
            or (cfg.trainer.backend == "megatron" and cfg.trainer.megatron_spec != "local")
        )
        spec = TrainerSpec.from_stage(cfg, total_steps=total_steps, fsdp=fsdp)
        remote_cls = ray.remote(TrainerWorker)
        self.workers: list[Any] = [
            remote_cls.options(
                name=None, max_concurrency=1, **placement.actor_options("trainer", rank)
            ).remote(spec, rank, self.num_workers)
            for rank in range(self.num_workers)
        ]
        try:
            addr, port = ray.get(self.workers[0].master_address.remote())
            devices = self._all("setup", addr, port)
            packs = set(self._all("packs_sequences"))  # "auto" resolves on the workers' devices
            buckets = set(self._all("pads_to_buckets"))
            # An RL step's first update takes its old log-probs from its training forward (stages/rl.py), which
            # dropout would perturb: refused here, before the first rollout, rather than at the first update.
            dropout = self._all("dropout")[0] if isinstance(cfg, RlStageConfig) else []
        except Exception:
            self.shutdown()
            raise
        if dropout:
            self.shutdown()
            raise ValueError(
                f"model {cfg.model.path} drops activations in training ({', '.join(dropout)}): an RL stage needs"
                " dropout 0 (its training forward's log-probs are the old policy's); set it to 0 in config.json"
            )
        if len(packs) != 1 or len(buckets) != 1:
            self.shutdown()
            raise RuntimeError(
                f"trainer ranks disagree on trainer.pack_sequences or cuda_graphs=auto (devices {devices})"
            )
        self.pack_sequences: bool = packs.pop()
        # Padded micro-batches run padded to a length bucket: the token budget counts the bucket.
        self.pads_to_buckets: bool = buckets.pop()
        log.info(
            "trainer group: %d ranks on %s (fsdp=%s, packed micro-batches: %s, rows sorted by length: %s, "
            "padded to length buckets: %s)",
            self.num_workers, sorted(set(devices)), fsdp, self.pack_sequences,
            self.trainer_cfg.sorts_rows, self.pads_to_buckets,
        )  # fmt: skip

    # ------------------------------------------------------------------ fan-out helpers
    def _all(self, method: str, *args: Any) -> list[Any]:
        return gather([getattr(w, method).remote(*args) for w in self.workers])

    def _per_rank(self, method: str, per_rank_args: Sequence[tuple[Any, ...]]) -> list[Any]:
        return gather([getattr(w, method).remote(*a) for w, a in zip(self.workers, per_rank_args)])

    def _rows(self, batch: TokenBatch) -> list[list[int]]:
        """Each model replica's row indices (``microbatch.shard_rows``: by length under trainer.sort_by_length
        with a token budget, else contiguous blocks)."""
        return shard_rows(
            row_lengths(batch), self.num_workers // self.model_parallel, self.trainer_cfg.sorts_rows
        )

    def _shards(self, batch: TokenBatch, rows: list[list[int]] | None = None) -> list[list[TokenBatch]]:
        t = self.trainer_cfg
        mp = self.model_parallel
        shards = shard_micro_batches(
            batch,
            self.num_workers // mp,
            t.micro_batch_size,
            t.max_tokens_per_gpu,
            self.pack_sequences,
            rows if rows is not None else self._rows(batch),
            bucketed=self.pads_to_buckets,  # rows x bucket(longest) <= budget (microbatch docstring)
        )
        # Sent through Ray: each micro-batch as its own tensors, not views of the global batch (``compact``).
        own = [[compact(mb) for mb in shard] for shard in shards]
        return [own[rank // mp] for rank in range(self.num_workers)]

    def _per_row(self, method: str, batch: TokenBatch, *args: Any) -> Tensor:
        """B x L per-row results of ``method`` over the ranks' micro-batches of ``batch``, in batch order."""
        rows = self._rows(batch)
        parts: list[list[Tensor]] = self._per_rank(
            method, [(shard, *args) for shard in self._shards(batch, rows)]
        )
        return self._in_batch_order(parts, batch, rows)

    def _in_batch_order(self, parts: list[list[Tensor]], batch: TokenBatch, rows: list[list[int]]) -> Tensor:
        """Each rank's row results (its rows in its order, as one or more B_i x L_i tensors) as one B x L in
        ``batch``'s row order; ``rows``: each model replica's row indices (``_rows``)."""
        replicas = parts[:: self.model_parallel]  # one answer per model replica
        merged = merge_rows([p for rank_parts in replicas for p in rank_parts], int(batch.input_ids.shape[1]))
        return unshuffle_rows(merged, [i for index in rows for i in index])

    # ------------------------------------------------------------------ trainer API
    def train_step(
        self, batch: TokenBatch, loss_fn: LossFn, total_units: int, keep_logprobs: bool = False
    ) -> TrainStats:
        """One optimizer step on the global `batch`; `total_units` = loss units over all of it.

        ``keep_logprobs``: ``TrainStats.logprobs`` holds the training forward's log-probs of the trained tokens,
        B x L in batch order (0 off the loss mask), as ``forward_logprobs`` would have scored them before the
        step on the same micro-batches (tests/test_old_logprobs_gpu.py holds them equal bit for bit).
        """
        loss_ref = ray.put(loss_fn)
        rows = self._rows(batch)
        stats: list[TrainStats] = self._per_rank(
            "train_step",
            [(shard, loss_ref, total_units, keep_logprobs) for shard in self._shards(batch, rows)],
        )
        peak = max(s.metrics.pop(names.PERF_PEAK_MEMORY_GB, 0.0) for s in stats)
        logprobs = None
        if keep_logprobs:
            kept = [s.logprobs for s in stats]
            assert all(t is not None for t in kept), "every rank returns its rows' log-probs when asked"
            logprobs = self._in_batch_order([[t] for t in kept if t is not None], batch, rows)
        result = replace(stats[0], step_time_s=max(s.step_time_s for s in stats), logprobs=logprobs)
        result.metrics[names.PERF_PEAK_MEMORY_GB] = peak
        return result

    def memory(self) -> list[tuple[float, float]]:
        """Each rank's (peak, reserved) GiB since the last call (``TrainerWorker.memory``)."""
        return self._all("memory")

    def make_room(self, wanted_bytes: int) -> list[bool]:
        """Each rank's ``TrainerWorker.make_room``: True where it dropped its layer graphs."""
        return self._all("make_room", wanted_bytes)

    def forward_logprobs(self, batch: TokenBatch, temperature: float = 1.0, fp8: bool = True) -> Tensor:
        """Per-token log-probs of the whole batch, B x L float32, 0 at position 0 and on padding.

        ``fp8=False``: the FP8 linears run dense on their master weights (see ``fp8.linear.fp8_disabled``).
        """
        return self._per_row("forward_logprobs", batch, temperature, fp8)

    def forward_ref_logprobs(self, batch: TokenBatch, temperature: float) -> Tensor:
        """Per-token log-probs under the frozen reference model (algorithm.kl_coef > 0), like forward_logprobs."""
        return self._per_row("forward_ref_logprobs", batch, temperature)

    def evaluate_loss(self, batch: TokenBatch, loss_fn: LossFn) -> float:
        """Mean loss over all units of `batch` (no update)."""
        results = self._per_rank("evaluate_loss", [(shard, loss_fn) for shard in self._shards(batch)])
        results = results[:: self.model_parallel]
        units = sum(u for _, u in results)
        return sum(total for total, _ in results) / max(units, 1)

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy completions of `prompts`, spread over the ranks (evaluation)."""
        n, w = len(prompts), self.num_workers
        bounds = [(r * n // w, (r + 1) * n // w) for r in range(w)]
        outs = self._per_rank("generate_greedy", [(list(prompts[a:b]), max_new_tokens) for a, b in bounds])
        return [row for rank_rows in outs for row in rank_rows]

    def export_weights(self, fp8: bool = True) -> list[tuple[str, Tensor]]:
        """HF-named weights from rank 0 (every rank takes part under FSDP, where export is collective);
        ``fp8=False`` for BF16 engines (precision bf16)."""
        # Collective: FSDP gathers shards, megatron TP gathers shards.
        if self.collective_export:
            return unpack_tensors(self._all("export_weights", fp8)[0])
        return unpack_tensors(ray.get(self.workers[0].export_weights.remote(fp8)))

    def export_ipc_buckets(self, fp8: bool, max_bytes: int, version: int) -> list[IpcBucket]:
        """weight_sync.transport=cuda_ipc: every rank keeps its export on its GPU (until `release_export`)
        and the buckets carry each rank's CUDA IPC handles; an engine opens those of its own GPU."""
        return merge_ipc_buckets(self._all("export_ipc_buckets", fp8, max_bytes, version))

    def weight_sender(self) -> Any:
        """weight_sync.transport=nccl: the actor that is rank 0 of the weight group (trainer rank 0)."""
        return self.workers[0]

    def export_broadcast_buckets(self, fp8: bool, max_bytes: int, version: int) -> list[BucketMeta]:
        """weight_sync.transport=nccl: rank 0 holds the push as flat buffers on its device (until
        `release_export`) and returns their metadata; other ranks take part where the export is collective."""
        if self.collective_export:
            metas: list[BucketMeta] = self._all("export_broadcast_buckets", fp8, max_bytes, version)[0]
            return metas
        result: list[BucketMeta] = ray.get(
            self.workers[0].export_broadcast_buckets.remote(fp8, max_bytes, version)
        )
        return result

    def read_export(self, names: Sequence[str]) -> Mapping[str, Tensor]:
        """CPU copies of rank 0's held export, for the weight-sync self-check."""
        result: Mapping[str, Tensor] = ray.get(self.workers[0].read_export.remote(list(names)))
        return result

    def digest_export(self, as_dtypes: Mapping[str, str]) -> dict[str, Digest]:
        """Digests of rank 0's held export (computed on its GPU), for the weight-sync self-check."""
        result: dict[str, Digest] = ray.get(self.workers[0].digest_export.remote(dict(as_dtypes)))
        return result

    def release_export(self) -> None:
        self._all("release_export")

    def save(self, directory: Path) -> None:
        self._all("save", str(directory))

    def load(self, directory: Path) -> None:
        self._all("load", str(directory))

    def save_hf(self, directory: Path) -> None:
        self._all("save_hf", str(directory))

    def shutdown(self) -> None:
        stop_actors(self.workers)
        self.workers = []


@contextmanager
def placed_trainer_group(
    cfg: SftStageConfig | RlStageConfig, *, total_steps: int, fsdp: bool | None = None
) -> Iterator[TrainerGroup]:
    """A TrainerGroup on a placement of its own (the SFT stage, tools, tests), shut down and given back on exit."""
    placement = reserve_for(cfg.placement, num_trainers=cfg.trainer.num_workers)
    try:
        group = TrainerGroup(cfg, placement, total_steps=total_steps, fsdp=fsdp)
        try:
            yield group
        finally:
            group.shutdown()
    finally:
        placement.remove()
