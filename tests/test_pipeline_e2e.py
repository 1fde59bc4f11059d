"""The demo pipeline end to end on real Ray, shortened: SFT 1 -> SFT 2 -> FP8 cast -> RL -> RL.

What a user cares about: every stage hands on a checkpoint that loads, the cast directory is in the
SGLang/DeepSeek FP8 format, the RL stages log reward and mismatch every step with the unified-FP8 K3
under its threshold, and a finished pipeline run again does nothing (resume at stage level).
Learning itself (reward and accuracy rising) needs minutes of training and is measured by `infir2-rl demo`
(see the README), not in CI.
"""

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from infir2_rl.data.synthetic import make_data
from infir2_rl.metrics import names
from infir2_rl.models.factory import init_model
from infir2_rl.pipeline import DEMO_PIPELINE, run_pipeline

STAGES = ["sft_stage1", "sft_stage2", "cast_fp8", "rl_stage1", "rl_stage2"]
K3_UNIFIED_MAX = 1e-5  # see tests/test_rl_mismatch.py for the reasoning


def _read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_demo_pipeline_end_to_end(tmp_path: Path, ray_local: object) -> None:
    model_dir = init_model(tmp_path / "assets" / "tiny-model", preset="tiny", seed=0)
    data = make_data(tmp_path / "assets" / "data", seed=0, num_sft=256, num_rl=64, num_test=16)

    def relocate(cfg) -> None:  # type: ignore[no-untyped-def]
        names_ = {"sft_train.jsonl": data.sft_train, "sft_test.jsonl": data.sft_test}
        names_ |= {"rl_train.jsonl": data.rl_train, "rl_test.jsonl": data.rl_test}
        cfg.data.train_path = str(names_[Path(cfg.data.train_path).name])
        cfg.data.test_path = str(names_[Path(cfg.data.test_path).name])
        cfg.metrics.progress_bar = False
        cfg.placement.cpus_per_actor = 1
        if cfg.kind == "rl":
            cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 2, 4
            cfg.rollout.over_sampling_prompts, cfg.rollout.max_response_len = 2, 24
            cfg.trainer.global_batch_size = cfg.trainer.micro_batch_size = 8
            cfg.rollout.eval_every = 0

    run_dir = tmp_path / "run"
    outputs = run_pipeline(
        DEMO_PIPELINE,
        overrides=[f"run_dir={run_dir}"],
        stage_overrides=[f"model.path={model_dir}", "trainer.max_steps=2", "data.num_eval_examples=4"],
        adjust=relocate,
    )
    assert list(outputs) == STAGES
    for stage in ("sft_stage1", "sft_stage2", "rl_stage1", "rl_stage2"):
        final = outputs[stage]
        assert final == run_dir / stage / "final"
        model = AutoModelForCausalLM.from_pretrained(final, local_files_only=True)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert (run_dir / stage / "config.yaml").is_file()

    cast = json.loads((outputs["cast_fp8"] / "config.json").read_text())["quantization_config"]
    assert cast["quant_method"] == "fp8" and cast["weight_block_size"] == [128, 128] and cast["fmt"] == "e4m3"
    rl1 = (run_dir / "rl_stage1" / "config.yaml").read_text()
    assert f"fp8_checkpoint: {outputs['cast_fp8']}" in rl1  # engines started from the cast checkpoint

    for stage in ("rl_stage1", "rl_stage2"):
        steps = [m for m in _read_metrics(run_dir / stage / "metrics.jsonl") if m["step"] > 0]
        assert [m["step"] for m in steps] == [1, 2]
        for m in steps:
            assert 0.0 <= m[names.ROLLOUT_REWARD_MEAN] <= 1.0
            assert m[names.MISMATCH_K3] < K3_UNIFIED_MAX
            # The same samples scored by the trainer with FP8 off: the bf16_train_fp8_rollout gap.
            assert m[names.MISMATCH_DENSE_K3] > 10 * m[names.MISMATCH_K3], m
            assert m[names.MISMATCH_ABS_LOGP_DIFF_MEAN] < 1e-2
            assert m[names.WEIGHT_SYNC_PUSH_S] > 0
        assert names.EVAL_ACCURACY in steps[-1] and 0.0 <= steps[-1][names.EVAL_TRUNCATED_FRAC] <= 1.0
    assert "temperature: 1.0" in rl1  # the curriculum: stage 2 samples (and scores) at 1.1
    assert "temperature: 1.1" in (run_dir / "rl_stage2" / "config.yaml").read_text()

    # Everything finished: a second run skips every stage and hands back the same checkpoints.
    again = run_pipeline(DEMO_PIPELINE, overrides=[f"run_dir={run_dir}"], adjust=relocate)
    assert again == outputs
