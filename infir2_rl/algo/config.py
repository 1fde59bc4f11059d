"""The RL algorithm's knobs: one pydantic class, validated once, read by the loss and the stage loop.

`config/` imports it as the `algorithm:` section of an RL stage; `algo/` imports nothing of `config/`.
Formulas for every knob are in `algo/losses.py`'s module docstring.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from infir2_rl.strict_model import StrictModel

MisLevel = Literal["off", "token", "sequence", "geometric"]
# Schulman's estimators of KL(pi || pi_ref); "low_var_kl" is k3 with verl's clamps (see losses.kl_estimate).
KlType = Literal["k1", "k2", "k3", "low_var_kl"]
LossReduction = Literal["sample_token_mean", "token_mean"]


# StrictModel: unknown keys are errors, floats finite, no number read from a boolean (strict_model.py).
class AlgorithmConfig(StrictModel):
    """GRPO with clip-higher, TIS/MIS against the engine, optional KL and entropy terms. The defaults are
    InfiR2's RL stages (clip 0.2 / 0.28, TIS cap 2, no KL, no entropy bonus)."""

    # Divide group-centred rewards by the group std (GRPO); False = Dr.GRPO-style mean-centring only.
    normalize_std: bool = True
    # Lower clip of the importance ratio (1 - eps_clip_low).
    eps_clip_low: float = Field(default=0.2, ge=0, lt=1)
    # Upper clip of the importance ratio (1 + eps_clip_high), "clip-higher".
    eps_clip_high: float = Field(default=0.28, ge=0)
    # Truncated importance sampling against the rollout engine's log-probs.
    tis: bool = True
    # TIS weight floor (slime uses 0.5 in production scripts; InfiR2 caps only).
    tis_low: float = Field(default=0.0, ge=0)
    # TIS weight cap C.
    tis_high: float = Field(default=2.0, gt=0)
    # Masked importance sampling: "off", or the level ("token" / "sequence" / "geometric") at which tokens
    # whose train/rollout ratio lies outside [mis_low, mis_high] are masked.
    mis: MisLevel = "off"
    mis_low: float = Field(default=0.5, ge=0)
    mis_high: float = Field(default=2.0, gt=0)
    # KL penalty against the stage's starting model; 0 builds and runs no reference model.
    kl_coef: float = Field(default=0.0, ge=0)
    # KL estimator used when kl_coef > 0.
    kl_type: KlType = "k3"
    # Entropy bonus coefficient (entropy of the tempered distribution at response tokens).
    entropy_coef: float = Field(default=0.0, ge=0)
    # Loss reduction: mean over each sample's tokens then over samples, or over all tokens.
    loss_reduction: LossReduction = "sample_token_mean"

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        if self.tis and self.tis_low >= self.tis_high:
            raise ValueError(
                f"algorithm.tis_low={self.tis_low}: must be below algorithm.tis_high={self.tis_high}"
            )
        if self.mis != "off" and self.mis_low >= self.mis_high:
            raise ValueError(
                f"algorithm.mis_low={self.mis_low}: must be below algorithm.mis_high={self.mis_high}"
            )
        return self

    @property
    def needs_rollout_logp(self) -> bool:
        """Whether the loss reads the engine's log-probs with this config."""
        return self.tis or self.mis != "off"

    @property
    def needs_reference(self) -> bool:
        """Whether the trainer must hold a frozen reference model (a KL penalty is on)."""
        return self.kl_coef > 0

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss needs the per-token entropy (an entropy bonus is on)."""
        return self.entropy_coef > 0
