"""Shared by the trainer backends' tests: an RL step's first update without a scoring pass.

The first update of an RL step trains on the weights that sampled the batch, so the stage lets it take its old
log-probs from its own forward (``GrpoLoss.old_from_scores``) and hand them back for the mismatch metrics
(``train_step(keep_logprobs=True)``), instead of scoring the batch first (stages/rl.py). ``check_first_update``
holds that to be the very update a scoring pass before it gives: same log-probs, loss, statistics and weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from infir2_rl.algo.config import AlgorithmConfig
from infir2_rl.algo.loss_fns import GrpoLoss
from infir2_rl.metrics import names
from infir2_rl.trainers.microbatch import merge_rows, micro_batches
from infir2_rl.types import TokenBatch


def rl_batch(batch: TokenBatch, seed: int = 0) -> TokenBatch:
    """``batch`` (an SFT batch: its loss mask marks the "response") with rollout log-probs and advantages."""
    gen = torch.Generator().manual_seed(seed)
    mask = batch.loss_mask
    return replace(
        batch,
        rollout_logprobs=-torch.rand(mask.shape, generator=gen) * mask,
        advantages=torch.randn(mask.shape[0], generator=gen),
    )


def check_first_update(make_trainer: Callable[[], Any], batch: TokenBatch, micro_batch_size: int) -> None:
    """Two trainers from the same weights: one scores ``batch`` (forward_logprobs) and trains with those old
    log-probs, the other trains with ``old_from_scores`` and keeps its log-probs. Everything must be equal."""
    scored, unscored = make_trainer(), make_trainer()
    length = int(batch.input_ids.shape[1])
    old = merge_rows(scored.forward_logprobs(micro_batches(batch, micro_batch_size)), length)
    loss = GrpoLoss(AlgorithmConfig(), 1.0)
    a = scored.train_step(
        micro_batches(replace(batch, old_logprobs=old), micro_batch_size), loss, batch.num_sequences
    )
    b = unscored.train_step(
        micro_batches(batch, micro_batch_size),
        replace(loss, old_from_scores=True),
        batch.num_sequences,
        keep_logprobs=True,
    )
    assert a.logprobs is None and b.logprobs is not None
    kept = merge_rows([b.logprobs], length)
    trained = batch.loss_mask > 0
    trained[:, 0] = False
    assert trained.any()
    assert torch.equal(kept[trained], old[trained])  # the scoring pass's bits
    assert not kept[~trained].any()  # nothing scored off the loss mask
    assert (a.loss, a.grad_norm, a.metrics) == (b.loss, b.grad_norm, b.metrics)
    assert a.metrics[names.TRAIN_RATIO_MEAN] == 1.0  # on-policy: exp(logp - old) is exactly 1
    for x, y in zip(scored.model.parameters(), unscored.model.parameters(), strict=True):
        assert torch.equal(x, y)
