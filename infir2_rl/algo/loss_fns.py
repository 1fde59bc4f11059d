"""Loss functions as the trainer calls them: picklable objects mapping (logits, TokenBatch) -> LossOutput.

The TokenBatch convention puts token t's values at position t; logits at position t predict token t+1.
So the logits are shifted against the targets here, once, and every per-token tensor is read from 1 on.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from infir2_rl.algo.config import AlgorithmConfig
from infir2_rl.algo.logprobs import entropy_from_logits, token_logprobs
from infir2_rl.algo.losses import policy_loss
from infir2_rl.metrics import names
from infir2_rl.types import LossOutput, TokenBatch


@dataclass
class GrpoLoss:
    """Clipped GRPO surrogate with TIS/MIS against the engine's log-probs, KL to the reference model and an
    entropy bonus when their coefficients are > 0, all scored at the rollout temperature."""

    cfg: AlgorithmConfig
    # The rollout temperature: both sides must score the same (tempered) distribution.
    temperature: float

    def __call__(self, logits_BLV: Tensor, batch: TokenBatch) -> LossOutput:
        if batch.old_logprobs is None or batch.advantages is None:
            raise ValueError("GrpoLoss needs batch.old_logprobs and batch.advantages (RL batches only)")
        if self.cfg.needs_reference and batch.ref_logprobs is None:
            raise ValueError(
                f"algorithm.kl_coef={self.cfg.kl_coef} but the batch has no ref_logprobs: the stage must"
                " score the batch with the reference model (TrainerGroup.forward_ref_logprobs) first"
            )
        logits_BTV = logits_BLV[:, :-1]
        logp = token_logprobs(logits_BTV, batch.input_ids[:, 1:], self.temperature)
        entropy = entropy_from_logits(logits_BTV, self.temperature) if self.cfg.needs_entropy else None
        mask = batch.loss_mask[:, 1:]
        rollout = batch.rollout_logprobs[:, 1:] if batch.rollout_logprobs is not None else None
        ref = batch.ref_logprobs[:, 1:].to(logp) if batch.ref_logprobs is not None else None
        loss, stats = policy_loss(
            logp,
            batch.old_logprobs[:, 1:].to(logp),
            rollout,
            batch.advantages.to(logp),
            mask,
            self.cfg,
            logp_ref=ref,
            entropy=entropy,
        )
        by_tokens = self.cfg.loss_reduction == "token_mean"
        units = int(mask.sum().item()) if by_tokens else batch.num_sequences
        metrics = {
            names.TRAIN_PG_LOSS: stats.pg_loss,
            names.TRAIN_PG_CLIP_FRAC: stats.pg_clip_frac,
            names.TRAIN_RATIO_MEAN: stats.ratio_mean,
            names.TRAIN_TIS_WEIGHT_MEAN: stats.tis_weight_mean,
        }
        if stats.kl is not None:
            metrics[names.TRAIN_KL] = stats.kl
        if stats.entropy is not None:
            metrics[names.TRAIN_ENTROPY] = stats.entropy
        return LossOutput(loss=loss, num_units=units, metrics=metrics)
