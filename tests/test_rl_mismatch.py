"""Train/rollout mismatch: one FP8 flow (unified_fp8) against BF16 training with FP8 rollout.

The engine samples with FP8 W8A8 linears built from the weights the trainer pushes; the trainer then
scores the same tokens. With `unified_fp8` the trainer computes with the very FP8 weights it pushed and
the same activation quantizer, so the two sides differ only in float accumulation order. With
`bf16_train_fp8_rollout` the trainer computes in full precision and the engine's FP8 rounding is the gap.

Threshold: K3 (an estimate of KL(rollout || train)) below 1e-5 for unified FP8. slime reports 1e-5..1e-3
for dense models in BF16 and NeMo-RL gates its CI at 2e-3; a single precision flow on one CPU must sit at
the bottom of that range or below (measured here ~1e-9..1e-7), while the mixed flow measures ~1e-4.
"""

from pathlib import Path

import pytest
import torch

from infir2_rl.algo.mismatch import MismatchStats, mismatch_metrics
from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.engines.native.engine import NativeEngine
from infir2_rl.models.factory import init_model
from infir2_rl.rollout.batch import RolloutBatch, to_token_batches
from infir2_rl.trainers.torch.trainer import TorchTrainer
from infir2_rl.types import GenerateRequest, SamplingParams, TokenBatch
from infir2_rl.weight_sync.buckets import build_buckets

K3_UNIFIED_MAX = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread: None) -> None:
    """Single-threaded torch for this module (see conftest.one_thread)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("mm") / "tiny", preset="tiny", seed=3)


def _measure(model_dir: Path, trainer_fp8: bool) -> MismatchStats:
    trainer = TorchTrainer(
        ModelConfig(path=str(model_dir), dtype="float32"),
        TrainerConfig(micro_batch_size=16),
        OptimizerConfig(),
        fp8=trainer_fp8,
        total_steps=1,
        device="cpu",
    )
    engine = NativeEngine(str(model_dir), fp8=True, dtype="float32", device="cpu")
    for bucket in build_buckets(trainer.export_weights(), 1 << 30, version=1):
        engine.update_weights(bucket)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_new_tokens=24)
    requests = [
        GenerateRequest(
            f"r{i}", torch.randint(10, 200, (8,), generator=gen).tolist(), n=4, params=params, seed=i
        )
        for i in range(4)
    ]
    samples = sorted(engine.generate(requests), key=lambda s: (s.request_id, s.index))
    batch = RolloutBatch(samples=samples, rewards=[0.0] * 16, group_size=4, labels=["0"] * 4)
    (tokens,) = to_token_batches(batch, torch.zeros(16), pad_id=0, micro_batch_size=16)
    (logp,) = trainer.forward_logprobs([tokens], temperature=1.0)
    assert tokens.rollout_logprobs is not None
    return mismatch_metrics(logp[:, 1:], tokens.rollout_logprobs[:, 1:], tokens.loss_mask[:, 1:])


def test_fp8_disabled_forward_is_the_dense_trainer(model_dir: Path) -> None:
    """`forward_logprobs(fp8=False)` of an FP8 trainer (the RL stage's dense_trainer_mismatch metric) is
    exactly what a trainer without FP8 linears computes from the same weights; fp8=True is not."""
    trainers = [
        TorchTrainer(
            ModelConfig(path=str(model_dir), dtype="float32"),
            TrainerConfig(micro_batch_size=4),
            OptimizerConfig(),
            fp8=fp8,
            total_steps=1,
            device="cpu",
        )
        for fp8 in (True, False)
    ]
    ids = torch.randint(10, 200, (4, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    batch = TokenBatch(input_ids=ids, attention_mask=mask, loss_mask=mask.float())
    (dense_of_fp8,) = trainers[0].forward_logprobs([batch], temperature=1.0, fp8=False)
    (fp8,) = trainers[0].forward_logprobs([batch], temperature=1.0)
    (dense,) = trainers[1].forward_logprobs([batch], temperature=1.0)
    assert torch.equal(dense_of_fp8, dense)
    assert (fp8 - dense).abs().max() > 1e-4
    assert all(m.fp8_enabled for m in trainers[0].model.modules() if hasattr(m, "fp8_enabled"))


def test_unified_fp8_mismatch_is_far_below_bf16_train_fp8_rollout(model_dir: Path) -> None:
    unified = _measure(model_dir, trainer_fp8=True)
    mixed = _measure(model_dir, trainer_fp8=False)
    assert unified.num_tokens == mixed.num_tokens > 100
    assert unified.k3 < K3_UNIFIED_MAX, unified
    assert mixed.k3 > 100 * unified.k3, (unified, mixed)
    assert mixed.abs_logp_diff_mean > 20 * unified.abs_logp_diff_mean, (unified, mixed)
