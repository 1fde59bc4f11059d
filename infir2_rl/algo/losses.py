"""GRPO policy loss: clipped surrogate, train/rollout importance correction (TIS / MIS), KL, entropy.

Legend (all B x T tensors are per response token; B sequences, T response positions):
    logp          log pi_theta(y_t)      trainer, current parameters, requires grad
    logp_old      log pi_old(y_t)        trainer's recompute before the update (detached)
    logp_rollout  log mu(y_t)            what the rollout engine reported when it sampled y_t
    logp_ref      log pi_ref(y_t)        reference model (only for a KL penalty)
    A             advantage, per sequence (B,) or per token (B, T)
    M             mask, 1.0 on valid response tokens, 0.0 on padding

Per token (the PPO surrogate with DAPO's separate clip bounds, "clip-higher"):
    r    = exp(logp - logp_old)
    pg   = max(-A * r, -A * clip(r, 1 - eps_clip_low, 1 + eps_clip_high))
For A > 0 the gradient stops once r > 1 + eps_clip_high (1.28); for A < 0 once r < 1 - eps_clip_low (0.8).

Train/rollout mismatch. Samples come from the engine's mu, not from pi_old: the two differ through
precision (FP8 vs BF16 kernels) even with identical weights. The correction is a DETACHED weight on pg:
    TIS (truncated IS):  w = clamp(exp(logp_old - logp_rollout), tis_low, tis_high)      (InfiR2: cap 2)
    MIS (masked IS):     tokens whose ratio rho is outside [mis_low, mis_high] get weight 0, where rho is
                         "token":     exp(logp_old - logp_rollout) of that token,
                         "sequence":  exp(sum of the sequence's token log-ratios)   (product of ratios),
                         "geometric": exp(mean of the sequence's token log-ratios)  (geometric mean).
The two compose: ``tis`` decides whether surviving tokens carry the clamped per-token weight, ``mis``
decides which tokens survive. With mis="token" and mis_high <= tis_high this is slime's "mask" mode;
with tis=False it is pure rejection. Rejected tokens contribute 0 but stay in the denominators below,
so rejecting 999 tokens of a sequence does not scale the last one by 1000.

KL vs reference (``kl_estimate``), with d = logp - logp_ref and tokens sampled from the policy
(Schulman, "Approximating KL divergence", 2020):
    k1 = d                      unbiased, high variance, can be negative per token
    k2 = d^2 / 2                biased, low variance; its gradient is that of the true KL's
    k3 = exp(-d) - 1 + d        >= 0, unbiased, low variance (GRPO's choice)
    low_var_kl = k3 computed on d clamped to [-20, 20] and clamped to [-10, 10] after (verl's and
                 slime's name for k3 with guards against the exp blowing up when the policy drifts far)
Added as kl_coef * KL only when kl_coef > 0 (InfiR2 uses 0: no reference model is built); reported as a
statistic whenever logp_ref is given. Entropy (``entropy_BT``, nats of the tempered distribution at each
response token, from the caller) is subtracted as entropy_coef * entropy when entropy_coef > 0.
KL and entropy terms are not importance-weighted or MIS-masked, and are reduced like pg below.

Reduction over tokens (the same for every term):
    "sample_token_mean": mean over each sequence's valid tokens, then mean over sequences (slime's
                         default; every answer counts equally whatever its length).
    "token_mean":        sum over all valid tokens / number of valid tokens.
For gradient accumulation pass ``denominator``: the global number of sequences (sample_token_mean) or of
valid tokens (token_mean); the loss is then this micro-batch's share and shares add up to the global mean.
Statistics are plain token means over the valid tokens of this call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from infir2_rl.algo.config import AlgorithmConfig, KlType, LossReduction, MisLevel
from infir2_rl.algo.masked import as_float_mask, masked_mean, per_sample_mean, zero_masked


@dataclass(kw_only=True)
class PolicyLossStats:
    """Scalars from one policy_loss call; fractions and means are over the call's valid tokens."""

    loss: float  # the returned loss
    pg_loss: float  # the policy-gradient part of it
    pg_clip_frac: float  # tokens where the PPO clip is the active branch (zero gradient)
    ratio_mean: float  # mean of exp(logp - logp_old)
    tis_weight_mean: float  # mean importance weight applied (1.0 with tis off)
    tis_clip_frac: float  # tokens where the clamp changed the TIS weight
    mis_mask_frac: float  # tokens rejected by MIS
    kl: float | None  # mean KL estimate vs the reference, when logp_ref is given
    entropy: float | None  # mean entropy, when entropy is given
    num_tokens: int  # valid tokens in this call
    num_samples: int  # sequences in this call


def kl_estimate(logp_BT: Tensor, ref_logp_BT: Tensor, kl_type: KlType) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi (see the module docstring)."""
    d = logp_BT - ref_logp_BT
    if kl_type == "k1":
        return d
    if kl_type == "k2":
        return 0.5 * d * d
    if kl_type == "k3":
        return torch.expm1(-d) + d  # expm1 keeps precision for the tiny |d| typical of a few steps
    if kl_type == "low_var_kl":
        d = d.clamp(-20.0, 20.0)
        return (torch.expm1(-d) + d).clamp(-10.0, 10.0)
    raise ValueError(f"kl_type={kl_type!r}: use 'k1', 'k2', 'k3' or 'low_var_kl'.")


def mis_log_ratio(log_ratio_BT: Tensor, mask_BT: Tensor, level: MisLevel) -> Tensor:
    """Log of the MIS ratio at the given level, broadcast to (B, T)."""
    if level == "token":
        return log_ratio_BT
    if level == "sequence":
        seq = (zero_masked(log_ratio_BT, mask_BT) * mask_BT).sum(dim=-1)
    elif level == "geometric":
        seq = per_sample_mean(log_ratio_BT, mask_BT)
    else:
        raise ValueError(f"mis={level!r}: use 'token', 'sequence' or 'geometric'.")
    return seq[:, None].expand_as(log_ratio_BT)


def _reduce(x_BT: Tensor, mask_BT: Tensor, reduction: LossReduction, denominator: float | None) -> Tensor:
    x_BT = zero_masked(x_BT, mask_BT) * mask_BT
    if reduction == "sample_token_mean":
        total = (x_BT.sum(dim=-1) / mask_BT.sum(dim=-1).clamp_min(1.0)).sum()
        return total / (denominator if denominator is not None else x_BT.shape[0])
    total = x_BT.sum()
    return total / (denominator if denominator is not None else mask_BT.sum())


def _log_bound(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _check_inputs(
    logp: Tensor,
    others: dict[str, Tensor | None],
    advantages: Tensor,
    cfg: AlgorithmConfig,
    denominator: float | None,
) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp has shape {tuple(logp.shape)}: expected (B, T).")
    for name, t in others.items():
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: it must match logp {tuple(logp.shape)}.")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}: expected (B,) or (B, T) = {tuple(logp.shape)}."
        )
    if cfg.needs_rollout_logp and others["logp_rollout"] is None:
        raise ValueError(
            "logp_rollout is None but tis or mis is on: pass the engine's log-probs or turn them off."
        )
    if cfg.kl_coef > 0 and others["logp_ref"] is None:
        raise ValueError(
            f"kl_coef={cfg.kl_coef} but logp_ref is None: pass reference log-probs or set kl_coef=0."
        )
    if cfg.entropy_coef > 0 and others["entropy"] is None:
        raise ValueError(
            f"entropy_coef={cfg.entropy_coef} but entropy is None: pass it or set entropy_coef=0."
        )
    if denominator is not None and not denominator > 0:
        raise ValueError(f"denominator={denominator}: must be > 0 (global sequence or token count).")


def _rollout_correction(
    logp_old: Tensor, logp_rollout: Tensor | None, M: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """(TIS weight, keep mask, tis_clipped), all (B, T) and detached; see the module docstring."""
    valid = M > 0
    weight = torch.ones_like(M)
    keep = M.clone()
    tis_clipped = torch.zeros_like(valid)
    if logp_rollout is None or not cfg.needs_rollout_logp:
        return weight, keep, tis_clipped
    is_log = zero_masked(logp_old.detach() - logp_rollout.detach(), M).to(M.dtype)
    if cfg.tis:
        raw = torch.exp(is_log)
        weight = raw.clamp(cfg.tis_low, cfg.tis_high)
        tis_clipped = ((raw < cfg.tis_low) | (raw > cfg.tis_high)) & valid
    if cfg.mis != "off":
        # Compare in log space: a sequence's product of ratios overflows exp long before it matters.
        level = mis_log_ratio(is_log, M, cfg.mis)
        inside = (level >= _log_bound(cfg.mis_low)) & (level <= _log_bound(cfg.mis_high))
        keep = keep * inside.to(M.dtype)
    return weight, keep, tis_clipped


# The statistics of ``policy_loss_terms``, in the order of its tensor (PolicyLossStats's float fields).
STAT_FIELDS = (
    "loss",
    "pg_loss",
    "pg_clip_frac",
    "ratio_mean",
    "tis_weight_mean",
    "tis_clip_frac",
    "mis_mask_frac",
    "kl",
    "entropy",
)


def policy_loss(
    logp: Tensor,
    logp_old: Tensor,
    logp_rollout: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: AlgorithmConfig,
    logp_ref: Tensor | None = None,
    entropy: Tensor | None = None,
    *,
    denominator: float | None = None,
    num_tokens: int | None = None,
) -> tuple[Tensor, PolicyLossStats]:
    """Scalar loss to minimise and its statistics; see the module docstring for every formula.

    ``logp_rollout`` may be None only when tis and mis are both off. ``denominator``: see the
    module docstring (gradient accumulation). A ``mask`` without a valid token (a micro-batch of empty
    responses, as SGLang returns for prompts it refuses) gives a loss of 0 that still reaches ``logp``'s graph
    and statistics of 0 over ``num_tokens=0``. ``num_tokens``: the count of ``mask > 0`` when the caller knows
    it on the host. The statistics come to the host here (one wait for the device); ``policy_loss_terms``
    leaves them on the device.
    """
    loss, values, num_valid = policy_loss_terms(
        logp,
        logp_old,
        logp_rollout,
        advantages,
        mask,
        cfg,
        logp_ref,
        entropy,
        denominator=denominator,
        num_tokens=num_tokens,
    )
    stats = dict(zip(STAT_FIELDS, values.tolist(), strict=True))
    stats["kl"] = stats["kl"] if logp_ref is not None else None
    stats["entropy"] = stats["entropy"] if entropy is not None else None
    return loss, PolicyLossStats(**stats, num_tokens=num_valid, num_samples=int(logp.shape[0]))


def policy_loss_terms(
    logp: Tensor,
    logp_old: Tensor,
    logp_rollout: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: AlgorithmConfig,
    logp_ref: Tensor | None = None,
    entropy: Tensor | None = None,
    *,
    denominator: float | None = None,
    num_tokens: int | None = None,
) -> tuple[Tensor, Tensor, int]:
    """``policy_loss`` with its statistics left on the device: (loss, the statistics as one float tensor in
    ``STAT_FIELDS`` order, the number of valid tokens). Kl and entropy are NaN where not given. With
    ``num_tokens`` given nothing here waits for the device (the trainer's micro-batches: GrpoLoss)."""
    others = {"logp_old": logp_old, "logp_rollout": logp_rollout, "logp_ref": logp_ref, "entropy": entropy}
    _check_inputs(logp, others, advantages, cfg, denominator)
    # At least float32: ratios of bf16 log-probs would round to steps of ~1% (bf16 has 8 mantissa bits).
    dtype = torch.promote_types(logp.dtype, torch.float32)
    logp, logp_old = logp.to(dtype), logp_old.to(dtype)
    logp_rollout = logp_rollout.to(dtype) if logp_rollout is not None else None
    logp_ref = logp_ref.to(dtype) if logp_ref is not None else None
    entropy = entropy.to(dtype) if entropy is not None else None
    M = as_float_mask(mask, logp)
    if num_tokens is None:
        num_tokens = int((M > 0).sum().item())
    if num_tokens == 0:  # nothing to train on; the sequences still count in sample_token_mean's denominator
        return zero_masked(logp, M).sum() * 0.0, M.new_zeros(len(STAT_FIELDS)), 0
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)

    # PPO clipped surrogate; padding is zeroed first so NaN/inf there cannot leak into the sums.
    adv = zero_masked(advantages.detach().to(logp.dtype), M)
    ratio = torch.exp(zero_masked(logp - logp_old.detach(), M))
    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    pg_BT = torch.maximum(surr, surr_clipped)

    weight, keep, tis_clipped = _rollout_correction(logp_old, logp_rollout, M, cfg)
    pg_loss = _reduce(pg_BT * weight * keep, M, cfg.loss_reduction, denominator)

    loss = pg_loss
    if logp_ref is not None and cfg.kl_coef > 0:
        kl_BT = kl_estimate(logp, logp_ref.detach(), cfg.kl_type)
        loss = loss + cfg.kl_coef * _reduce(kl_BT, M, cfg.loss_reduction, denominator)
    if entropy is not None and cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * _reduce(entropy, M, cfg.loss_reduction, denominator)

    # Statistics: token means over valid tokens, gathered into one tensor.
    nan = torch.tensor(float("nan"), device=M.device)
    kl_stat = (
        masked_mean(kl_estimate(logp.detach(), logp_ref.detach(), cfg.kl_type), M)
        if logp_ref is not None
        else nan
    )
    ent_stat = masked_mean(entropy.detach(), M) if entropy is not None else nan
    values = torch.stack(
        [
            loss.detach(),
            pg_loss.detach(),
            masked_mean((surr_clipped > surr).to(M.dtype), M),
            masked_mean(ratio.detach(), M),
            masked_mean(weight, M),
            masked_mean(tis_clipped.to(M.dtype), M),
            1.0 - masked_mean(keep, M),
            kl_stat.to(M.dtype),
            ent_stat.to(M.dtype),
        ]
    )
    return loss, values, num_tokens
