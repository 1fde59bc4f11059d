"""The placement policy as a pure function: where trainers and engines go, and what share of a GPU they take."""

from __future__ import annotations

import pytest

from infir2_rl.actors.placement import ENGINE_GPU_SHARE, TRAINER_GPU_SHARE, plan_placement
from infir2_rl.config.components import PlacementConfig

GPUS_4 = {"CPU": 64.0, "GPU": 4.0}
CPU_ONLY = {"CPU": 2.0}


def test_cpu_machines_get_cpu_bundles_trainers_first() -> None:
    plan = plan_placement(PlacementConfig(), num_trainers=1, num_engines=1, cluster_resources=CPU_ONLY)
    assert not plan.use_gpu and not plan.colocate
    assert plan.bundles == ({"CPU": 1.0}, {"CPU": 1.0})
    assert plan.trainer.bundles == (0,) and plan.engine.bundles == (1,)
    assert (plan.trainer.gpus, plan.trainer.cpus, plan.engine.cpus) == (0, 1.0, 1.0)


def test_colocated_engines_share_the_trainer_gpus_and_shares_sum_to_one() -> None:
    plan = plan_placement(
        PlacementConfig(), num_trainers=4, num_engines=2, engine_gpus=2, cluster_resources=GPUS_4
    )
    assert plan.use_gpu and plan.colocate and len(plan.bundles) == 4
    assert all(b["GPU"] == 1.0 for b in plan.bundles)
    assert plan.trainer.bundles == (0, 1, 2, 3) and plan.engine.bundles == (
        0,
        2,
    )  # engine i at i x its TP size
    assert plan.trainer.gpus + plan.engine.gpus == pytest.approx(1.0)
    assert (plan.trainer.gpus, plan.engine.gpus) == (TRAINER_GPU_SHARE, ENGINE_GPU_SHARE)
    assert plan.trainer.cpus == plan.engine.cpus == 0  # GPU actors reserve no CPU of their bundle


def test_disaggregated_engines_get_bundles_of_their_tensor_parallel_size() -> None:
    cfg = PlacementConfig(mode="disaggregate")
    plan = plan_placement(cfg, num_trainers=2, num_engines=1, engine_gpus=2, cluster_resources=GPUS_4)
    assert not plan.colocate and [b["GPU"] for b in plan.bundles] == [1.0, 1.0, 2.0]
    assert plan.engine.bundles == (2,) and plan.engine.gpus == 2 and plan.trainer.gpus == 1.0


def test_an_sft_stage_on_gpus_is_not_colocated() -> None:
    plan = plan_placement(PlacementConfig(), num_trainers=2, cluster_resources=GPUS_4)
    assert plan.use_gpu and not plan.colocate and plan.trainer.gpus == 1.0 and plan.engine.bundles == ()


def test_refusals_name_the_setting_to_change() -> None:
    with pytest.raises(ValueError, match="use_gpu='yes': the Ray cluster has no GPUs"):
        plan_placement(PlacementConfig(use_gpu="yes"), num_trainers=1, cluster_resources=CPU_ONLY)
    plan = plan_placement(PlacementConfig(use_gpu="no"), num_trainers=1, cluster_resources=GPUS_4)
    assert not plan.use_gpu
    with pytest.raises(ValueError, match="rollout.num_engines=3 x rollout.tensor_parallel_size=2"):
        plan_placement(
            PlacementConfig(), num_trainers=4, num_engines=3, engine_gpus=2, cluster_resources=GPUS_4
        )
    with pytest.raises(ValueError, match="need 3 CPUs; the Ray cluster has 2"):
        plan_placement(PlacementConfig(), num_trainers=2, num_engines=1, cluster_resources=CPU_ONLY)
    with pytest.raises(ValueError, match="need 5 GPUs; the Ray cluster has 4"):
        cfg = PlacementConfig(mode="disaggregate")
        plan_placement(cfg, num_trainers=4, num_engines=1, cluster_resources=GPUS_4)
