"""INFIR2_PROFILE_TRAIN_STEP=N profiles optimizer step N of the torch trainer into INFIR2_PROFILE_DIR, and
only that step."""

from __future__ import annotations

from pathlib import Path

import pytest

from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.data.datasets import load_sft_examples
from infir2_rl.data.synthetic import make_data
from infir2_rl.models.factory import init_model
from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens, to_token_batch
from infir2_rl.trainers.torch.trainer import TorchTrainer


def test_the_named_step_is_profiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = init_model(tmp_path / "model", preset="tiny", num_hidden_layers=1)

    def new_trainer() -> TorchTrainer:
        config = ModelConfig(path=str(model))
        return TorchTrainer(
            config, TrainerConfig(), OptimizerConfig(), fp8=False, total_steps=3, device="cpu"
        )

    trainer = new_trainer()
    paths = make_data(tmp_path / "data", num_sft=8, num_rl=4, num_test=4)
    examples, _ = load_sft_examples(paths.sft_train, trainer.tokenizer)
    batch = to_token_batch(examples[:4], trainer.tokenizer.pad_token_id)
    monkeypatch.setenv("INFIR2_PROFILE_TRAIN_STEP", "2")
    monkeypatch.setenv("INFIR2_PROFILE_DIR", str(tmp_path / "prof"))
    for _ in range(3):
        trainer.train_step([batch], SftLossFn(), num_target_tokens(batch))
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == ["train_step2_rank0.txt"]
    text = (tmp_path / "prof" / "train_step2_rank0.txt").read_text()
    assert text.startswith("step 2, wall") and "aten::" in text
    # A second trainer profiling the same step into the same folder (bench/true_on_policy.py runs one per
    # mode) keeps the first one's file.
    second = new_trainer()
    for _ in range(2):
        second.train_step([batch], SftLossFn(), num_target_tokens(batch))
    names = sorted(p.name for p in (tmp_path / "prof").iterdir())
    assert names == ["train_step2_rank0.2.txt", "train_step2_rank0.txt"]
    assert (tmp_path / "prof" / "train_step2_rank0.txt").read_text() == text


def test_a_step_that_never_comes_is_refused_or_said(monkeypatch: pytest.MonkeyPatch) -> None:
    from infir2_rl.trainers.torch.trainer import profile_step_from_env

    monkeypatch.delenv("INFIR2_PROFILE_TRAIN_STEP", raising=False)
    assert profile_step_from_env() is None
    monkeypatch.setenv("INFIR2_PROFILE_TRAIN_STEP", " 3 ")
    assert profile_step_from_env() == 3
    for bad in ("0", "step3", "-1", "2.5"):
        monkeypatch.setenv("INFIR2_PROFILE_TRAIN_STEP", bad)
        with pytest.raises(ValueError, match="give the optimizer step to profile, 1 or more"):
            profile_step_from_env()
