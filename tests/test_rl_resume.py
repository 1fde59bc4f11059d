"""RL resume: a stage stopped after step k and resumed logs the same steps k+1..n as an uninterrupted run.

What must survive the stop: trainer weights and optimizer state, the prompt order position, the engines'
request counter (it seeds sampling), and the weight version pushed to the engines. Metrics are compared
exactly (CPU, fixed thread counts and seeds).
"""

import json
from pathlib import Path

import pytest

from infir2_rl.config import RlStageConfig, load_stage_config
from infir2_rl.data.synthetic import make_data
from infir2_rl.metrics import names
from infir2_rl.models.factory import init_model
from infir2_rl.pipeline import REPO_ROOT
from infir2_rl.stages.rl import run_rl_stage

COMPARED = (
    names.ROLLOUT_REWARD_MEAN,
    names.ROLLOUT_RESPONSE_LEN_MEAN,
    names.TRAIN_LOSS,
    names.TRAIN_GRAD_NORM,
    names.MISMATCH_K3,  # the engine's log-probs against the trainer's: both sides' weights and samples
    names.MISMATCH_ABS_LOGP_DIFF_MEAN,
)


def _rl_config(model: Path, train_path: Path, run_dir: Path, *overrides: str) -> RlStageConfig:
    """The demo's RL stage 1 shrunk to seconds: 2 prompts x 4 samples, no held-out eval, no progress bar."""
    cfg = load_stage_config(
        REPO_ROOT / "configs" / "demo" / "rl_stage1.yaml",
        [
            f"model.path={model}",
            f"data.train_path={train_path}",
            "data.test_path=null",
            f"run_dir={run_dir}",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=4",
            "metrics.progress_bar=false",
            "placement.cpus_per_actor=1",
            *overrides,
        ],
    )
    assert isinstance(cfg, RlStageConfig)
    return cfg


def _steps(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r for r in rows if r["step"] > 0}


def test_rl_resume_is_exact(tmp_path: Path, ray_local: object) -> None:
    model = init_model(tmp_path / "tiny", preset="tiny", seed=0)
    data = make_data(tmp_path / "data", seed=0, num_sft=8, num_rl=64, num_test=8)
    common = [
        # An untrained model never solves a problem, so the math reward is 0 everywhere and every gradient
        # zero: a resume that lost the weights or the optimizer state would still compare equal. "The response
        # sorts before the label" (string order) is a reward with spread in nearly every group of random text.
        "rollout.reward=operator:lt",
        "rollout.over_sampling_prompts=3",
        "rollout.max_response_len=16",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=8",
        "optimizer.lr=1e-3",
        "checkpoint.save_every=1",
    ]
    run_rl_stage(_rl_config(model, data.rl_train, tmp_path / "straight", *common, "rollout.num_steps=3"))

    resumed_dir = tmp_path / "resumed"
    run_rl_stage(_rl_config(model, data.rl_train, resumed_dir, *common, "rollout.num_steps=2"))
    result = run_rl_stage(_rl_config(model, data.rl_train, resumed_dir, *common, "rollout.num_steps=3"))
    assert result.steps_run == 1 and result.last_step == 3

    a, b = _steps(tmp_path / "straight"), _steps(resumed_dir)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert all(a[step][names.TRAIN_GRAD_NORM] > 0 for step in (1, 2, 3))  # the comparison has content
    for step in (1, 2, 3):
        assert {k: a[step][k] for k in COMPARED} == {k: b[step][k] for k in COMPARED}, step
    final = (tmp_path / "straight" / "final" / "model.safetensors").read_bytes()
    assert final == (resumed_dir / "final" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("mode", ["bf16", "bf16_train_fp8_rollout"])
def test_rl_stage_runs_in_the_other_precision_modes(mode: str, tmp_path: Path, ray_local: object) -> None:
    """The comparison modes run end to end on Ray (bf16 once failed its first push: FP8 bytes to a BF16 engine)."""
    model = init_model(tmp_path / "tiny", preset="tiny", seed=0)
    data = make_data(tmp_path / "data", seed=0, num_sft=8, num_rl=32, num_test=8)
    cfg = _rl_config(
        model,
        data.rl_train,
        tmp_path / mode,
        f"precision={mode}",
        "rollout.over_sampling_prompts=2",
        "rollout.max_response_len=12",
        "rollout.num_steps=2",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=8",
    )
    assert cfg.train_fp8 is False and cfg.rollout_fp8 is (mode != "bf16")
    result = run_rl_stage(cfg)
    assert result.last_step == 2
    steps = _steps(tmp_path / mode)
    for m in steps.values():
        # FP32 CPU trainer against a FP32 (bf16 mode) or FP8 engine: tiny vs clearly nonzero mismatch.
        if mode == "bf16":
            assert m[names.MISMATCH_K3] < 1e-6, m
        else:
            assert m[names.MISMATCH_K3] > 1e-7, m
        assert names.MISMATCH_DENSE_K3 not in m  # only measured when the trainer runs FP8
        # One update per rollout: its old log-probs (and the mismatch's trainer side) come from its own forward,
        # with no scoring pass before it, and its ratio to the old policy is exactly 1.
        assert m["train/updates_per_rollout"] == 1.0 and "time/old_logprobs_s" not in m, m
        assert m[names.TRAIN_RATIO_MEAN] == 1.0 and m[names.TRAIN_PG_CLIP_FRAC] == 0.0, m
        # Each phase's memory (CPU: the engine's and the trainer's RSS high-water marks, nothing reserved).
        for phase in ("rollout", "score", "train", "sync"):
            assert m[f"memory/{phase}_peak_gb"] > 0.01 and m[f"memory/{phase}_reserved_gb"] == 0.0, m


def test_rl_mini_batches_take_several_optimizer_steps_per_rollout(tmp_path: Path, ray_local: object) -> None:
    model = init_model(tmp_path / "tiny", preset="tiny", seed=0)
    data = make_data(tmp_path / "data", seed=0, num_sft=8, num_rl=32, num_test=8)
    cfg = _rl_config(
        model,
        data.rl_train,
        tmp_path / "mb",
        # An untrained model never solves a problem; "the label appears in the response" gives groups
        # with reward spread, so the policy gradient is not zero.
        "rollout.reward=operator:contains",
        "rollout.over_sampling_prompts=4",
        "rollout.max_response_len=32",
        "rollout.num_steps=2",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=4",
        "optimizer.lr=1e-2",
        "metrics.dense_trainer_mismatch=false",
    )
    assert cfg.updates_per_rollout == 2
    run_rl_stage(cfg)
    steps = _steps(tmp_path / "mb")
    assert [steps[s]["train/updates_per_rollout"] for s in (1, 2)] == [2.0, 2.0]
    # Only the second mini-batch's rows are scored before the first update (the first scores itself).
    assert all(steps[s]["time/old_logprobs_s"] > 0 for s in (1, 2))
    # The second mini-batch is trained after the first update: its ratio to the old policy is off 1, which
    # the first (on-policy) one never is; with lr 1e-2 the PPO clip engages on some tokens.
    assert max(steps[s]["train/pg_clip_frac"] for s in (1, 2)) > 0


def test_kl_and_entropy_terms_run_and_are_logged(tmp_path: Path, ray_local: object) -> None:
    """algorithm.kl_coef > 0 builds the reference model and logs train/kl (0 while the policy is still the
    reference, > 0 after an update); entropy_coef > 0 logs train/entropy of the tempered distribution."""
    model = init_model(tmp_path / "tiny", preset="tiny", seed=0)
    data = make_data(tmp_path / "data", seed=0, num_sft=8, num_rl=32, num_test=8)
    cfg = _rl_config(
        model,
        data.rl_train,
        tmp_path / "kl",
        "algorithm.kl_coef=0.05",
        "algorithm.kl_type=low_var_kl",
        "algorithm.entropy_coef=0.01",
        "rollout.over_sampling_prompts=2",
        "rollout.max_response_len=12",
        "rollout.num_steps=2",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=8",
        "optimizer.lr=1e-3",
    )
    assert run_rl_stage(cfg).last_step == 2
    steps = _steps(tmp_path / "kl")
    for step in (1, 2):
        assert names.TRAIN_KL in steps[step] and steps[step][names.TRAIN_ENTROPY] > 0, steps[step]
        assert steps[step]["time/ref_logprobs_s"] > 0
    assert abs(steps[1][names.TRAIN_KL]) < 1e-6  # one update per step: step 1 trains the reference itself
    assert steps[2][names.TRAIN_KL] > 1e-7


def test_a_model_with_dropout_is_refused_before_the_first_rollout(tmp_path: Path, ray_local: object) -> None:
    """The first update's old log-probs come from its training forward, which dropout would perturb: one line at
    start (TrainerGroup), no step run."""
    model = init_model(tmp_path / "tiny", preset="tiny", seed=0, attention_dropout=0.1)
    data = make_data(tmp_path / "data", seed=0, num_sft=8, num_rl=16, num_test=8)
    run_dir = tmp_path / "dropout"
    cfg = _rl_config(
        model,
        data.rl_train,
        run_dir,
        "rollout.num_steps=1",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=8",
    )
    with pytest.raises(ValueError, match=r"drops activations in training \(config.attention_dropout=0.1\)"):
        run_rl_stage(cfg)
    assert not (run_dir / "metrics.jsonl").exists() or not _steps(run_dir)
