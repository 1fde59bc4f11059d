"""The guarded optimizer step: fused AdamW with the skip decided on the device equals the host-checked path."""

from __future__ import annotations

import torch

from infir2_rl.trainers.optim import step_unless_nonfinite


def _opt(p: torch.nn.Parameter, fused: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW([p], lr=0.1, weight_decay=0.01, fused=fused or None, foreach=False)


def test_fused_step_skips_non_finite_and_matches_the_host_checked_path() -> None:
    torch.manual_seed(0)
    start = torch.randn(300)
    grads = [torch.randn(300) * 5, torch.full((300,), float("nan")), torch.randn(300), torch.randn(300)]
    grads[3][7] = float("inf")
    results = {}
    for fused in (False, True):
        p = torch.nn.Parameter(start.clone())
        opt = _opt(p, fused)
        skipped = []
        for g in grads:
            p.grad = g.clone()
            before = p.detach().clone()
            skipped.append(step_unless_nonfinite(opt, [p], p.grad.norm(), grad_clip=1.0))
            if skipped[-1]:
                assert torch.equal(p.detach(), before)
            p.grad = None
        assert skipped == [False, True, False, True]
        assert float(opt.state[p]["step"]) == 2  # a skipped step does not count
        assert not hasattr(opt, "found_inf")
        results[fused] = (
            p.detach().clone(),
            opt.state[p]["exp_avg"].clone(),
            opt.state[p]["exp_avg_sq"].clone(),
        )
    for a, b in zip(results[False], results[True], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
