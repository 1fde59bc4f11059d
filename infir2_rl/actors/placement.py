"""One Ray placement group for a stage's actors: GPU bundles where GPUs exist, CPU bundles otherwise.

Bundle shapes:
* GPU: {"GPU": 1, "CPU": cpus_per_bundle}. Actors placed in it ask for a share of the GPU and
  `num_cpus=0`: the bundle's CPUs are reserved for the node (data loading, NCCL threads), and an
  actor that also asked for a CPU would make a colocated trainer + engine need two.
* CPU: {"CPU": cpus_per_bundle}. Actors ask for their share of those CPUs.

Colocation: a trainer and an engine may share bundle i (each takes `share=0.5`); the trainer group
exposes its `PlacementPlan` and bundle indices so the rollout side can place engines there later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

log = logging.getLogger(__name__)

# Seconds to wait for the cluster to grant the bundles before failing with a clear message.
PLACEMENT_TIMEOUT_S = 120.0


def resolve_use_gpu(setting: Literal["auto", "yes", "no"]) -> bool:
    """`auto`: GPUs when the Ray cluster has any. `yes` without GPUs is an error, not a silent CPU run."""
    num_gpus = float(ray.cluster_resources().get("GPU", 0))
    if setting == "no":
        return False
    if setting == "yes" and num_gpus == 0:
        raise ValueError(
            "placement.use_gpu='yes': the Ray cluster has no GPUs; use 'auto' or 'no' to run on CPU"
        )
    return num_gpus > 0


@dataclass
class PlacementPlan:
    """A created placement group and what its bundles hold."""

    placement_group: PlacementGroup
    use_gpu: bool
    num_bundles: int
    cpus_per_bundle: float
    # Bundles given to each role so far (e.g. "trainer": [0, 1]); informational.
    assigned: dict[str, list[int]] = field(default_factory=dict)

    @property
    def bundle_indices(self) -> list[int]:
        return list(range(self.num_bundles))

    def actor_options(self, bundle_index: int, share: float = 1.0) -> dict[str, Any]:
        """`.options(...)` kwargs placing one actor in `bundle_index`, taking `share` of its GPU / CPUs."""
        if not 0 <= bundle_index < self.num_bundles:
            raise ValueError(
                f"bundle_index={bundle_index}: the placement group has {self.num_bundles} bundles"
            )
        if not 0 < share <= 1:
            raise ValueError(f"share={share}: must be in (0, 1] (the fraction of the bundle this actor uses)")
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group,
            placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=True,
        )
        if self.use_gpu:
            return {"num_gpus": share, "num_cpus": 0, "scheduling_strategy": strategy}
        return {"num_cpus": self.cpus_per_bundle * share, "num_gpus": 0, "scheduling_strategy": strategy}


def create_placement(
    num_bundles: int, *, use_gpu: bool, cpus_per_bundle: float = 1.0, timeout_s: float = PLACEMENT_TIMEOUT_S
) -> PlacementPlan:
    """Reserve `num_bundles` bundles (PACK: as few nodes as possible) and wait until they are granted."""
    if num_bundles < 1:
        raise ValueError(f"num_bundles={num_bundles}: must be >= 1")
    total = ray.cluster_resources()
    need_cpu = num_bundles * cpus_per_bundle
    if need_cpu > float(total.get("CPU", 0)):
        raise ValueError(
            f"{num_bundles} actors x placement.cpus_per_actor={cpus_per_bundle} need {need_cpu:g} CPUs; the Ray"
            f" cluster has {total.get('CPU', 0):g}: lower trainer.num_workers or placement.cpus_per_actor"
        )
    if use_gpu and num_bundles > float(total.get("GPU", 0)):
        raise ValueError(
            f"{num_bundles} GPU bundles requested; the Ray cluster has {total.get('GPU', 0):g} GPUs:"
            " lower trainer.num_workers (one per GPU)"
        )
    bundle: dict[str, float] = {"CPU": cpus_per_bundle}
    if use_gpu:
        bundle["GPU"] = 1.0
    pg = placement_group([dict(bundle) for _ in range(num_bundles)], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"placement group of {num_bundles} x {bundle} not granted within {timeout_s:.0f} s: other jobs hold"
            " the resources (see `ray status`)"
        )
    log.info("placement group: %d bundles of %s", num_bundles, bundle)
    return PlacementPlan(pg, use_gpu=use_gpu, num_bundles=num_bundles, cpus_per_bundle=cpus_per_bundle)


def remove_placement(plan: PlacementPlan) -> None:
    remove_placement_group(plan.placement_group)
