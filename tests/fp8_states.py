"""Test helper (not a test module): the FP8 weight export of a trainer whose weights differ from an engine's."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from infir2_rl.fp8.checkpoint import fp8_state_from_model
from infir2_rl.fp8.linear import swap_to_fp8_training
from infir2_rl.models.factory import load_model


def perturbed_fp8_state(model_dir: Path, seed: int) -> list[tuple[str, Tensor]]:
    """FP8 export of the model at ``model_dir`` with every weight perturbed by ``seed`` (0.01 x N(0, 1))."""
    model, _ = load_model(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    swap_to_fp8_training(model)
    return list(fp8_state_from_model(model))
