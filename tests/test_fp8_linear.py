"""Fp8Linear (training) and Fp8InferenceLinear (W8A8) on CPU: the emulation path of the FP8 GEMMs."""

from __future__ import annotations

import pytest
import torch
from test_fp8_reference import ref_dequant_rows, ref_dequant_weight, ref_quant_rows, ref_quant_weight
from torch import nn

from infir2_rl.fp8.linear import (
    DECODER_LINEAR_NAMES,
    Fp8InferenceLinear,
    Fp8Linear,
    swap_to_fp8_inference,
    swap_to_fp8_training,
)
from infir2_rl.fp8.quant import FP8_DTYPE


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def _ref_fp8_linear(x2d: torch.Tensor, w: torch.Tensor, b: torch.Tensor, dy2d: torch.Tensor) -> dict:
    """Float64 reference of the same quantized math (fprop, dgrad, wgrad, bias grad)."""
    xq, xs = ref_quant_rows(x2d)
    wq, ws = ref_quant_weight(w)
    w_deq = ref_dequant_weight(wq, ws)
    dyq, dys = ref_quant_rows(dy2d)
    dytq, dyts = ref_quant_rows(dy2d.t())  # token-dim tiles = row tiles of the transpose
    xtq, xts = ref_quant_rows(x2d.t())
    return {
        "y": ref_dequant_rows(xq, xs) @ w_deq.t() + b.double(),
        "dx": ref_dequant_rows(dyq, dys) @ w_deq,
        "dw": ref_dequant_rows(dytq, dyts) @ ref_dequant_rows(xtq, xts).t(),
        "db": dy2d.double().sum(0),
    }


@pytest.mark.parametrize(
    ("lead", "k", "n"),
    [
        ((4, 50), 256, 384),
        ((300,), 640, 200),
        ((2, 3), 130, 72),
    ],  # M=200 (partial token tile), K/128=5, edges
)
def test_fp8_linear_forward_and_grads_match_float64_reference(lead: tuple[int, ...], k: int, n: int) -> None:
    layer = Fp8Linear(k, n, bias=True)
    with torch.no_grad():
        layer.weight.mul_(torch.exp(torch.randn(n, 1)))  # rows of different magnitude
        layer.bias.normal_()
    x = torch.randn(*lead, k, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y) * torch.exp(torch.randn(*lead, 1))
    y.backward(dy)
    ref = _ref_fp8_linear(
        x.detach().reshape(-1, k), layer.weight.detach(), layer.bias.detach(), dy.reshape(-1, n)
    )
    assert y.shape == (*lead, n) and y.dtype == torch.float32
    assert _rel(y.reshape(-1, n), ref["y"]) < 1e-5
    assert _rel(x.grad.reshape(-1, k), ref["dx"]) < 1e-5
    assert _rel(layer.weight.grad, ref["dw"]) < 1e-5
    assert _rel(layer.bias.grad, ref["db"]) < 1e-6
    # And against the plain linear: FP8 changes numbers by a few percent, never the direction.
    x2 = x.detach().clone().requires_grad_(True)
    plain = nn.Linear(k, n)
    plain.load_state_dict(layer.state_dict())
    y2 = plain(x2)
    y2.backward(dy)
    for ours, theirs in [(y, y2), (x.grad, x2.grad), (layer.weight.grad, plain.weight.grad)]:
        assert _cos(ours, theirs) > 0.99
    assert _rel(layer.bias.grad, plain.bias.grad) < 1e-6


def test_bf16_master_weight_and_activations() -> None:
    layer = Fp8Linear(256, 128, bias=True, dtype=torch.bfloat16)
    plain = nn.Linear(256, 128, bias=True, dtype=torch.bfloat16)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = layer(x), plain(x2)
    dy = torch.randn_like(y)
    y.backward(dy)
    y2.backward(dy)
    assert y.dtype == x.grad.dtype == layer.weight.grad.dtype == layer.bias.grad.dtype == torch.bfloat16
    for ours, theirs in [(y, y2), (x.grad, x2.grad), (layer.weight.grad, plain.weight.grad)]:
        assert _cos(ours, theirs) > 0.99
    ref = _ref_fp8_linear(x.detach().float(), layer.weight.detach(), layer.bias.detach(), dy.float())
    assert _rel(y, ref["y"]) < 1e-2  # BF16 output rounding


def test_export_fp8_is_what_forward_uses_and_refreshes_after_optimizer_step() -> None:
    layer = Fp8Linear(256, 256, bias=False)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    w_fp8, scale_inv = layer.export_fp8()
    x = torch.randn(8, 256)
    inference = Fp8InferenceLinear(256, 256, bias=False, dtype=torch.float32)
    inference.load_fp8_(w_fp8, scale_inv)
    assert torch.equal(layer(x), inference(x))
    assert layer.export_fp8()[0] is w_fp8  # cached while the weight is unchanged
    layer(x).square().mean().backward()
    opt.step()
    w_new, s_new = layer.export_fp8()
    assert not torch.equal(w_new.view(torch.uint8), w_fp8.view(torch.uint8)) or not torch.equal(
        s_new, scale_inv
    )
    inference.load_fp8_(w_new, s_new)
    assert torch.equal(layer(x), inference(x))


def test_inference_linear_equals_training_linear_forward() -> None:
    for bias in (True, False):
        layer = Fp8Linear(640, 200, bias=bias)
        inference = Fp8InferenceLinear.from_linear(layer)
        x = torch.randn(3, 7, 640)
        assert torch.equal(layer(x), inference(x))
        with torch.no_grad():
            assert torch.equal(layer(x), inference(x))
        plain = nn.Linear(640, 200, bias=bias)
        plain.load_state_dict(layer.state_dict())
        assert torch.equal(Fp8InferenceLinear.from_linear(plain)(x), inference(x))


def test_inference_linear_keeps_formats_under_dtype_casts() -> None:
    inference = Fp8InferenceLinear.from_linear(nn.Linear(256, 128))
    scale_before = inference.weight_scale_inv.clone()
    inference.to(torch.bfloat16)
    assert inference.weight.dtype == FP8_DTYPE and inference.weight_scale_inv.dtype == torch.float32
    assert torch.equal(inference.weight_scale_inv, scale_before) and inference.bias.dtype == torch.bfloat16
    out = inference(torch.randn(4, 256, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="weight_fp8"):
        inference.load_fp8_(torch.zeros(128, 256), scale_before)
    with pytest.raises(ValueError, match="weight_scale_inv shape"):
        inference.load_fp8_(inference.weight.clone(), torch.ones(2, 2))


def _tiny_qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    return Qwen2ForCausalLM(config)


def test_swap_touches_only_decoder_linears_and_shares_parameters() -> None:
    model = _tiny_qwen2()
    params_before = {name: id(p) for name, p in model.named_parameters()}
    swapped = swap_to_fp8_training(model)
    assert len(swapped) == 2 * len(DECODER_LINEAR_NAMES)
    assert all(name.rsplit(".", 1)[-1] in DECODER_LINEAR_NAMES for name in swapped)
    assert {name: id(p) for name, p in model.named_parameters()} == params_before
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert swap_to_fp8_training(model) == []  # idempotent
    swapped_inf = swap_to_fp8_inference(model)
    assert swapped_inf == swapped
    assert isinstance(model.model.layers[0].mlp.down_proj, Fp8InferenceLinear)


def test_tiny_qwen2_trains_with_fp8_linears() -> None:
    model = _tiny_qwen2()
    swap_to_fp8_training(model)
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses


def test_token_tiles_made_later_are_made_once_for_all_claimants_then_dropped() -> None:
    # ops.TokenTilesLater: two FP8 linears reading one input (gate and up) share one making of the tiles;
    # the tiles are held only until the last claimant has taken them, and a new making follows.
    from infir2_rl.fp8 import ops

    made: list[tuple[torch.Tensor, ...]] = []

    def make(*inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        made.append(inputs)
        return inputs[0] * 2, inputs[0] + 1

    x = torch.arange(4.0)
    later = ops.TokenTilesLater(make, (x,))
    first, second = later.claim(), later.claim()
    a = first(x)
    assert len(made) == 1 and torch.equal(a[0], x * 2)
    assert second(x) is a and len(made) == 1  # the second claimant takes the same tiles
    assert first.tiles is None  # dropped after the last claimant
    third = later.claim()
    assert third(x) is not a and len(made) == 2
