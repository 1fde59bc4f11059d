"""Where a stage's actors run: one function decides it (``plan_placement``), one Ray placement group holds it.

``plan_placement`` is the whole policy, a pure function of the stage's placement config, the actor counts and
the cluster's resources (unit-tested without Ray):

* use the GPU? ``placement.use_gpu``: ``auto`` = when the cluster has GPUs; ``yes`` without GPUs is an error,
  not a silent CPU run; ``no`` = CPU.
* GPU + ``colocate`` (an RL stage with engines): one GPU bundle per trainer worker; engine i shares the bundle of
  worker i x (its tensor-parallel size). The trainer takes ``TRAINER_GPU_SHARE`` of the GPU and the engine
  ``ENGINE_GPU_SHARE``: Ray's accounting of one GPU, not a memory limit; the engine frees its memory while the
  trainer works (release/resume around the phases). An engine of tensor-parallel size k sits in its first
  bundle and its server uses the next k-1 GPUs too (Ray cannot give one actor shares of several bundles).
* GPU + ``disaggregate``: a GPU bundle per trainer worker, then one bundle of k GPUs per engine.
* CPU: one bundle of ``placement.cpus_per_actor`` CPUs per actor, trainers first.

In GPU bundles actors ask for ``num_cpus=0``: the bundle's CPUs stay reserved for the node (data loading,
NCCL threads), and a colocated trainer + engine asking one CPU each would need two.

``reserve(plan)`` creates the placement group (PACK: as few nodes as possible) and waits for it;
``Placement.actor_options(role, i)`` gives the ``.options(...)`` that put actor i of a role in its bundle.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from infir2_rl.config.components import PlacementConfig

log = logging.getLogger(__name__)

# Seconds to wait for the cluster to grant the bundles before failing with a clear message.
PLACEMENT_TIMEOUT_S = 120.0
# GPU shares of a trainer worker and an engine colocated on one GPU (they sum to 1).
TRAINER_GPU_SHARE = 0.6
ENGINE_GPU_SHARE = 0.4

Role = Literal["trainer", "engine"]


@dataclass(frozen=True)
class RolePlacement:
    """Where the actors of one role go: actor i in bundle ``bundles[i]``, asking for ``gpus`` and ``cpus``."""

    bundles: tuple[int, ...]
    gpus: float
    cpus: float


@dataclass(frozen=True)
class PlacementPlan:
    """The placement decided for a stage (see the module docstring); nothing is reserved yet."""

    use_gpu: bool
    # A trainer worker and an engine share each GPU (RL on GPUs with placement.mode=colocate).
    colocate: bool
    # Resources of each bundle of the placement group.
    bundles: tuple[dict[str, float], ...]
    trainer: RolePlacement
    engine: RolePlacement

    def role(self, role: Role) -> RolePlacement:
        return self.trainer if role == "trainer" else self.engine


def plan_placement(
    placement: PlacementConfig,
    *,
    num_trainers: int,
    num_engines: int = 0,
    engine_gpus: int = 1,
    cluster_resources: Mapping[str, float],
) -> PlacementPlan:
    """The one placement policy for trainers and engines; ``cluster_resources`` as ``ray.cluster_resources()``."""
    cluster_gpus = float(cluster_resources.get("GPU", 0))
    if placement.use_gpu == "yes" and cluster_gpus == 0:
        raise ValueError(
            "placement.use_gpu='yes': the Ray cluster has no GPUs; use 'auto' or 'no' to run on CPU"
        )
    use_gpu = placement.use_gpu != "no" and cluster_gpus > 0
    cpus = placement.cpus_per_actor
    trainer_bundles = tuple(range(num_trainers))
    if not use_gpu:
        bundles = tuple({"CPU": cpus} for _ in range(num_trainers + num_engines))
        engines = tuple(range(num_trainers, num_trainers + num_engines))
        plan = PlacementPlan(
            False, False, bundles, RolePlacement(trainer_bundles, 0, cpus), RolePlacement(engines, 0, cpus)
        )
    elif placement.mode == "colocate" and num_engines > 0:
        if num_engines * engine_gpus > num_trainers:
            raise ValueError(
                f"rollout.num_engines={num_engines} x rollout.tensor_parallel_size={engine_gpus} GPUs: colocate"
                f" shares the trainer's GPUs, trainer.num_workers={num_trainers}; lower the engines or use"
                " placement.mode=disaggregate"
            )
        bundles = tuple({"GPU": 1.0, "CPU": cpus} for _ in range(num_trainers))
        engines = tuple(i * engine_gpus for i in range(num_engines))
        plan = PlacementPlan(
            True,
            True,
            bundles,
            RolePlacement(trainer_bundles, TRAINER_GPU_SHARE, 0),
            RolePlacement(engines, ENGINE_GPU_SHARE, 0),
        )
    else:
        bundles = tuple({"GPU": 1.0, "CPU": cpus} for _ in range(num_trainers))
        bundles += tuple({"GPU": float(engine_gpus), "CPU": cpus} for _ in range(num_engines))
        engines = tuple(range(num_trainers, num_trainers + num_engines))
        plan = PlacementPlan(
            True,
            False,
            bundles,
            RolePlacement(trainer_bundles, 1.0, 0),
            RolePlacement(engines, engine_gpus, 0),
        )
    _check_fits(plan, cluster_resources)
    return plan


def _check_fits(plan: PlacementPlan, cluster: Mapping[str, float]) -> None:
    for resource, hint in (
        ("CPU", "lower trainer.num_workers, rollout.num_engines or placement.cpus_per_actor"),
        ("GPU", "lower trainer.num_workers (one per GPU) or rollout.num_engines"),
    ):
        need = sum(b.get(resource, 0.0) for b in plan.bundles)
        have = float(cluster.get(resource, 0))
        if need > have:
            raise ValueError(
                f"{len(plan.bundles)} placement bundles need {need:g} {resource}s; the Ray cluster has {have:g}: {hint}"
            )


class Placement:
    """A reserved placement group for a plan; ``remove()`` gives it back."""

    def __init__(self, plan: PlacementPlan, placement_group: Any) -> None:
        self.plan = plan
        self.placement_group = placement_group

    def actor_options(self, role: Role, index: int) -> dict[str, Any]:
        """``.options(...)`` kwargs placing actor ``index`` of ``role`` in its bundle with its share."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        where = self.plan.role(role)
        if not 0 <= index < len(where.bundles):
            raise ValueError(f"{role} {index}: the placement plan has {len(where.bundles)} {role} slots")
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group,
            placement_group_bundle_index=where.bundles[index],
            placement_group_capture_child_tasks=True,
        )
        return {"num_gpus": where.gpus, "num_cpus": where.cpus, "scheduling_strategy": strategy}

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        from infir2_rl.actors.ray_runtime import cluster_gone

        if cluster_gone():
            log.warning("Ray's cluster has gone (its GCS does not answer): its placement group goes with it")
            return
        remove_placement_group(self.placement_group)


def reserve(plan: PlacementPlan, timeout_s: float = PLACEMENT_TIMEOUT_S) -> Placement:
    """Create the plan's placement group and wait until the cluster grants it."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([dict(b) for b in plan.bundles], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"placement group of {len(plan.bundles)} bundles not granted within {timeout_s:.0f} s: other jobs hold"
            " the resources (see `ray status`)"
        )
    log.info("placement group: %s", list(plan.bundles))
    return Placement(plan, pg)


def reserve_for(
    placement: PlacementConfig, *, num_trainers: int, num_engines: int = 0, engine_gpus: int = 1
) -> Placement:
    """``plan_placement`` against the connected Ray cluster, then ``reserve``."""
    import ray

    plan = plan_placement(
        placement,
        num_trainers=num_trainers,
        num_engines=num_engines,
        engine_gpus=engine_gpus,
        cluster_resources=ray.cluster_resources(),
    )
    return reserve(plan)
