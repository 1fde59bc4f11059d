"""Loss functions as the trainer calls them: picklable objects mapping (TokenScores, TokenBatch) -> LossOutput.

The TokenBatch convention puts token t's values at position t, and so do the trainer's ``TokenScores``
(log p of token t given tokens < t, at the rollout temperature): every per-token tensor is read from 1 on.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from infir2_rl.algo.config import AlgorithmConfig
from infir2_rl.algo.losses import STAT_FIELDS, policy_loss_terms
from infir2_rl.metrics import names
from infir2_rl.types import LossOutput, TokenBatch, TokenScores


@dataclass
class GrpoLoss:
    """Clipped GRPO surrogate with TIS/MIS against the engine's log-probs, KL to the reference model and an
    entropy bonus when their coefficients are > 0, all scored at the rollout temperature."""

    cfg: AlgorithmConfig
    # The rollout temperature: both sides must score the same (tempered) distribution.
    temperature: float
    # The old log-probs are this forward's own, detached (the batch then carries none): right where the weights
    # training are those that would have scored the batch, i.e. an RL step's first update. The scoring forward
    # and the training forward give the same bits there (tests/test_old_logprobs_gpu.py), so this only saves
    # the scoring pass (stages/rl.py).
    old_from_scores: bool = False

    @property
    def needs_entropy(self) -> bool:
        return self.cfg.needs_entropy

    def __call__(self, scores: TokenScores, batch: TokenBatch) -> LossOutput:
        if batch.advantages is None or (batch.old_logprobs is None) != self.old_from_scores:
            raise ValueError(
                "GrpoLoss needs batch.advantages, and batch.old_logprobs unless old_from_scores (then none);"
                f" got advantages: {batch.advantages is not None}, old_logprobs: {batch.old_logprobs is not None},"
                f" old_from_scores={self.old_from_scores}"
            )
        if self.cfg.needs_reference and batch.ref_logprobs is None:
            raise ValueError(
                f"algorithm.kl_coef={self.cfg.kl_coef} but the batch has no ref_logprobs: the stage must"
                " score the batch with the reference model (TrainerGroup.forward_ref_logprobs) first"
            )
        logp = scores.logprobs_BL[:, 1:]
        entropy = scores.entropy_BL[:, 1:] if scores.entropy_BL is not None else None
        if self.cfg.needs_entropy and entropy is None:
            raise ValueError(
                f"algorithm.entropy_coef={self.cfg.entropy_coef} but the scores carry no entropy: the trainer"
                " must be asked for it (needs_entropy)"
            )
        mask = batch.loss_mask[:, 1:]
        rollout = batch.rollout_logprobs[:, 1:] if batch.rollout_logprobs is not None else None
        ref = batch.ref_logprobs[:, 1:].to(logp) if batch.ref_logprobs is not None else None
        by_tokens = self.cfg.loss_reduction == "token_mean"
        # Counted on the host (TokenBatch.to) when the trainer moved the batch: then nothing here waits for the
        # device, and the statistics stay there until the step's end (MetricMeans).
        known = batch.counts.num_targets if batch.counts is not None else None
        old = logp.detach() if batch.old_logprobs is None else batch.old_logprobs[:, 1:].to(logp)
        loss, values, num_tokens = policy_loss_terms(
            logp,
            old,
            rollout,
            batch.advantages.to(logp),
            mask,
            self.cfg,
            logp_ref=ref,
            entropy=entropy,
            num_tokens=known,
        )
        stat = dict(zip(STAT_FIELDS, values.unbind(), strict=True))
        metrics: dict[str, float | Tensor] = {
            names.TRAIN_PG_LOSS: stat["pg_loss"],
            names.TRAIN_PG_CLIP_FRAC: stat["pg_clip_frac"],
            names.TRAIN_RATIO_MEAN: stat["ratio_mean"],
            names.TRAIN_TIS_WEIGHT_MEAN: stat["tis_weight_mean"],
        }
        if ref is not None:
            metrics[names.TRAIN_KL] = stat["kl"]
        if entropy is not None:
            metrics[names.TRAIN_ENTROPY] = stat["entropy"]
        units = num_tokens if by_tokens else batch.num_sequences
        # The statistics are token means over this micro-batch: weighted by its tokens.
        return LossOutput(loss=loss, num_units=units, metrics=metrics, metric_weight=num_tokens)
