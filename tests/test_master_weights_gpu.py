"""The flat AdamW of a BF16 model's FP32 masters (trainers/flat_adamw.py) against torch's fused AdamW, on a GPU:
the same updates within FP32 rounding (clipped, weight decay, bias corrections), the BF16 copy written, a
non-finite norm skipping the step, and optimizer states that load into either."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from infir2_rl.config import OptimizerConfig
from infir2_rl.trainers.flat_adamw import FlatAdamW
from infir2_rl.trainers.optim import build_optimizer, step_unless_nonfinite
from infir2_rl.trainers.torch.master_weights import MasterWeights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(96, 300), nn.LayerNorm(300), nn.Linear(300, 70, bias=False)).cuda()


def test_flat_adamw_updates_as_torchs_fused_adamw() -> None:
    cfg = OptimizerConfig(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-8)
    reference = _model()
    ref_params = list(reference.parameters())
    ref_opt = build_optimizer(ref_params, cfg)
    assert ref_opt.defaults["fused"]
    model = _model()
    masters = MasterWeights(model)
    opt = build_optimizer(masters.optimizer_params, cfg, masters)
    assert isinstance(opt, FlatAdamW)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(5):
        grads = [
            torch.randn(p.shape, device="cuda", generator=gen) * (0.01 if step % 2 else 1.0)
            for p in ref_params
        ]
        if step == 3:
            grads[1][0] = float("nan")  # a non-finite norm: both skip
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g.clone()
        masters.ensure_grads()
        buffers = [seg.grads for seg in masters.segments]
        for m, g in zip(masters.optimizer_params, grads, strict=True):
            assert m.grad is not None
            m.grad.copy_(g)
        for optimizer, params, norm in (
            (ref_opt, ref_params, torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))),
            (opt, masters.optimizer_params, masters.grad_norm()),
        ):
            skipped = step_unless_nonfinite(optimizer, params, norm, grad_clip=1.0)
            assert skipped == (step == 3)
        assert all(seg.grads is b for seg, b in zip(masters.segments, buffers, strict=True))
        for p, m in zip(ref_params, masters.optimizer_params, strict=True):
            torch.testing.assert_close(m, p.detach(), rtol=2e-6, atol=1e-7)
        for p, m in zip(model.parameters(), masters.optimizer_params, strict=True):
            assert p.dtype == torch.bfloat16 and torch.equal(p, m.detach().to(torch.bfloat16))
        masters.zero_grad()
    assert opt.steps == 4 and float(opt.state[masters.optimizer_params[0]]["step"]) == 4.0

    # Optimizer states move between the two: FlatAdamW -> torch AdamW and back.
    sd = opt.state_dict()
    other = build_optimizer(ref_params, cfg)
    other.load_state_dict(sd)
    for p, m in zip(ref_params, masters.optimizer_params, strict=True):
        torch.testing.assert_close(other.state[p]["exp_avg"], opt.state[m]["exp_avg"], rtol=0, atol=0)
        assert float(other.state[p]["step"]) == 4.0
    fresh_model = _model()
    fresh = MasterWeights(fresh_model)
    again = build_optimizer(fresh.optimizer_params, cfg, fresh)
    assert isinstance(again, FlatAdamW)
    again.load_state_dict(ref_opt.state_dict())
    assert again.steps == 4
    for p, m in zip(ref_params, fresh.optimizer_params, strict=True):
        torch.testing.assert_close(
            again.state[m]["exp_avg_sq"], ref_opt.state[p]["exp_avg_sq"], rtol=0, atol=0
        )
    assert all(v.abs().sum() > 0 for _, v in again.moments)  # the loaded values are in the buffers it reads
