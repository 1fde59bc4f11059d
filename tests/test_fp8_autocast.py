"""Fp8Linear under autocast returns the autocast dtype (as nn.Linear does) and quantizes its input rounded
to that dtype (as a dense autocast linear multiplies it, and as a BF16 engine holds it): with FP32 input it
computes exactly what it computes without autocast on the BF16-rounded input, and its W8A8 scoring path
equals the engine's ``Fp8InferenceLinear`` on BF16 input bit for bit."""

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
    x, g = torch.randn(64, 256), torch.randn(64, 128).bfloat16().float()
    y_ref, dx_ref, dw_ref = _run(layer, x.bfloat16(), g, autocast=False)  # BF16 input, no autocast
    y16, dx16, dw16 = _run(layer, x, g, autocast=True)  # FP32 input under autocast
    assert y_ref.dtype == torch.bfloat16 and y16.dtype == torch.bfloat16
    assert dx16.dtype == torch.float32 and dw16.dtype == torch.float32  # grads in the inputs' dtypes
    torch.testing.assert_close(y16, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(dx16, dx_ref.float(), rtol=0, atol=0)
    torch.testing.assert_close(dw16, dw_ref, rtol=0, atol=0)
    y32, _, _ = _run(layer, x, g, autocast=False)  # FP32 without autocast: the FP32 values are quantized
    assert y32.dtype == torch.float32 and not torch.equal(y32.bfloat16(), y16)


def test_autocast_scoring_equals_the_engines_w8a8_on_bf16_input() -> None:
    from infir2_rl.fp8.linear import Fp8InferenceLinear

    torch.manual_seed(1)
    layer = Fp8Linear(384, 256, bias=True)
    with torch.no_grad():
        layer.bias.normal_()  # a bias that BF16 rounds (q|k|v's)
    engine = Fp8InferenceLinear.from_linear(layer)
    engine.bias = torch.nn.Parameter(layer.bias.detach().bfloat16(), requires_grad=False)  # a BF16 engine's
    x = torch.randn(32, 384)  # the trainer's FP32 residual-stream activations
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            trainer = layer(x)
        rollout = engine(x.bfloat16())
    assert trainer.dtype == rollout.dtype == torch.bfloat16
    # The emulation added the FP32 bias to the FP32 product and rounded once: ~1/4 of these outputs were one
    # BF16 ulp off the engine's, which adds the BF16 bias to the rounded product (as the GPU path does).
    assert torch.equal(trainer, rollout)
