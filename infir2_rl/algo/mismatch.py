"""Train/rollout mismatch metrics, logged every RL step.

The rollout engine samples token y with probability mu(y) and reports log mu(y) (``logp_rollout``);
the trainer recomputes log pi(y) on the same weights and tokens (``logp_train``). With identical
numerics they agree; FP8 vs BF16 kernels, a different temperature or a stale weight push make
them drift, and a late rise of the drift preceded the collapses reported by Jet-RL and slime.

With r = logp_train - logp_rollout per valid token (tokens sampled from mu):
    abs_logp_diff_mean / _max   mean and max of |r|            (slime's CI gate: mean < 0.1)
    is_ratio_min / _max / _mean min, max and mean of exp(r)    (the TIS weight before clamping)
    tis_clip_frac               fraction of tokens with exp(r) outside [tis_low, tis_high]
    k3                          mean of exp(r) - 1 - r
K3 convention: because the tokens come from mu, E_mu[exp(r)] = E_mu[pi/mu] = 1, hence
E_mu[exp(r) - 1 - r] = E_mu[log mu - log pi] = KL(mu || pi) = KL(rollout || train). So k3 is an
unbiased estimator of KL(rollout || train) (exactly, when pi > 0 wherever mu > 0), and each term
is >= 0, which keeps its variance low. Typical dense-model values are 1e-5..1e-3; NeMo-RL gates at 2e-3.
Everything is computed in float64 with expm1: k3 ~ r^2 / 2 = 5e-7 for r = 1e-3, and float32's
exp(r) - 1 - r would lose ~10% of that to rounding of exp(r) near 1.

Masked tokens are excluded from every statistic. A call with no valid token raises ValueError:
zeros would read as "no mismatch", and min/max of nothing has no honest value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from infir2_rl.algo.masked import as_float_mask


@dataclass(kw_only=True)
class MismatchStats:
    """Mismatch between the trainer's and the engine's log-probs over the valid tokens of a batch."""

    abs_logp_diff_mean: float
    abs_logp_diff_max: float
    k3: float  # estimate of KL(rollout || train), see the module docstring
    is_ratio_min: float
    is_ratio_max: float
    is_ratio_mean: float
    tis_clip_frac: float
    num_tokens: int

    def as_metrics(self, prefix: str) -> dict[str, float]:
        """``{prefix}/<statistic>`` for every statistic (``metrics.names.MISMATCH`` or ``MISMATCH_DENSE``)."""
        return {f"{prefix}/{k}": float(v) for k, v in self.__dict__.items() if k != "num_tokens"}


@torch.no_grad()
def mismatch_metrics(
    logp_train: Tensor,
    logp_rollout: Tensor,
    mask: Tensor,
    tis_low: float = 0.0,
    tis_high: float = 2.0,
) -> MismatchStats:
    """Mismatch statistics of (B, T) trainer vs engine log-probs of the same sampled tokens."""
    if logp_train.shape != logp_rollout.shape:
        raise ValueError(
            f"logp_train {tuple(logp_train.shape)} and logp_rollout {tuple(logp_rollout.shape)}: shapes must match."
        )
    if not tis_high > tis_low:
        raise ValueError(f"tis_high={tis_high}: must be > tis_low={tis_low}.")
    valid = as_float_mask(mask, logp_train) > 0
    r = (logp_train.double() - logp_rollout.double())[valid]  # 1-D over valid tokens only
    if r.numel() == 0:
        raise ValueError("mask has no valid token: mismatch metrics need at least one response token.")
    ratio = torch.exp(r)
    k3 = torch.expm1(r) - r
    clipped = (ratio < tis_low) | (ratio > tis_high)
    values = torch.stack(
        [
            r.abs().mean(),
            r.abs().max(),
            k3.mean(),
            ratio.min(),
            ratio.max(),
            ratio.mean(),
            clipped.double().mean(),
        ]
    ).tolist()
    return MismatchStats(
        abs_logp_diff_mean=values[0],
        abs_logp_diff_max=values[1],
        k3=values[2],
        is_ratio_min=values[3],
        is_ratio_max=values[4],
        is_ratio_mean=values[5],
        tis_clip_frac=values[6],
        num_tokens=int(r.numel()),
    )
