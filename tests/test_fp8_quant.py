"""Blockwise FP8 quantizers (CPU path) against the independent float64 model in test_fp8_reference."""

from __future__ import annotations

import pytest
import torch
from test_fp8_reference import (
    e4m3_grid,
    ref_dequant_rows,
    ref_dequant_weight,
    ref_quant_rows,
    ref_quant_weight,
)

from infir2_rl.fp8.quant import (
    FP8_DTYPE,
    dequantize_activation,
    dequantize_weight_blockwise,
    fake_quantize_tiles,
    quantize_activation,
    quantize_weight_blockwise,
    round_scale_up_pow2,
)

# (N, K): aligned, edge blocks on both dims, K/128 = 5 (not a multiple of 4), tiny.
WEIGHT_SHAPES = [(256, 384), (200, 330), (384, 640), (7, 5)]


def _random_weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    # Heavy-tailed and with per-block magnitude changes, so blocks get different scales.
    w = torch.randn(n, k) * torch.exp(torch.randn(n, 1)) * 0.05
    w[::37] *= 30.0
    return w.to(dtype)


def _assert_within_e4m3_bound(x: torch.Tensor, deq: torch.Tensor, scale_full: torch.Tensor) -> None:
    """|deq - x| <= 2^-4 |x| in e4m3's normal range, <= 2^-10 * scale below it (subnormals)."""
    x64, err = x.double(), (deq.double() - x.double()).abs()
    bound = torch.maximum(x64.abs() * 2.0**-4, scale_full * 2.0**-10) * (1 + 1e-6)
    worst = (err - bound).max().item()
    assert worst <= 0, f"error exceeds the e4m3 bound by {worst}"


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", WEIGHT_SHAPES)
def test_weight_quant_matches_float64_reference(
    shape: tuple[int, int], dtype: torch.dtype, pow2: bool
) -> None:
    w = _random_weight(*shape, dtype)
    w_fp8, scale_inv = quantize_weight_blockwise(w, pow2_scales=pow2)
    assert w_fp8.dtype == FP8_DTYPE and w_fp8.shape == w.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    q_ref, s_ref = ref_quant_weight(w, pow2=pow2)
    assert torch.equal(scale_inv.double(), s_ref)
    assert torch.equal(w_fp8.double(), q_ref)
    deq = dequantize_weight_blockwise(w_fp8, scale_inv)
    assert torch.allclose(deq.double(), ref_dequant_weight(q_ref, s_ref), rtol=1e-6, atol=0)  # code x scale
    full = ref_dequant_weight(torch.ones_like(q_ref), s_ref)
    _assert_within_e4m3_bound(w, deq, full)
    if pow2:
        assert torch.equal(scale_inv, torch.exp2(torch.log2(scale_inv).round()))


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(3, 5, 256), (17, 640), (9, 300), (4, 1)])
def test_activation_quant_matches_float64_reference(shape: tuple[int, ...], pow2: bool) -> None:
    x = (torch.randn(shape) * torch.exp(2 * torch.randn(*shape[:-1], 1))).to(torch.bfloat16)
    x_fp8, scale = quantize_activation(x, pow2_scales=pow2)
    k = shape[-1]
    assert x_fp8.shape == x.shape and x_fp8.dtype == FP8_DTYPE
    assert scale.shape == (*shape[:-1], -(-k // 128)) and scale.dtype == torch.float32
    q_ref, s_ref = ref_quant_rows(x.reshape(-1, k), pow2=pow2)
    assert torch.equal(scale.reshape(-1, scale.shape[-1]).double(), s_ref)
    assert torch.equal(x_fp8.reshape(-1, k).double(), q_ref)
    deq = dequantize_activation(x_fp8, scale, dtype=torch.float64).reshape(-1, k)
    _assert_within_e4m3_bound(x.reshape(-1, k), deq, ref_dequant_rows(torch.ones_like(q_ref), s_ref))


def test_zero_blocks_get_scale_one_and_stay_zero() -> None:
    w = _random_weight(256, 384, torch.float32)
    w[:128, 128:256] = 0.0  # one whole zero block
    w_fp8, scale_inv = quantize_weight_blockwise(w)
    assert scale_inv[0, 1] == 1.0 and torch.isfinite(scale_inv).all()
    assert (w_fp8[:128, 128:256].float() == 0).all()
    assert torch.isfinite(dequantize_weight_blockwise(w_fp8, scale_inv)).all()
    x = torch.randn(4, 384)
    x[1] = 0.0
    x[2, 256:] = 0.0
    x_fp8, scale = quantize_activation(x)
    assert scale[1].tolist() == [1.0, 1.0, 1.0] and scale[2, 2] == 1.0
    assert torch.isfinite(dequantize_activation(x_fp8, scale)).all()


@pytest.mark.parametrize("pow2", [False, True])
def test_a_block_whose_amax_over_448_underflows_gets_scale_one_not_nan(pow2: bool) -> None:
    # FP32 subnormals below ~6e-43 (FP32 masters, CPU-emulated gradient tiles): amax / 448 rounds to 0, and a
    # scale of 0 used to turn the whole block into NaN (0 / 0) although every value in it is finite.
    w = torch.zeros(128, 256)
    w[0, 0] = 1e-43
    w[:, 128:] = torch.randn(128, 128)  # a normal block beside it keeps its own scale
    w_fp8, scale_inv = quantize_weight_blockwise(w, pow2_scales=pow2)
    assert scale_inv[0, 0] == 1.0 and scale_inv[0, 1] < 1.0
    assert torch.isfinite(dequantize_weight_blockwise(w_fp8, scale_inv)).all()
    x = torch.zeros(2, 256)
    x[0, 5] = -3e-44
    x[1] = torch.randn(256)
    x_fp8, scale = quantize_activation(x, pow2_scales=pow2)
    assert scale[0].tolist() == [1.0, 1.0]
    assert (x_fp8[0].float() == 0).all()  # below e4m3's smallest subnormal at scale 1
    assert torch.isfinite(fake_quantize_tiles(x, pow2_scales=pow2)).all()


def _near_midpoints(amax: float) -> torch.Tensor:
    """FP32 values x next to s * m for every e4m3 rounding midpoint m (s = amax / 448), where the
    product rule round(x * RN(1 / s)) and the exact quotient round(x / s) can round to different codes."""
    grid, _ = e4m3_grid()
    mids = (grid[:-1] + grid[1:]) / 2
    bits = (mids * (amax / 448.0)).to(torch.float32).view(torch.int32)
    near = torch.cat([bits + d for d in range(-3, 4)]).view(torch.float32)
    return near[(near > 0) & (near < amax)]


@pytest.mark.parametrize("amax", [1.0009765625, 3.3, 0.7071])
def test_codes_are_x_times_the_rounded_reciprocal_not_the_quotient(amax: float) -> None:
    """The rule is codes = round_e4m3(RN(x * RN(1 / scale))) (Transformer Engine's and DeepSeek's), not the
    correctly rounded quotient x / scale that the quantizers used until session 58: values next to e4m3
    rounding midpoints, where the two differ, must follow the product (the old rule fails here)."""
    x = _near_midpoints(amax)
    x = torch.cat([x, x[: (-x.numel()) % 127]]).view(-1, 127)
    x = torch.cat([torch.full((x.shape[0], 1), amax), x], dim=1)  # each row's amax sets its scale
    codes, scale = quantize_activation(x)
    s = torch.tensor(amax, dtype=torch.float32) / torch.tensor(448.0)
    assert (scale == s).all()
    r = torch.tensor(1.0) / s
    product = (x * r).clamp(-448, 448).to(FP8_DTYPE)
    quotient = (x.double() / s.double()).float().clamp(-448, 448).to(FP8_DTYPE)
    assert torch.equal(codes.view(torch.uint8), product.view(torch.uint8))
    assert (product.view(torch.uint8) != quotient.view(torch.uint8)).sum() > 0  # the case is exercised
    w_codes, _ = quantize_weight_blockwise(x[:, :128])  # weights: the same rule, per 128x128 block
    w_product = (x[:, :128] * r).to(FP8_DTYPE)
    assert torch.equal(w_codes.view(torch.uint8), w_product.view(torch.uint8))


@pytest.mark.parametrize("pow2", [False, True])
def test_a_subnormal_scale_is_raised_to_the_smallest_normal(pow2: bool) -> None:
    """amax / 448 below 2^-126 (an FP32 subnormal) would make 1 / scale overflow to inf and every code 448 or
    NaN; the scale is raised to 2^-126, where x * 2^126 is exact and at most 448."""
    x = torch.zeros(1, 256)
    x[0, :3] = torch.tensor([1e-37, -5e-38, 2e-39])  # amax / 448 ~ 2.2e-40: subnormal
    x[0, 128:] = torch.randn(128)
    codes, scale = quantize_activation(x, pow2_scales=pow2)
    assert scale[0, 0] == 2.0**-126 and scale[0, 1] < 1.0
    expect = (x[0, :3].double() * 2.0**126).float().to(FP8_DTYPE)
    assert torch.equal(codes[0, :3].view(torch.uint8), expect.view(torch.uint8))
    assert codes[0, 0].float() > 0 and torch.isfinite(dequantize_activation(codes, scale)).all()
    w = torch.zeros(128, 128)
    w[5, 7] = 3e-37
    w_codes, w_scale = quantize_weight_blockwise(w, pow2_scales=pow2)
    assert w_scale[0, 0] == 2.0**-126
    assert w_codes[5, 7] == (torch.tensor(3e-37).double() * 2.0**126).float().to(FP8_DTYPE)


def test_block_amax_maps_to_448_and_scale_is_amax_over_448() -> None:
    w = _random_weight(128, 256, torch.float32)
    w_fp8, scale_inv = quantize_weight_blockwise(w)
    for j in range(2):
        blk = w[:, j * 128 : (j + 1) * 128]
        assert scale_inv[0, j] == (blk.abs().max() / 448.0).float()
        assert w_fp8[:, j * 128 : (j + 1) * 128].float().abs().max() == 448.0


def test_edge_block_padding_changes_nothing() -> None:
    """An edge block quantizes as if zero-padded to 128x128: compare with explicit padding."""
    w = _random_weight(200, 330, torch.float32)
    padded = torch.nn.functional.pad(w, (0, 384 - 330, 0, 256 - 200))
    q_edge, s_edge = quantize_weight_blockwise(w)
    q_pad, s_pad = quantize_weight_blockwise(padded)
    assert torch.equal(s_edge, s_pad)
    assert torch.equal(q_edge.view(torch.uint8), q_pad[:200, :330].view(torch.uint8))


def test_round_scale_up_pow2_is_exact() -> None:
    s = torch.tensor([0.25, 0.3, 1.0, 1.0000001, 3.0, 2.0**-126, 5e-39, 448.0])
    expect = torch.tensor([0.25, 0.5, 1.0, 2.0, 4.0, 2.0**-126, 2.0**-126, 512.0])
    assert torch.equal(round_scale_up_pow2(s), expect)


def test_bad_shapes_are_refused_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight_blockwise(torch.randn(2, 3, 4))
    w_fp8, scale_inv = quantize_weight_blockwise(torch.randn(256, 256))
    with pytest.raises(ValueError, match="weight_scale_inv shape"):
        dequantize_weight_blockwise(w_fp8, scale_inv[:1])
    x_fp8, scale = quantize_activation(torch.randn(3, 256))
    with pytest.raises(ValueError, match="activation scale shape"):
        dequantize_activation(x_fp8, scale[:, :1])
    with pytest.raises(ValueError, match="block_size=0"):
        quantize_weight_blockwise(torch.randn(4, 4), block_size=0)


@pytest.mark.parametrize("shape", [(256, 384), (200, 330), (130, 5), (1, 129)])
@pytest.mark.parametrize("pow2", [False, True])
def test_fake_quantize_tiles_equals_quantize_then_dequantize(shape: tuple[int, int], pow2: bool) -> None:
    """The emulation's fused quantize-dequantize gives the same FP32 numbers as the two public steps,
    along the feature dim (fprop/dgrad tiles) and along the token dim (wgrad tiles, via the transpose)."""
    torch.manual_seed(1)
    x = _random_weight(*shape, torch.float32)
    x[0, :3] = 0.0  # zeros, and a subnormal-range value, inside otherwise normal tiles
    x[-1, -1] = 1e-9
    rows = dequantize_activation(*quantize_activation(x, pow2_scales=pow2))
    assert torch.equal(fake_quantize_tiles(x, dim=-1, pow2_scales=pow2), rows)
    cols = dequantize_activation(*quantize_activation(x.t().contiguous(), pow2_scales=pow2)).t()
    assert torch.equal(fake_quantize_tiles(x, dim=0, pow2_scales=pow2), cols)


def test_fake_quantize_tiles_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="2-D"):
        fake_quantize_tiles(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="dim=2"):
        fake_quantize_tiles(torch.zeros(2, 3), dim=2)
