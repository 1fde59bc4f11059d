"""Loss functions as the trainer calls them: picklable objects mapping (logits, TokenBatch) -> LossOutput.

The TokenBatch convention puts token t's values at position t; logits at position t predict token t+1.
So the logits are shifted against the targets here, once, and every per-token tensor is read from 1 on.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from infir2_rl.algo.logprobs import token_logprobs
from infir2_rl.algo.losses import PolicyLossConfig, policy_loss
from infir2_rl.config import AlgorithmConfig
from infir2_rl.types import LossOutput, TokenBatch


@dataclass
class GrpoLoss:
    """Clipped GRPO surrogate with TIS/MIS against the engine's log-probs, scored at the rollout temperature."""

    cfg: PolicyLossConfig
    # The rollout temperature: both sides must score the same (tempered) distribution.
    temperature: float

    @classmethod
    def from_config(cls, algo: AlgorithmConfig, temperature: float) -> GrpoLoss:
        cfg = PolicyLossConfig(
            eps_clip_low=algo.eps_clip_low,
            eps_clip_high=algo.eps_clip_high,
            tis=algo.tis,
            tis_low=algo.tis_low,
            tis_high=algo.tis_high,
            mis=algo.mis,
            mis_low=algo.mis_low,
            mis_high=algo.mis_high,
            kl_coef=algo.kl_coef,
            kl_type=algo.kl_type,
            entropy_coef=algo.entropy_coef,
            loss_reduction=algo.loss_reduction,
        )
        return cls(cfg=cfg, temperature=temperature)

    def __call__(self, logits_BLV: Tensor, batch: TokenBatch) -> LossOutput:
        if batch.old_logprobs is None or batch.advantages is None:
            raise ValueError("GrpoLoss needs batch.old_logprobs and batch.advantages (RL batches only)")
        if self.cfg.kl_coef > 0:
            raise NotImplementedError("algorithm.kl_coef > 0 needs a reference model, which is not built yet")
        logp = token_logprobs(logits_BLV[:, :-1], batch.input_ids[:, 1:], self.temperature)
        mask = batch.loss_mask[:, 1:]
        rollout = batch.rollout_logprobs[:, 1:] if batch.rollout_logprobs is not None else None
        loss, stats = policy_loss(
            logp, batch.old_logprobs[:, 1:].to(logp), rollout, batch.advantages.to(logp), mask, self.cfg
        )
        by_tokens = self.cfg.loss_reduction == "token_mean"
        units = int(mask.sum().item()) if by_tokens else batch.num_sequences
        return LossOutput(
            loss=loss,
            num_units=units,
            metrics={
                "train/pg_loss": stats.pg_loss,
                "train/pg_clip_frac": stats.pg_clip_frac,
                "train/ratio_mean": stats.ratio_mean,
                "train/tis_weight_mean": stats.tis_weight_mean,
            },
        )
