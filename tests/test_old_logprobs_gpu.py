"""On one CUDA GPU: the old log-probs (``forward_logprobs``, the scoring forward) equal bit for bit the log-probs
the training forward computes on the same micro-batches with the same weights (``train_step(keep_logprobs=True)``
hands them back), so an RL step's first update can take its old log-probs from its own forward and skip the
scoring pass (stages/rl.py), and the PPO ratio of every trained token there is exactly 1. BF16 and FP8, padded
(sorted rows, several shapes: later shapes of a code path are captured after a warm-up of layer 0 alone) and
packed, with the layer graphs and eagerly. Skipped on CPU. ``bench/old_vs_new.py`` measures the same at the
1.5B shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.models.factory import init_model
from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens
from infir2_rl.trainers.microbatch import merge_rows, micro_batches, row_lengths, shard_rows, take_rows
from infir2_rl.trainers.torch.trainer import TorchTrainer
from infir2_rl.types import TokenBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _batch(vocab: int) -> TokenBatch:
    """Rows of 70..620 tokens (an RL batch's spread, scaled to the tiny model), a 16-token prompt each."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([620, 510, 440, 380, 300, 260, 230, 200, 170, 150, 130, 120, 100, 90, 80, 70] * 2)
    ids = torch.randint(1, vocab, (len(lengths), int(lengths.max())), generator=gen)
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    loss_mask = mask.float()
    loss_mask[:, :16] = 0
    return TokenBatch(input_ids=ids * mask, attention_mask=mask, loss_mask=loss_mask)


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_old_logprobs_equal_the_training_forwards(
    tmp_path: Path, fp8: bool, packed: bool, graphs: bool
) -> None:
    model = init_model(tmp_path / "model", preset="tiny")
    budget = 1280
    trainer = TorchTrainer(
        ModelConfig(path=str(model)),
        TrainerConfig(cuda_graphs=graphs, pack_sequences=packed, max_tokens_per_gpu=budget),
        OptimizerConfig(lr=1e-3, warmup_ratio=0.0, schedule="constant"),
        fp8=fp8,
        total_steps=4,
        seed=0,
    )
    batch = _batch(trainer.model.config.vocab_size)
    batch = take_rows(batch, shard_rows(row_lengths(batch), 1, sort_by_length=True)[0])
    parts = micro_batches(batch, 1, budget, packed=packed, bucketed=trainer.pads_to_buckets)
    assert len({tuple(p.input_ids.shape) for p in parts}) >= 3  # several shapes of one code path

    old = trainer.forward_logprobs(parts)
    stats = trainer.train_step(parts, SftLossFn(), num_target_tokens(batch), keep_logprobs=True)
    assert not stats.skipped and stats.logprobs is not None
    if graphs:
        assert trainer.layer_graphs is not None and trainer.layer_graphs.replays > 0
    # The training forward's log-probs, as train_step hands them back (rows in the order given, though the
    # graphs ran the micro-batches largest first), against the scoring pass's on every trained token.
    length = batch.input_ids.shape[1]
    new, before = merge_rows([stats.logprobs], length), merge_rows(old, length)
    trained = batch.loss_mask > 0
    trained[:, 0] = False
    assert trained.any()
    assert torch.equal(new[trained], before[trained])
    assert not new[~trained].any()
