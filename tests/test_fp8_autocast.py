"""Fp8Linear under autocast returns the autocast dtype (as nn.Linear does) with gradients of the FP32-output
path up to that rounding; without autocast nothing changes."""

from __future__ import annotations

import torch

from infir2_rl.fp8.linear import Fp8Linear


def _run(layer: Fp8Linear, x: torch.Tensor, g: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    (y.float() * g).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    out = (y.detach(), x.grad, layer.weight.grad.clone())
    layer.weight.grad = None
    return out


def test_autocast_output_dtype_and_gradients() -> None:
    torch.manual_seed(0)
    layer = Fp8Linear(256, 128, bias=False)
    # g exactly representable in BF16: the BF16 output's gradient is then the same dy as the FP32 one's.
    x, g = torch.randn(64, 256), torch.randn(64, 128).bfloat16().float()
    y32, dx32, dw32 = _run(layer, x, g, autocast=False)
    y16, dx16, dw16 = _run(layer, x, g, autocast=True)
    assert y32.dtype == torch.float32 and y16.dtype == torch.bfloat16
    assert dx16.dtype == torch.float32 and dw16.dtype == torch.float32  # grads in the inputs' dtypes
    # The same FP8 GEMM; the output is rounded to BF16 (relative 2^-9) and nothing else differs.
    torch.testing.assert_close(y16.float(), y32, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(dx16, dx32, rtol=0, atol=0)
    torch.testing.assert_close(dw16, dw32, rtol=0, atol=0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the W8A8 inference path too
        assert layer(x).dtype == torch.bfloat16
