"""TorchTrainer with packed micro-batches (trainer.pack_sequences) gives the padded trainer's loss, gradient
norm, updated weights and log-probs (CPU, FP32, FP8 emulated)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.data.datasets import load_sft_examples
from infir2_rl.data.synthetic import make_data
from infir2_rl.models.factory import init_model
from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens, to_token_batch
from infir2_rl.trainers.microbatch import micro_batches
from infir2_rl.trainers.torch.trainer import TorchTrainer


@pytest.mark.parametrize("fp8", [False, True])
def test_packed_and_padded_train_the_same(tmp_path: Path, fp8: bool) -> None:
    model = init_model(tmp_path / "model", preset="tiny", num_hidden_layers=2)
    paths = make_data(tmp_path / "data", num_sft=16, num_rl=4, num_test=4)
    trainers = {
        packed: TorchTrainer(
            ModelConfig(path=str(model)),
            TrainerConfig(pack_sequences=packed),
            OptimizerConfig(warmup_ratio=0.0),
            fp8=fp8,
            total_steps=4,
        )
        for packed in (False, True)
    }
    examples, _ = load_sft_examples(paths.sft_train, trainers[False].tokenizer)
    batch = to_token_batch(examples[:8], trainers[False].tokenizer.pad_token_id)
    lengths = batch.attention_mask.sum(1)
    assert lengths.min() < lengths.max()  # ragged rows: padding is really skipped
    (logp_packed,) = trainers[True].forward_logprobs([batch], temperature=1.1)
    (logp_padded,) = trainers[False].forward_logprobs([batch], temperature=1.1)
    torch.testing.assert_close(logp_packed, logp_padded, rtol=1e-5, atol=1e-5)
    stats = {
        packed: t.train_step(micro_batches(batch, 4), SftLossFn(), num_target_tokens(batch))
        for packed, t in trainers.items()
    }
    assert stats[True].loss == pytest.approx(stats[False].loss, rel=1e-5)
    # FP8: wgrad quantizes X and dY in 128-token tiles, and packing changes which tokens share a tile (no
    # padding rows): FP8 rounding noise, ~2e-4 of the norm here, not a different gradient.
    assert stats[True].grad_norm == pytest.approx(stats[False].grad_norm, rel=1e-3 if fp8 else 1e-5)
    padded_params = dict(trainers[False].model.named_parameters())
    lr = OptimizerConfig().lr  # Adam moves each weight by at most ~lr: FP8 noise can flip small ones
    for name, p in trainers[True].model.named_parameters():
        atol = 2 * lr if fp8 else 2e-5
        torch.testing.assert_close(p, padded_params[name], rtol=1e-5, atol=atol, msg=name)
