"""The KL penalty's reference model on a trainer rank (in-process, no Ray): built only when
algorithm.kl_coef > 0, frozen, in the trainer's precision flow, and unchanged by training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infir2_rl.actors.trainer_worker import TrainerSpec, TrainerWorker
from infir2_rl.algo.config import AlgorithmConfig
from infir2_rl.config import ModelConfig, OptimizerConfig, RlStageConfig
from infir2_rl.data.datasets import load_sft_examples
from infir2_rl.data.synthetic import make_data
from infir2_rl.fp8.linear import Fp8Linear
from infir2_rl.models.factory import init_model
from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens, to_token_batch
from infir2_rl.types import TokenBatch


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kl_ref")
    model = init_model(root / "model", preset="tiny", num_hidden_layers=2)
    paths = make_data(root / "data", num_sft=8, num_rl=4, num_test=4)
    return model, paths.sft_train


def _worker(model: Path, kl_coef: float) -> TrainerWorker:
    cfg = RlStageConfig(
        model=ModelConfig(path=str(model)),
        algorithm=AlgorithmConfig(kl_coef=kl_coef),
        optimizer=OptimizerConfig(lr=1e-2, min_lr=0.0, schedule="constant", warmup_ratio=0.0),
    )
    worker = TrainerWorker(TrainerSpec.from_stage(cfg, total_steps=4, fsdp=False), rank=0, world_size=1)
    worker.setup()
    return worker


def _batch(worker: TrainerWorker, data: Path) -> TokenBatch:
    tok = worker.backend.tokenizer
    examples, _ = load_sft_examples(data, tok)
    return to_token_batch(examples[:4], tok.pad_token_id)


def test_kl_coef_zero_builds_no_reference_model(assets: tuple[Path, Path]) -> None:
    model, data = assets
    worker = _worker(model, kl_coef=0.0)
    assert worker.spec.reference is False and worker.backend.reference is None
    with pytest.raises(RuntimeError, match="no reference model"):
        worker.forward_ref_logprobs([_batch(worker, data)], 1.0)


def test_reference_is_frozen_fp8_and_stays_at_the_starting_weights(assets: tuple[Path, Path]) -> None:
    model, data = assets
    worker = _worker(model, kl_coef=0.05)
    trainer = worker.backend
    ref = trainer.reference
    assert worker.spec.reference is True and ref is not None and ref is not trainer.model
    # The trainer's precision flow: the same decoder linears are FP8 (unified_fp8 stage), no gradients.
    ref_fp8 = [n for n, m in ref.named_modules() if isinstance(m, Fp8Linear)]
    assert ref_fp8 and len(ref_fp8) == len(trainer.fp8_linears)
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    batch = _batch(worker, data)
    (before,) = worker.forward_logprobs([batch], 0.8)
    (ref_before,) = worker.forward_ref_logprobs([batch], 0.8)
    torch.testing.assert_close(ref_before, before, rtol=0, atol=0)  # same weights, same flow: same bytes
    for _ in range(2):
        stats = worker.train_step([batch], SftLossFn(), num_target_tokens(batch))
        assert not stats.skipped
    (after,) = worker.forward_logprobs([batch], 0.8)
    (ref_after,) = worker.forward_ref_logprobs([batch], 0.8)
    assert (after - before).abs().max() > 1e-3  # the policy moved ...
    torch.testing.assert_close(ref_after, ref_before, rtol=0, atol=0)  # ... the reference did not
