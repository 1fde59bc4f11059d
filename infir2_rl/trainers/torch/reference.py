"""The frozen reference policy of a KL penalty (``algorithm.kl_coef > 0``), held beside the trained model.

It is the stage's starting checkpoint (``model.path``; in a pipeline the previous stage's final weights,
and on resume still the stage's start, not the checkpoint resumed from), loaded once and never updated.
It runs the trainer's precision flow, so the KL measures drift of the weights and not of the numerics:
FP32 parameters (BF16 ones where the trainer's model is BF16, ``trainer.param_dtype``), forwards under the
trainer's autocast dtype, and the same blockwise-FP8 decoder linears
(``Fp8Linear``, same scale rounding) when the trainer trains in FP8. It has no optimizer, no gradients
(``requires_grad=False`` on every parameter) and stays in eval mode; under FSDP2 it is sharded like the
trained model (and gathers the same ``trainer.fsdp_param_dtype``), so each rank holds 1/N of it.
"""

from __future__ import annotations

import logging

import torch
from transformers import PreTrainedModel

from infir2_rl.config import ModelConfig
from infir2_rl.fp8.linear import swap_to_fp8_training
from infir2_rl.trainers.torch import distributed as D

log = logging.getLogger(__name__)


def load_reference_model(
    model_cfg: ModelConfig,
    *,
    fp8: bool,
    pow2_scales: bool,
    device: torch.device,
    fsdp: bool,
    param_dtype: torch.dtype = torch.float32,
    bf16_model: bool = False,
) -> PreTrainedModel:
    """The frozen reference model from ``model_cfg.path`` (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_cfg.path,
        dtype=torch.float32,
        attn_implementation=model_cfg.attn_implementation,
        local_files_only=True,
    )
    model.config.use_cache = False
    model.requires_grad_(False)
    if fp8:
        swap_to_fp8_training(model, pow2_scales=pow2_scales)
    model.to(device)  # type: ignore[arg-type]  # transformers' stub of .to is too narrow
    if bf16_model:  # the trained model is a BF16 model (trainer.param_dtype): the same values it starts from
        from infir2_rl.trainers.torch.master_weights import computed_params

        for p in computed_params(model):
            p.data = p.data.to(torch.bfloat16)
    if fsdp:
        D.apply_fsdp2(model, param_dtype)
    model.eval()
    log.info("reference model for the KL penalty: %s (fp8=%s, fsdp=%s)", model_cfg.path, fp8, fsdp)
    return model
