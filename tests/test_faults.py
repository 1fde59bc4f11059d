"""Faults a user meets, one test (or more) per numbered item of issue 16's "What fails today".

Each test makes the fault happen for real (a NaN in a checkpoint, a truncated file, a killed Ray actor, a
diverging learning rate) and asserts what the user sees: the exit code, the one line naming the cause and
the remedy, the log, and what is (not) left on disk. docs/reliability.md maps the items to these tests.
The Ray tests share one local cluster, one tiny model and one data set (module-scoped fixtures).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from safetensors.torch import save_file

import infir2_rl.stages.rl as rl_module
import infir2_rl.stages.sft as sft_module
from infir2_rl.actors.trainer_group import TrainerGroup
from infir2_rl.checkpoint import CheckpointManager, DataCursor, StageState, save_checkpoint
from infir2_rl.cli import main
from infir2_rl.config import RlStageConfig, SftStageConfig, dump_config, load_stage_config
from infir2_rl.data.datasets import load_prompt_examples
from infir2_rl.data.readers import read_records
from infir2_rl.data.scan import check_fills_batch, scan_prompt_rows
from infir2_rl.data.synthetic import make_data
from infir2_rl.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, describe
from infir2_rl.fp8.checkpoint import cast_checkpoint
from infir2_rl.fp8.quant import (
    dequantize_weight_blockwise,
    fake_quantize_tiles,
    quantize_activation,
    quantize_weight_blockwise,
)
from infir2_rl.models.factory import init_model
from infir2_rl.pipeline import REPO_ROOT
from infir2_rl.reward.math import MathReward
from infir2_rl.reward.protocol import score_batch
from infir2_rl.rollout.manager import RolloutManager
from infir2_rl.stages.rl import run_rl_stage
from infir2_rl.stages.sft import run_sft_stage

# ---------------------------------------------------------------- item 5: non-finite weights and blocks


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("pow2", [False, True])
def test_a_non_finite_block_dequantizes_to_nan_and_leaves_other_blocks_alone(bad: float, pow2: bool) -> None:
    w = torch.randn(256, 384) * 0.02
    w[5, 7] = bad  # block (0, 0)
    q, scale = quantize_weight_blockwise(w, pow2_scales=pow2)
    assert scale[0, 0].isnan()  # never scale 1 (the all-zero rule) nor inf
    assert torch.isfinite(scale.flatten()[1:]).all()
    back = dequantize_weight_blockwise(q, scale)
    assert back[:128, :128].isnan().all()  # the whole block says it is broken
    clean = w.clone()
    clean[5, 7] = 0.0
    ref = dequantize_weight_blockwise(*quantize_weight_blockwise(clean, pow2_scales=pow2))
    assert torch.equal(back[128:], ref[128:]) and torch.equal(back[:128, 128:], ref[:128, 128:])
    x = torch.randn(3, 256)
    x[1, 130] = bad
    xq, xs = quantize_activation(x, pow2_scales=pow2)
    assert xs[1, 1].isnan() and torch.isfinite(xs[0]).all() and xs[1, 0].isfinite()
    assert fake_quantize_tiles(x, dim=0, pow2_scales=pow2)[:, 130].isnan().all()


def _tiny_hf_model(path: Path, max_shard_size: str = "10GB") -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path, max_shard_size=max_shard_size)
    return path


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _cast_cli(src: Path, dst: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()  # what building the model printed
    code = main(["cast-fp8", "--input", str(src), "--output", str(dst), "--no-progress"])
    return code, capsys.readouterr().err.strip()


def test_cast_fp8_refuses_a_nan_weight_naming_the_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _tiny_hf_model(tmp_path / "bf16")
    shard = src / "model.safetensors"
    tensors = _tensors(shard)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, 4] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    code, err = _cast_cli(src, tmp_path / "fp8", capsys)
    assert code == EXIT_BAD_INPUT
    assert f"tensor {name} in {shard}: 1 NaN and 0 infinite values" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "fp8").exists() and not list(tmp_path.glob(".fp8.partial-*"))


def test_cast_fp8_checks_the_index_against_the_shards(tmp_path: Path) -> None:
    src = _tiny_hf_model(tmp_path / "bf16", max_shard_size="200KB")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name, shard = sorted(index["weight_map"].items())[0]
    # An index missing a tensor's entry.
    missing = {**index, "weight_map": {k: v for k, v in index["weight_map"].items() if k != name}}
    index_path.write_text(json.dumps(missing))
    with pytest.raises(ValueError, match=f"{name} in {shard} is missing from the index"):
        cast_checkpoint(src, tmp_path / "a", progress=False, device="cpu")
    # An index naming a tensor its shard lacks.
    extra = {**index, "weight_map": {**index["weight_map"], "model.layers.9.mlp.up_proj.weight": shard}}
    index_path.write_text(json.dumps(extra))
    with pytest.raises(
        ValueError, match=f"model.layers.9.mlp.up_proj.weight is mapped to {shard}, which lacks it"
    ):
        cast_checkpoint(src, tmp_path / "b", progress=False, device="cpu")
    index_path.write_text(json.dumps(index))
    # A truncated shard is named by file, not a bare SafetensorError.
    data = (src / shard).read_bytes()
    (src / shard).write_bytes(data[: len(data) // 2])
    with pytest.raises(
        ValueError, match=f"{src / shard}: unreadable safetensors shard.*truncated or corrupt"
    ):
        cast_checkpoint(src, tmp_path / "c", progress=False, device="cpu")
    assert not any((tmp_path / d).exists() for d in "abc")


# ---------------------------------------------------------------- item 4: checkpoints


class _Trainer:
    """Writes what a trainer group writes; `fail` raises the OSError a full disk gives, half-way."""

    def __init__(self, fail: OSError | None = None) -> None:
        self.fail = fail

    def save(self, directory: Path) -> None:
        (directory / "hf").mkdir()
        save_file({"w": torch.arange(1000.0)}, str(directory / "hf" / "model.safetensors"))
        if self.fail is not None:
            raise self.fail
        (directory / "train_state").mkdir()
        torch.save({"step": 1}, directory / "train_state" / "rank_0.pt")


def _state(step: int) -> StageState:
    return StageState(step=step, cursor=DataCursor(epoch=0, position=step), num_examples=10)


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = CheckpointManager(tmp_path, keep_last=3)
    save_checkpoint(_Trainer(), manager, _state(2))
    newest = save_checkpoint(_Trainer(), manager, _state(4))
    weights = newest.hf_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # the tail lost after the save
    with caplog.at_level(logging.WARNING):
        chosen = manager.latest()
    assert chosen is not None and chosen.step == 2
    assert f"checkpoint {newest.path} is damaged (hf/model.safetensors has" in caplog.text
    assert "moved aside to damaged_step_000004; resuming from the previous complete one" in caplog.text
    assert not newest.path.exists() and (tmp_path / "damaged_step_000004" / "hf").is_dir()  # kept for a look
    # A truncated optimizer state (torch.save zip) without a manifest (an older checkpoint) is caught too.
    newest = save_checkpoint(_Trainer(), manager, _state(4))
    (newest.path / "MANIFEST.json").unlink()
    state_file = newest.path / "train_state" / "rank_0.pt"
    state_file.write_bytes(state_file.read_bytes()[:-30])
    assert manager.latest().step == 2  # type: ignore[union-attr]
    assert (tmp_path / "damaged_step_000004.2").is_dir()


def test_saves_after_a_damaged_newest_checkpoint_are_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The only checkpoint, step 6, is damaged: the stage starts over at step 0. Its saves of steps 3, 6, ... must
    stay. Before, keep-last counted the damaged step 6 as the newest and deleted each new save at once (with
    `latest` pointing at it), so a later resume found nothing but the damaged one and started over again."""
    manager = CheckpointManager(tmp_path, keep_last=1)
    damaged = save_checkpoint(_Trainer(), manager, _state(6))
    (damaged.hf_dir / "model.safetensors").write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        assert manager.latest() is None
    assert "no complete one is left: starting at step 0" in caplog.text
    saved = save_checkpoint(_Trainer(), manager, _state(3))
    assert saved.path.is_dir() and manager.latest() == saved
    assert [c.step for c in manager.complete()] == [3]


def _tensors_bytes() -> bytes:
    from safetensors.torch import save

    return save({"w": torch.arange(1000.0)})


def test_a_failed_save_leaves_no_partial_directory_and_reads_as_one_line(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    good = save_checkpoint(_Trainer(), manager, _state(1))
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / ".tmp_step_000002" / "x"))
    with pytest.raises(OSError) as caught:
        save_checkpoint(_Trainer(fail=full), manager, _state(2))
    assert not list(tmp_path.glob(".tmp_*")) and manager.latest() == good
    code, line = describe(caught.value)
    assert code == EXIT_FAILED and line.startswith("disk full writing") and "resume" in line
    read_only = PermissionError(errno.EACCES, "Permission denied", "/runs/x/config.yaml")
    assert describe(read_only) == (
        EXIT_BAD_INPUT,
        "cannot write /runs/x/config.yaml (Permission denied): make the run directory writable or set run_dir="
        " to one that is",
    )
    assert describe(KeyboardInterrupt())[0] == EXIT_INTERRUPTED


# ---------------------------------------------------------------- item 8: data problems


def test_labels_are_strings_and_encoding_errors_are_counted(tmp_path: Path) -> None:
    from infir2_rl.models.tokenizer import build_tokenizer

    rows = [
        {"prompt": "What is 9+10?", "label": ["19"]},  # one-element list: its element
        {"prompt": "What is 2+2?", "label": 4},  # a number as written
        {"prompt": "What is 1+1?", "label": {"answer": "2"}},  # not a label
        {"prompt": "Two answers?", "label": ["1", "2"]},  # not one label
    ]
    path = tmp_path / "rl.jsonl"
    lines = [json.dumps(r).encode() for r in rows] + [b'{"prompt": "caf\xe9 au lait?", "label": "3"}']
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert [r.reason for r in read_records(path) if r.data is None] == ["bad_encoding"]
    examples, report = load_prompt_examples(path, build_tokenizer())
    assert [e.label for e in examples] == ["19", "4"]
    assert (report.bad_format, report.bad_encoding, report.num_kept, report.num_rows) == (2, 1, 2, 5)
    assert any("row 5: bad_encoding: not UTF-8 (byte e9 at column" in line for line in report.examples)
    scanned = scan_prompt_rows(path)  # the same verdicts without a tokenizer, before Ray starts
    assert (scanned.num_kept, scanned.bad_format, scanned.bad_encoding) == (2, 2, 1)
    with pytest.raises(
        ValueError, match=r"2 rows that can be used .* fewer than one batch of rollout.prompts_per_step=4"
    ):
        check_fills_batch(scanned, 4, "rollout.prompts_per_step")


# ---------------------------------------------------------------- item 9: rewards in parallel


def test_pathological_answers_cost_about_one_deadline_per_worker() -> None:
    deadline, workers, num_bad = 2.0, 2, 2
    reward = MathReward(timeout_s=deadline, num_workers=workers)
    tower = "<think>x</think>\\boxed{9^{9^{9^{9}}}}"  # math-verify never returns on this one
    fine = "<think>x</think>\\boxed{5}"
    try:
        assert score_batch(reward, [fine] * workers, ["5"] * workers) == [1.0] * workers  # start the children
        start = time.perf_counter()
        scores = score_batch(reward, [tower] * num_bad + [fine] * 16, ["5"] * (num_bad + 16))
        elapsed = time.perf_counter() - start
    finally:
        reward.close()
    assert scores == [0.0] * num_bad + [1.0] * 16
    assert reward.stats.num_timeouts == num_bad
    # One at a time this batch takes at least num_bad x deadline = 4 s; in parallel about one deadline (the
    # fine answers go to the spare children while the killed ones restart).
    assert elapsed < 0.75 * num_bad * deadline, elapsed


# ---------------------------------------------------------------- stage-level faults on a real local Ray
# One Ray cluster, one tiny model and one data set for all of them; each stage runs a few steps.


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("faults")
    model = init_model(root / "model", preset="tiny", num_hidden_layers=2)
    make_data(root / "data", num_sft=24, num_rl=16, num_test=4)
    return model, root / "data"


TWO_RANKS: dict[str, Any] = {"num_workers": 2, "max_steps": 3}


@pytest.fixture(scope="module")
def sft_straight(
    assets: tuple[Path, Path], ray_local: None, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """One uninterrupted 3-step SFT run on two trainer ranks (checkpoints at steps 2 and 3), shared."""
    run_dir = tmp_path_factory.mktemp("straight") / "sft"
    run_sft_stage(_sft(assets, run_dir, trainer=TWO_RANKS))
    return run_dir


def _sft(assets: tuple[Path, Path], run_dir: Path, **sections: dict[str, Any]) -> SftStageConfig:
    model, data = assets
    base: dict[str, dict[str, Any]] = {
        "model": {"path": str(model)},
        "data": {"train_path": str(data / "sft_train.jsonl"), "test_path": None},
        "trainer": {"global_batch_size": 8, "micro_batch_size": 4, "max_steps": 3},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4},
        "checkpoint": {"save_every": 1, "keep_last": 2},
        "metrics": {"tensorboard": False, "ray_metrics": False, "progress_bar": False},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return SftStageConfig(name="sft_faults", run_dir=str(run_dir), **base)


def _rl(assets: tuple[Path, Path], run_dir: Path, *overrides: str) -> RlStageConfig:
    model, data = assets
    cfg = load_stage_config(
        REPO_ROOT / "configs" / "demo" / "rl_stage1.yaml",
        [
            f"model.path={model}",
            f"data.train_path={data / 'rl_train.jsonl'}",
            "data.test_path=null",
            f"run_dir={run_dir}",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=4",
            "rollout.over_sampling_prompts=3",
            "rollout.max_response_len=16",
            "rollout.num_steps=2",
            "trainer.global_batch_size=8",
            "trainer.micro_batch_size=8",
            "checkpoint.save_every=1",
            "metrics.progress_bar=false",
            "metrics.tensorboard=false",
            "metrics.ray_metrics=false",
            "placement.cpus_per_actor=1",
            *overrides,
        ],
    )
    assert isinstance(cfg, RlStageConfig)
    return cfg


def _run_cli(cfg: SftStageConfig | RlStageConfig, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`infir2-rl run CONFIG` on a resolved config; returns (exit code, last stderr line)."""
    path = Path(cfg.run_dir).parent / f"{Path(cfg.run_dir).name}.yaml"
    path.write_text(dump_config(cfg))
    capsys.readouterr()
    code = main(["run", str(path)])
    lines = capsys.readouterr().err.strip().splitlines()
    return code, lines[-1] if lines else ""


def _metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r for r in rows}


def _no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> None:
        raise AssertionError("Ray was started for a run that cannot succeed")

    monkeypatch.setattr(sft_module, "ensure_ray", refuse)
    monkeypatch.setattr(rl_module, "ensure_ray", refuse)


# item 1 (a stage that trained nothing), item 7 (empty paths), item 8 (data checked before Ray)
def test_input_that_cannot_train_fails_before_ray_with_one_line(
    assets: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _no_ray(monkeypatch)
    code, line = _run_cli(_sft(assets, tmp_path / "few", trainer={"global_batch_size": 64}), capsys)
    assert code == EXIT_BAD_INPUT
    assert "fewer than one batch of trainer.global_batch_size=64: the stage would train nothing" in line
    assert not (tmp_path / "few" / "final").exists()
    stage_yaml = tmp_path / "ok.yaml"
    stage_yaml.write_text(dump_config(_sft(assets, tmp_path / "ok")))
    for override, field in (
        ("run_dir=", "run_dir"),
        ("model.path=", "model.path"),
        ("data.train_path=", "data.train_path"),
    ):
        assert main(["run", str(stage_yaml), override]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{field}=''" in err[0] and "empty" in err[0], err
    bad = tmp_path / "labels.jsonl"
    bad.write_text("".join(json.dumps({"prompt": "1+1?", "label": {"x": 2}}) + "\n" for _ in range(4)))
    code, line = _run_cli(_rl(assets, tmp_path / "rl_bad", f"data.train_path={bad}"), capsys)
    assert code == EXIT_BAD_INPUT and "no usable prompt row out of 4 (skipped: bad_format=4)" in line
    code, line = _run_cli(_rl(assets, tmp_path / "rl_reward", "rollout.reward=no_such_reward"), capsys)
    assert code == EXIT_BAD_INPUT and "rollout.reward='no_such_reward': not a built-in" in line


# item 2: resume with changed settings; item 3: a dead trainer worker; item 5: non-finite steps in a row
def test_resume_refuses_a_changed_trajectory_and_records_each_segment(
    assets: tuple[Path, Path], sft_straight: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "sft"
    shutil.copytree(sft_straight, run_dir)  # trained 3 steps with lr 3e-3, cosine
    longer = {**TWO_RANKS, "max_steps": 4, "epochs": 2}  # the stage length may change on resume
    changed = _sft(assets, run_dir, trainer=longer, optimizer={"lr": 1e-2, "schedule": "constant"})
    code, line = _run_cli(changed, capsys)
    assert code == EXIT_BAD_INPUT
    assert "optimizer.lr: 0.003 -> 0.01; optimizer.schedule: 'cosine' -> 'constant'" in line
    assert "checkpoint.allow_config_change=true" in line
    assert "lr: 0.003" in (run_dir / "config.yaml").read_text()  # not rewritten by the refused run
    assert "stage failed: resume of" in (run_dir / "logs" / "stage.log").read_text().splitlines()[-1]
    allowed = _sft(
        assets,
        run_dir,
        trainer=longer,
        optimizer={"lr": 1e-2, "schedule": "constant"},
        checkpoint={"allow_config_change": True},
    )
    assert run_sft_stage(allowed).steps_run == 1
    segments = sorted((run_dir / "config_segments").glob("segment_*.yaml"))
    assert [("lr: 0.003" in s.read_text(), "lr: 0.01" in s.read_text()) for s in segments] == [
        (True, False),
        (False, True),
    ]
    assert _metrics(run_dir)[4]["train/lr"] == 1e-2  # the new settings took effect (they were ignored before)


def test_a_killed_trainer_worker_fails_fast_with_its_cause_and_the_rerun_resumes_exactly(
    assets: tuple[Path, Path],
    sft_straight: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    sections: dict[str, dict[str, Any]] = {"trainer": TWO_RANKS}
    real_step = TrainerGroup.train_step
    calls = {"n": 0}

    def kill_rank_1_at_step_3(group: TrainerGroup, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            pid = ray.get(group.workers[1].__ray_call__.remote(lambda w: os.getpid()))
            os.kill(pid, signal.SIGKILL)  # a crash, not an exception: the process is gone
        return real_step(group, *args, **kwargs)

    monkeypatch.setattr(TrainerGroup, "train_step", kill_rank_1_at_step_3)
    run_dir = tmp_path / "killed"
    start = time.perf_counter()
    code, line = _run_cli(_sft(assets, run_dir, **sections), capsys)
    assert code == EXIT_FAILED and time.perf_counter() - start < 120
    assert "TrainerWorker" in line and "died" in line and "rerun the same command to resume" in line
    assert (
        line.split("error: ", 1)[1].split(" (run with -v")[0] in (run_dir / "logs" / "stage.log").read_text()
    )
    assert not (run_dir / "final").exists()
    monkeypatch.setattr(TrainerGroup, "train_step", real_step)
    resumed = run_sft_stage(_sft(assets, run_dir, **sections))
    assert resumed.steps_run == 1
    want, got = _metrics(sft_straight), _metrics(run_dir)
    assert (
        got[3]["train/loss"] == want[3]["train/loss"]
        and got[3]["train/grad_norm"] == want[3]["train/grad_norm"]
    )
    a = (sft_straight / "final" / "model.safetensors").read_bytes()
    assert a == (resumed.final_checkpoint / "model.safetensors").read_bytes()


def test_diverged_steps_in_a_row_stop_the_stage_without_publishing(
    assets: tuple[Path, Path], tmp_path: Path, ray_local: None, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "diverged"
    cfg = _sft(
        assets,
        run_dir,
        optimizer={"lr": 1e30},
        trainer={"max_steps": 6, "epochs": 2},
        checkpoint={"save_every": 0},
    )
    code, line = _run_cli(cfg, capsys)
    assert code == EXIT_FAILED
    assert (
        "3 steps in a row" in line and "non-finite gradient norm" in line and "nothing was published" in line
    )
    assert not (run_dir / "final").exists()
    assert max(_metrics(run_dir)) < 6  # stopped early
    huge = tmp_path / "huge.yaml"
    huge.write_text(dump_config(_sft(assets, tmp_path / "huge")))
    assert main(["run", str(huge), "optimizer.lr=1e39"]) == EXIT_BAD_INPUT
    assert "optimizer.lr=1e+39: not a float32 number" in capsys.readouterr().err


# item 3: a rollout engine killed mid-step is replaced and the stage completes
def test_a_killed_rollout_engine_is_replaced_and_the_stage_completes_as_if_undisturbed(
    assets: tuple[Path, Path], tmp_path: Path, ray_local: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    straight_dir = tmp_path / "straight"
    # A reward with spread in nearly every group of the untrained model's text (response < label in string
    # order; the math reward is 0 everywhere, so every gradient would be 0 and any two runs compare equal).
    spread = "rollout.reward=operator:lt"
    run_rl_stage(_rl(assets, straight_dir, spread))
    real_generate = RolloutManager.generate
    calls = {"n": 0}

    def kill_engine_in_step_2(manager: RolloutManager, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # step 2's rollout; the retry is call 3
            pid = ray.get(manager.engines[0].__ray_call__.remote(lambda e: os.getpid()))
            os.kill(pid, signal.SIGKILL)  # a crash: the generate call below meets a dead process
        return real_generate(manager, *args, **kwargs)

    monkeypatch.setattr(RolloutManager, "generate", kill_engine_in_step_2)
    run_dir = tmp_path / "killed"
    result = run_rl_stage(_rl(assets, run_dir, spread))
    assert result.steps_run == 2 and (run_dir / "final").is_dir()
    got, want = _metrics(run_dir), _metrics(straight_dir)
    assert all(want[step]["train/grad_norm"] > 0 for step in (1, 2))  # the comparison below has content
    assert got[2]["rollout/engine_restarts"] == 1 and got[2]["rollout/step_retries"] == 1
    assert got[1]["rollout/engine_restarts"] == 0
    for step in (
        1,
        2,
    ):  # the retried step drew the same prompts and seeds, from an engine with the same weights
        for key in (
            "rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/grad_norm", "mismatch/k3"
        ):  # fmt: skip
            assert got[step][key] == want[step][key], (step, key)
    final = (straight_dir / "final" / "model.safetensors").read_bytes()
    assert (run_dir / "final" / "model.safetensors").read_bytes() == final
    assert "replaced rollout engine(s) [0]" in (run_dir / "logs" / "stage.log").read_text()
