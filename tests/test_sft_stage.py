"""The SFT stage end to end on a real local Ray: outputs, exact resume after a kill, nothing-to-do, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import infir2_rl.stages.sft as sft_module
from infir2_rl.config import SftStageConfig
from infir2_rl.data.synthetic import make_data
from infir2_rl.metrics import names
from infir2_rl.models.factory import init_model
from infir2_rl.stages.common import final_step
from infir2_rl.stages.sft import run_sft_stage


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sft")
    model = init_model(root / "model", preset="tiny", num_hidden_layers=2)
    make_data(root / "data", num_sft=48, num_rl=4, num_test=8)
    return model, root / "data"


def stage(assets: tuple[Path, Path], run_dir: Path, **sections: dict[str, Any]) -> SftStageConfig:
    model, data = assets
    base: dict[str, dict[str, Any]] = {
        "model": {"path": str(model)},
        "data": {"train_path": str(data / "sft_train.jsonl"), "test_path": str(data / "sft_test.jsonl")},
        "precision": "fp8",
        "trainer": {"global_batch_size": 8, "micro_batch_size": 2},  # 6 steps per epoch
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4},
        "checkpoint": {"save_every": 3, "keep_last": 1},
        "metrics": {"tensorboard": True, "ray_metrics": False, "progress_bar": False},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return SftStageConfig(name="sft_test", run_dir=str(run_dir), **base)


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.usefixtures("ray_local")
def test_sft_stage_writes_what_the_next_stage_and_the_user_need(
    assets: tuple[Path, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = run_sft_stage(stage(assets, tmp_path / "run"))
    run_dir = tmp_path / "run"
    assert result.final_checkpoint == run_dir / "final" and result.steps_run == result.last_step == 6
    model = AutoModelForCausalLM.from_pretrained(result.final_checkpoint, local_files_only=True)
    assert model.config.use_cache and AutoTokenizer.from_pretrained(result.final_checkpoint).eos_token
    assert SftStageConfig.model_validate(__import__("yaml").safe_load((run_dir / "config.yaml").read_text()))
    assert "step 6/6" in (run_dir / "logs" / "stage.log").read_text()
    assert any((run_dir / "tensorboard").iterdir())
    assert [c.name for c in (run_dir / "checkpoints").iterdir() if c.name.startswith("step_")] == [
        "step_000006"
    ]
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]  # step 0: the untrained model's eval
    assert set(rows[0]) == {"step", "time", names.EVAL_LOSS, names.EVAL_ACCURACY}
    assert rows[-1][names.EVAL_LOSS] < rows[0][names.EVAL_LOSS]
    rows = rows[1:]
    for name in (names.TRAIN_LOSS, names.TRAIN_GRAD_NORM, names.TRAIN_LR, names.PERF_TOKENS_PER_S,
                 names.PERF_STEP_TIME_S, names.PERF_PEAK_MEMORY_GB, names.TRAIN_SKIPPED_STEPS):  # fmt: skip
        assert all(name in r for r in rows), name
    assert rows[-1][names.TRAIN_LOSS] < rows[0][names.TRAIN_LOSS]
    assert names.EVAL_LOSS in rows[-1] and 0.0 <= rows[-1][names.EVAL_ACCURACY] <= 1.0
    assert result.summary[names.EVAL_LOSS] == rows[-1][names.EVAL_LOSS]


@pytest.mark.usefixtures("ray_local")
def test_eval_at_start_off_evaluates_only_the_trained_model(
    assets: tuple[Path, Path], tmp_path: Path
) -> None:
    run_sft_stage(stage(assets, tmp_path / "run", trainer={"max_steps": 1, "eval_at_start": False}))
    rows = records(tmp_path / "run")
    assert [r["step"] for r in rows] == [1] and names.EVAL_ACCURACY in rows[0]


class Killed(Exception):
    pass


@pytest.mark.usefixtures("ray_local")
def test_resume_after_a_kill_reproduces_the_uninterrupted_run_exactly(
    assets: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sections = {"trainer": {"num_workers": 2}, "data": {"test_path": None}}
    straight = run_sft_stage(stage(assets, tmp_path / "straight", **sections))

    # Kill the second run in the middle of step 4: trained, not yet logged or checkpointed.
    real_train_metrics = sft_module.train_metrics

    def dies_at_step_4(stats: Any, *args: Any) -> dict[str, float]:
        if stats.step == 4:
            raise Killed
        return real_train_metrics(stats, *args)

    monkeypatch.setattr(sft_module, "train_metrics", dies_at_step_4)
    resumed_dir = tmp_path / "resumed"
    with pytest.raises(Killed):
        run_sft_stage(stage(assets, resumed_dir, **sections))
    monkeypatch.setattr(sft_module, "train_metrics", real_train_metrics)
    # Debris of a later save that never finished must be ignored.
    (resumed_dir / "checkpoints" / ".tmp_step_000005" / "hf").mkdir(parents=True)
    (resumed_dir / "checkpoints" / "step_000009" / "hf").mkdir(parents=True)
    assert not (resumed_dir / "final").exists()

    result = run_sft_stage(stage(assets, resumed_dir, **sections))
    assert result.steps_run == 3 and result.last_step == 6
    want = {r["step"]: r for r in records(tmp_path / "straight")}
    got = {r["step"]: r for r in records(resumed_dir)}  # steps 1-3 from the killed run, 4-6 resumed
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):  # bit-identical on CPU
        for name in (names.TRAIN_LOSS, names.TRAIN_GRAD_NORM, names.TRAIN_LR):
            assert got[step][name] == want[step][name], (step, name)
    a = (straight.final_checkpoint / "model.safetensors").read_bytes()
    assert a == (result.final_checkpoint / "model.safetensors").read_bytes()

    # Run again: every step is done, so the stage says so and trains nothing.
    again = run_sft_stage(stage(assets, resumed_dir, **sections))
    assert again.nothing_to_do and again.steps_run == 0 and again.final_checkpoint == result.final_checkpoint
    assert len(records(resumed_dir)) == 6


@pytest.mark.usefixtures("ray_local")
def test_a_stage_stopped_before_its_export_hands_on_what_the_straight_run_did(
    assets: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # BF16 compute (the GPU default): final/ holds BF16 weights, the checkpoint's hf/ the FP32 masters. A stage
    # killed after its last checkpoint and before the export once handed on a copy of hf/, in FP32.
    sections = {"model": {"dtype": "bfloat16"}, "trainer": {"max_steps": 3}, "data": {"test_path": None}}
    result = run_sft_stage(stage(assets, tmp_path / "run", **sections))
    exported = (result.final_checkpoint / "model.safetensors").read_bytes()
    config = json.loads((result.final_checkpoint / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    shutil.rmtree(result.final_checkpoint)  # as if killed between the step-3 checkpoint and the export
    again = run_sft_stage(stage(assets, tmp_path / "run", **sections))
    assert again.nothing_to_do and again.steps_run == 0
    assert (again.final_checkpoint / "model.safetensors").read_bytes() == exported
    assert json.loads((again.final_checkpoint / "config.json").read_text()) == config
    assert final_step(tmp_path / "run") == 3

    # Extended to 5 steps and killed after the step-5 checkpoint, before its export: final/ still holds step 3,
    # which the rerun ("nothing to do") handed on as the stage's output before final_step said which step it is.
    def killed(write: Any, run_dir: Path, step: int) -> Path:
        raise Killed

    monkeypatch.setattr(sft_module, "publish_final", killed)
    longer = {**sections, "trainer": {"max_steps": 5}}
    with pytest.raises(Killed):
        run_sft_stage(stage(assets, tmp_path / "run", **longer))
    monkeypatch.undo()
    assert final_step(tmp_path / "run") == 3
    extended = run_sft_stage(stage(assets, tmp_path / "run", **longer))
    assert extended.nothing_to_do and final_step(tmp_path / "run") == 5
    assert (extended.final_checkpoint / "model.safetensors").read_bytes() != exported


def test_no_full_batch_fails_instead_of_training_nothing(assets: tuple[Path, Path], tmp_path: Path) -> None:
    # It once returned the untouched input model as the stage's output, and the pipeline recorded it finished.
    with pytest.raises(ValueError, match="fewer than one batch of trainer.global_batch_size=64"):
        run_sft_stage(stage(assets, tmp_path / "run", trainer={"global_batch_size": 64}))
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "final").exists()


def test_bad_input_fails_before_any_actor_starts(
    assets: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_actors(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("actors were started for a run that cannot succeed")

    monkeypatch.setattr(sft_module, "placed_trainer_group", no_actors)
    with pytest.raises(ValueError, match="data.train_path=.*no such file"):
        run_sft_stage(stage(assets, tmp_path / "a", data={"train_path": str(tmp_path / "missing.jsonl")}))
    with pytest.raises(ValueError, match="model.path=.*no such file"):
        run_sft_stage(stage(assets, tmp_path / "b", model={"path": str(tmp_path / "no-model")}))
    no_assistant = tmp_path / "users_only.jsonl"
    no_assistant.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="no usable SFT row"):
        run_sft_stage(stage(assets, tmp_path / "c", data={"train_path": str(no_assistant)}))


def test_the_eval_set_says_which_held_out_rows_it_leaves_out(
    assets: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rows without a final assistant answer or a boxed answer cannot score eval/accuracy: counted by cause in
    one line, not dropped silently."""
    from transformers import AutoTokenizer

    from infir2_rl.config.components import SftDataConfig
    from infir2_rl.stages.sft_eval import load_eval_set

    model, data = assets
    rows = [json.loads(line) for line in (data / "sft_test.jsonl").read_text().splitlines()][:3]
    rows[1]["messages"][-1]["content"] = "no box here"
    rows[2]["messages"] = rows[2]["messages"][:-1]  # ends with the user's turn
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("INFO"):
        eval_set = load_eval_set(SftDataConfig(test_path=str(test)), AutoTokenizer.from_pretrained(model))
    assert eval_set is not None and len(eval_set.prompts) == 1
    assert "rows left out: 1 no final assistant message, 1 no boxed answer" in caplog.text
