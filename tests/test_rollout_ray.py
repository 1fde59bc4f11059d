"""Real Ray: an engine actor from create_engines, the rollout manager over it, and a weight push through the object store."""

import pytest
import torch

from infir2_rl.actors.placement import reserve_for
from infir2_rl.actors.rollout_engine import RolloutEngine, create_engines
from infir2_rl.config.stage import RlStageConfig
from infir2_rl.fp8.checkpoint import fp8_state_from_model
from infir2_rl.fp8.linear import swap_to_fp8_training
from infir2_rl.models.factory import init_model, load_model
from infir2_rl.rollout.manager import RolloutManager
from infir2_rl.rollout.prompts import PromptSource
from infir2_rl.weight_sync.service import WeightSyncService, same_bytes

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> RlStageConfig:
    model_dir = init_model(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0)
    return RlStageConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "rollout": {
                "prompts_per_step": 2,
                "n_samples_per_prompt": 2,
                "over_sampling_prompts": 3,
                "max_sampling_rounds": 2,
                "max_response_len": 6,
                "num_engines": 1,
            },
            "placement": {"use_gpu": "no", "cpus_per_actor": 1},
            "trainer": {"micro_batch_size": 2},
        }
    )


def _length_parity(response: str, label: str) -> float:
    return float(len(response) % 2 == int(label))


def test_manager_and_weight_sync_over_a_ray_engine_actor(ray_local: None, cfg: RlStageConfig) -> None:
    placement = reserve_for(cfg.placement, num_trainers=0, num_engines=1)
    engines = create_engines(cfg, placement)
    assert len(engines) == 1 and cfg.rollout_fp8
    _, tokenizer = load_model(cfg.model.path)
    prompts = [
        type("P", (), {"prompt_ids": tokenizer(f"{a} + {a} =")["input_ids"], "label": str(a % 2)})()
        for a in range(6)
    ]
    manager = RolloutManager(
        engines, cfg.rollout, _length_parity, tokenizer, [tokenizer.eos_token_id], seed=0
    )
    batch = manager.generate(PromptSource(prompts, seed=0))
    assert batch.num_samples == 4 and batch.group_size == 2
    assert all(
        1 <= len(s.response_ids) <= 6 and len(s.logprobs) == len(s.response_ids) for s in batch.samples
    )
    assert all(lp <= 0 for s in batch.samples for lp in s.logprobs)

    trainer, _ = load_model(cfg.model.path, dtype=torch.float32)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.01)
    swap_to_fp8_training(trainer)
    state = list(fp8_state_from_model(trainer))
    service = WeightSyncService(engines, cfg.weight_sync)
    stats = service.push(iter(state), version=1)
    assert stats.num_checked > 0 and stats.bytes > 0
    stats2 = service.push(iter(state), version=2)  # the next version, checked on the next layers
    assert stats2.num_checked > 0
    health = ray.get(engines[0].health.remote())
    assert health.weight_version == 2 and health.fp8
    name = "model.layers.0.mlp.up_proj.weight"
    held = ray.get(engines[0].read_weights.remote([name]))[name]
    assert same_bytes(dict(state)[name], held)
    assert manager.generate(PromptSource(prompts, seed=1)).num_samples == 4
    # Every generate on the one thread of its concurrency group (a default-group thread would vary).
    assert ray.get(engines[0].generate_thread_count.remote()) == 1
    assert ray.get(engines[0].graph_capture_s.remote()) is None  # CPU: no graphs, no rollout/graph_capture_s


def test_engine_actor_class_runs_without_ray(cfg: RlStageConfig) -> None:
    engine = RolloutEngine(cfg.rollout, cfg.model.path, fp8=cfg.rollout_fp8, device="cpu")
    assert engine.health().fp8 and engine.health().weight_version == 0


def test_more_engines_than_the_placement_has_slots_for_are_refused(
    ray_local: None, cfg: RlStageConfig
) -> None:
    placement = reserve_for(cfg.placement, num_trainers=0, num_engines=1)
    try:
        with pytest.raises(ValueError, match="rollout.num_engines=2: the placement plan has 1 engine slots"):
            create_engines(
                cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"num_engines": 2})}),
                placement,
            )
    finally:
        placement.remove()


def test_abort_reaches_an_engine_actor_while_its_generate_runs(ray_local: None, cfg: RlStageConfig) -> None:
    """``abort`` runs in the actor's default group while ``generate`` holds its own group's thread."""
    import time

    from infir2_rl.types import GenerateRequest, SamplingParams

    placement = reserve_for(cfg.placement, num_trainers=0, num_engines=1)
    (engine,) = create_engines(cfg, placement)
    params = SamplingParams(temperature=1.0, max_new_tokens=1000, stop_token_ids=[])
    running = engine.generate.remote([GenerateRequest("long", [5, 6, 7], 2, params, seed=0)])
    while not ray.wait([running], timeout=0.05)[
        0
    ]:  # aborts that land before the run starts are cleared by it
        ray.get(engine.abort.remote())
        time.sleep(0.05)
    samples = ray.get(running)
    assert [s.finish_reason for s in samples] == ["abort", "abort"]
    assert all(len(s.response_ids) < 1000 for s in samples)
