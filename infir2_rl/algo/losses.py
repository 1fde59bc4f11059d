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
    veto (optional):     a whole sequence gets weight 0 if any token's ratio is below mis_veto.
The two compose: ``tis`` decides whether surviving tokens carry the clamped per-token weight, ``mis``
decides which tokens survive. With mis="token" and mis_high <= tis_high this is slime's "mask" mode;
with tis=False it is pure rejection. Rejected tokens contribute 0 but stay in the denominators below,
so rejecting 999 tokens of a sequence does not scale the last one by 1000.

KL vs reference, with d = logp - logp_ref and samples from the policy (Schulman's estimators):
    k1 = d,   k2 = d^2 / 2,   k3 = exp(-d) - 1 + d  (>= 0, unbiased, low variance; GRPO's choice)
Added as kl_coef * k only when kl_coef > 0 (InfiR2 uses 0: no reference model is built); reported as a
statistic whenever logp_ref is given. The entropy bonus subtracts entropy_coef * entropy.
KL and entropy terms are not importance-weighted or MIS-masked.

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
from typing import Literal

import torch
from torch import Tensor

from infir2_rl.algo.masked import as_float_mask, masked_mean, per_sample_mean, zero_masked

MisLevel = Literal["off", "token", "sequence", "geometric"]
KlType = Literal["k1", "k2", "k3"]
LossReduction = Literal["sample_token_mean", "token_mean"]


@dataclass(kw_only=True)
class PolicyLossConfig:
    """Knobs of the policy loss; defaults are InfiR2's RL stages (clip 0.2 / 0.28, TIS cap 2, no KL)."""

    # PPO clip: r is clipped to [1 - eps_clip_low, 1 + eps_clip_high].
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    # Multiply pg by the clamped, detached train/rollout ratio exp(logp_old - logp_rollout).
    tis: bool = True
    # Clamp bounds of the TIS weight (slime's production scripts use tis_low=0.5).
    tis_low: float = 0.0
    tis_high: float = 2.0
    # Masked IS: "off", or the level ("token" / "sequence" / "geometric") at which out-of-range ratios are masked.
    mis: MisLevel = "off"
    # Keep tokens whose MIS ratio lies in [mis_low, mis_high].
    mis_low: float = 0.5
    mis_high: float = 2.0
    # Drop a whole sequence if any token's train/rollout ratio is below this (e.g. 1e-4); None disables.
    mis_veto: float | None = None
    # Coefficient of the KL(pi || pi_ref) loss; 0 means no reference model is needed.
    kl_coef: float = 0.0
    # KL estimator, see the module docstring.
    kl_type: KlType = "k3"
    # Coefficient of the entropy bonus (subtracted from the loss).
    entropy_coef: float = 0.0
    # How token losses become one number, see the module docstring.
    loss_reduction: LossReduction = "sample_token_mean"

    def __post_init__(self) -> None:
        for name in ("eps_clip_low", "eps_clip_high", "tis_low", "mis_low", "kl_coef", "entropy_coef"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"policy_loss.{name}={getattr(self, name)}: must be >= 0.")
        if self.eps_clip_low >= 1:
            raise ValueError(
                f"policy_loss.eps_clip_low={self.eps_clip_low}: must be < 1 so that 1 - eps > 0."
            )
        if not self.tis_high > self.tis_low:
            raise ValueError(f"policy_loss.tis_high={self.tis_high}: must be > tis_low={self.tis_low}.")
        if not self.mis_high > self.mis_low:
            raise ValueError(f"policy_loss.mis_high={self.mis_high}: must be > mis_low={self.mis_low}.")
        if self.mis not in ("off", "token", "sequence", "geometric"):
            raise ValueError(f"policy_loss.mis={self.mis!r}: use 'off', 'token', 'sequence' or 'geometric'.")
        if self.mis_veto is not None and not self.mis_veto > 0:
            raise ValueError(f"policy_loss.mis_veto={self.mis_veto}: must be > 0 (e.g. 1e-4) or None.")
        if self.kl_type not in ("k1", "k2", "k3"):
            raise ValueError(f"policy_loss.kl_type={self.kl_type!r}: use 'k1', 'k2' or 'k3'.")
        if self.loss_reduction not in ("sample_token_mean", "token_mean"):
            raise ValueError(
                f"policy_loss.loss_reduction={self.loss_reduction!r}: use 'sample_token_mean' or 'token_mean'."
            )

    @property
    def needs_rollout_logp(self) -> bool:
        """Whether policy_loss reads logp_rollout with this config."""
        return self.tis or self.mis != "off" or self.mis_veto is not None


@dataclass(kw_only=True)
class PolicyLossStats:
    """Scalars from one policy_loss call; fractions and means are over the call's valid tokens."""

    loss: float  # the returned loss
    pg_loss: float  # the policy-gradient part of it
    pg_clip_frac: float  # tokens where the PPO clip is the active branch (zero gradient)
    ratio_mean: float  # mean of exp(logp - logp_old)
    tis_weight_mean: float  # mean importance weight applied (1.0 with tis off)
    tis_clip_frac: float  # tokens where the clamp changed the TIS weight
    mis_mask_frac: float  # tokens rejected by MIS or the veto
    kl: float | None  # mean KL estimate vs the reference, when logp_ref is given
    entropy: float | None  # mean entropy, when entropy is given
    num_tokens: int  # valid tokens in this call
    num_samples: int  # sequences in this call


def kl_estimate(logp: Tensor, logp_ref: Tensor, kl_type: KlType) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi (see the module docstring)."""
    d = logp - logp_ref
    if kl_type == "k1":
        return d
    if kl_type == "k2":
        return 0.5 * d * d
    if kl_type == "k3":
        return torch.expm1(-d) + d  # expm1 keeps precision for the tiny |d| typical of a few steps
    raise ValueError(f"kl_type={kl_type!r}: use 'k1', 'k2' or 'k3'.")


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
    cfg: PolicyLossConfig,
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
            "logp_rollout is None but tis/mis/mis_veto is on: pass the engine's log-probs or turn them off."
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
    logp_old: Tensor, logp_rollout: Tensor | None, M: Tensor, cfg: PolicyLossConfig
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
    if cfg.mis_veto is not None:
        vetoed = ((is_log < math.log(cfg.mis_veto)) & valid).any(dim=-1)
        keep = keep * (~vetoed).to(M.dtype)[:, None]
    return weight, keep, tis_clipped


def policy_loss(
    logp: Tensor,
    logp_old: Tensor,
    logp_rollout: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    logp_ref: Tensor | None = None,
    entropy: Tensor | None = None,
    *,
    denominator: float | None = None,
) -> tuple[Tensor, PolicyLossStats]:
    """Scalar loss to minimise and its statistics; see the module docstring for every formula.

    ``logp_rollout`` may be None only when tis, mis and mis_veto are all off. ``denominator``: see the
    module docstring (gradient accumulation). Raises ValueError when ``mask`` has no valid token.
    """
    others = {"logp_old": logp_old, "logp_rollout": logp_rollout, "logp_ref": logp_ref, "entropy": entropy}
    _check_inputs(logp, others, advantages, cfg, denominator)
    # At least float32: ratios of bf16 log-probs would round to steps of ~1% (bf16 has 8 mantissa bits).
    dtype = torch.promote_types(logp.dtype, torch.float32)
    logp, logp_old = logp.to(dtype), logp_old.to(dtype)
    logp_rollout = logp_rollout.to(dtype) if logp_rollout is not None else None
    logp_ref = logp_ref.to(dtype) if logp_ref is not None else None
    entropy = entropy.to(dtype) if entropy is not None else None
    M = as_float_mask(mask, logp)
    num_tokens = int((M > 0).sum().item())
    if num_tokens == 0:
        raise ValueError(
            "mask has no valid token: nothing to train on; check the response masks of the batch."
        )
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

    # Statistics: token means over valid tokens, gathered into one tensor for a single device sync.
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
    ).tolist()
    stats = PolicyLossStats(
        loss=values[0],
        pg_loss=values[1],
        pg_clip_frac=values[2],
        ratio_mean=values[3],
        tis_weight_mean=values[4],
        tis_clip_frac=values[5],
        mis_mask_frac=values[6],
        kl=values[7] if logp_ref is not None else None,
        entropy=values[8] if entropy is not None else None,
        num_tokens=num_tokens,
        num_samples=int(logp.shape[0]),
    )
    return loss, stats
