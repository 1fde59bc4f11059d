"""The rollout-engine actor: a plain class around an ``EngineBackend``, and the one place it becomes a Ray actor.

``RolloutEngine`` is usable (and unit-tested) without Ray; ``create_engines`` applies
``ray.remote(RolloutEngine).options(...)`` with the placement the stage config asks for:

* CPU machines: each engine takes ``placement.cpus_per_actor`` CPUs.
* GPU, ``placement.mode=disaggregate``: each engine takes ``rollout.tensor_parallel_size`` whole GPUs
  (SGLang spawns its TP workers on them; the native engine uses one) and no CPU reservation
  (``num_cpus=0``, so CPU bundles are not needed for GPU actors).
* GPU, ``placement.mode=colocate``: each engine takes ``ENGINE_GPU_FRACTION_COLOCATED`` of a GPU, the rest
  is left to the trainer worker in the same bundle; memory is handed over with ``release_memory`` /
  ``resume_memory`` around the phases.

Actors run up to ``MAX_CONCURRENCY`` calls at once (threaded actor) so that ``abort`` and ``health``
answer while a ``generate`` runs; the backend's own lock keeps weight updates out of a running batch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from infir2_rl.config.components import RolloutConfig
from infir2_rl.types import EngineBackend, EngineHealth, GenerateRequest, Sample, WeightBucket

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from infir2_rl.config.stage import RlStageConfig

# GPU share of an engine colocated with a trainer worker (the trainer worker should ask for <= 0.6).
ENGINE_GPU_FRACTION_COLOCATED = 0.4
# Concurrent calls per engine actor: generate + abort/health + a waiting weight update.
MAX_CONCURRENCY = 4


def make_engine_backend(
    rollout: RolloutConfig,
    model_path: str,
    *,
    dtype: str = "auto",
    pow2_scales: bool = False,
    device: str = "auto",
) -> EngineBackend:
    """The backend ``rollout.backend`` names, loading ``rollout.fp8_checkpoint`` when FP8 and set, else ``model_path``."""
    fp8_checkpoint = rollout.fp8_checkpoint if rollout.fp8 else None
    if rollout.backend == "native":
        from infir2_rl.engines.native.engine import NativeEngine

        return NativeEngine(
            model_path,
            fp8=rollout.fp8,
            fp8_checkpoint=fp8_checkpoint,
            dtype=dtype,
            device=device,
            max_batch_size=rollout.max_batch_size,
            pow2_scales=pow2_scales,
        )
    if rollout.backend == "sglang":
        from infir2_rl.engines.sglang.engine import SglangEngine

        return SglangEngine(
            fp8_checkpoint or model_path, fp8=rollout.fp8, tensor_parallel_size=rollout.tensor_parallel_size
        )
    raise ValueError(f"rollout.backend={rollout.backend!r}: use 'native' or 'sglang'")


class RolloutEngine:
    """One rollout engine (a Ray actor in runs, a plain object in tests); forwards to its backend."""

    def __init__(
        self,
        rollout: RolloutConfig,
        model_path: str,
        *,
        dtype: str = "auto",
        pow2_scales: bool = False,
        device: str = "auto",
        engine_index: int = 0,
    ) -> None:
        # Before the backend imports transformers / huggingface_hub, which read it at import time.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.engine_index = engine_index
        self.backend = make_engine_backend(
            rollout, model_path, dtype=dtype, pow2_scales=pow2_scales, device=device
        )

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        return self.backend.generate(requests)

    def update_weights(self, bucket: WeightBucket) -> None:
        self.backend.update_weights(bucket)

    def read_weights(self, names: Sequence[str]) -> dict[str, Tensor]:
        return self.backend.read_weights(names)

    def abort(self) -> None:
        self.backend.abort()

    def health(self) -> EngineHealth:
        return self.backend.health()

    def release_memory(self) -> None:
        self.backend.release_memory()

    def resume_memory(self) -> None:
        self.backend.resume_memory()


def _use_gpu(setting: str) -> bool:
    import ray

    if setting == "yes":
        return True
    if setting == "no":
        return False
    return float(ray.cluster_resources().get("GPU", 0)) > 0


def create_engines(
    cfg: RlStageConfig,
    placement_group: Any = None,
    bundle_indices: Sequence[int] | None = None,
) -> list[ActorHandle]:
    """Start ``cfg.rollout.num_engines`` engine actors (Ray must be initialised).

    With a placement group, engine i goes to bundle ``bundle_indices[i]`` (default: bundle i); for
    ``colocate`` pass the bundles of the trainer workers it shares a GPU with.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    num = cfg.rollout.num_engines
    if bundle_indices is not None and len(bundle_indices) != num:
        raise ValueError(
            f"bundle_indices has {len(bundle_indices)} entries for rollout.num_engines={num}: pass one bundle per engine"
        )
    gpu = _use_gpu(cfg.placement.use_gpu)
    resources: dict[str, float]
    if not gpu:
        resources = {"num_cpus": cfg.placement.cpus_per_actor, "num_gpus": 0}
    elif cfg.placement.mode == "colocate":
        resources = {"num_cpus": 0, "num_gpus": ENGINE_GPU_FRACTION_COLOCATED}
    else:
        resources = {"num_cpus": 0, "num_gpus": cfg.rollout.tensor_parallel_size}
    actor_cls = ray.remote(RolloutEngine)
    engines: list[Any] = []
    for i in range(num):
        options: dict[str, Any] = {**resources, "max_concurrency": MAX_CONCURRENCY}
        if placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement_group,
                placement_group_bundle_index=bundle_indices[i] if bundle_indices is not None else i,
                placement_group_capture_child_tasks=True,
            )
        engines.append(
            actor_cls.options(**options).remote(
                cfg.rollout,
                cfg.model.path,
                dtype=cfg.model.dtype,
                pow2_scales=cfg.trainer.fp8_pow2_scales,
                device="cuda" if gpu else "cpu",
                engine_index=i,
            )
        )
    return engines
