"""The GPU fast path's plumbing (operand layouts, padding, caches), run on CPU.

The Triton quantizers are replaced by eager equivalents with the same outputs and memory layouts, and
``F.scaled_mm`` by a fake that enforces the layout rules cuBLASLt's blockwise kernels impose (as checked by
torch's ScaledBlas.cpp) and computes in float64. The fast path must then agree with the emulation path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from infir2_rl.fp8 import gemm, ops, quant_triton
from infir2_rl.fp8.linear import Fp8InferenceLinear, Fp8Linear
from infir2_rl.fp8.quant import quantize_activation_eager, quantize_weight_blockwise_eager


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rows(
    x2d: torch.Tensor, pow2_scales: bool = False, pad_rows_to: int = 16, round_to: torch.dtype | None = None
) -> tuple[torch.Tensor, ...]:
    x2d = x2d if round_to is None else x2d.to(round_to)
    m = x2d.shape[0]
    xp = F.pad(x2d, (0, 0, 0, _cdiv(m, pad_rows_to) * pad_rows_to - m))
    q, s = quantize_activation_eager(xp, pow2_scales=pow2_scales)
    return q, s.t().contiguous()  # scale stored (Kb, M_pad) like the kernel


def _cols(
    x2d: torch.Tensor, pow2_scales: bool = False, round_to: torch.dtype | None = None
) -> tuple[torch.Tensor, ...]:
    x2d = x2d if round_to is None else x2d.to(round_to)
    m = x2d.shape[0]
    xp = F.pad(x2d, (0, 0, 0, _cdiv(m, 128) * 128 - m))
    qt, st = quantize_activation_eager(xp.t().contiguous(), pow2_scales=pow2_scales)
    return qt, st.t().contiguous()  # (K, M_128) and (M_128 / 128, K)


def _weight(w: torch.Tensor, pow2_scales: bool = False) -> tuple[torch.Tensor, ...]:
    return quantize_weight_blockwise_eager(w, pow2_scales=pow2_scales)


def _weight_t(w: torch.Tensor, pow2_scales: bool = False) -> tuple[torch.Tensor, ...]:
    q, s = _weight(w, pow2_scales)
    return q, s, q.t().contiguous()


def fake_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=torch.bfloat16, **_):  # type: ignore[no-untyped-def]
    m, k = a.shape
    n, kb = b.shape[1], _cdiv(k, 128)
    assert a.stride(1) == 1 and b.stride(0) == 1, "cuBLASLt on sm90 multiplies row-major A by column-major B"
    assert k % 16 == 0 and n % 16 == 0 and b.shape[0] == k
    assert recipe_a == F.ScalingType.BlockWise1x128
    assert scale_a.shape == (m, kb) and scale_a.stride(0) == 1 and (scale_a.stride(1) == m or kb == 1)
    a64 = a.double() * scale_a.double().repeat_interleave(128, 1)[:, :k]
    if recipe_b == F.ScalingType.BlockWise128x128:
        nb, kb4 = _cdiv(n, 128), _cdiv(kb, 4) * 4
        assert scale_b.shape == (kb4, nb) and scale_b.stride(0) == 1 and (scale_b.stride(1) == kb4 or nb == 1)
        full = scale_b[:kb].double().repeat_interleave(128, 0)[:k].repeat_interleave(128, 1)[:, :n]
    else:
        assert recipe_b == F.ScalingType.BlockWise1x128
        assert scale_b.shape == (n, kb) and scale_b.stride(0) == 1 and (scale_b.stride(1) == n or kb == 1)
        full = scale_b.double().t().repeat_interleave(128, 0)[:k]
    return (a64 @ (b.double() * full)).to(output_dtype)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"rows": 0, "dual": 0, "transpose": 0}

    def dual(
        x2d: torch.Tensor,
        pow2_scales: bool = False,
        pad_rows_to: int = 16,
        round_to: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, ...]:
        calls["dual"] += 1
        return (*_rows(x2d, pow2_scales, pad_rows_to, round_to), *_cols(x2d, pow2_scales, round_to))

    def rows(
        x2d: torch.Tensor,
        pow2_scales: bool = False,
        pad_rows_to: int = 16,
        round_to: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, ...]:
        calls["rows"] += 1
        return _rows(x2d, pow2_scales, pad_rows_to, round_to)

    monkeypatch.setattr(quant_triton, "quantize_rows", rows)
    monkeypatch.setattr(quant_triton, "quantize_cols", _cols)
    monkeypatch.setattr(quant_triton, "quantize_rows_and_cols", dual)

    def transpose(q: torch.Tensor) -> torch.Tensor:
        calls["transpose"] += 1
        return q.t().contiguous()

    monkeypatch.setattr(quant_triton, "quantize_weight", _weight)
    monkeypatch.setattr(quant_triton, "quantize_weight_with_transpose", _weight_t)
    monkeypatch.setattr(quant_triton, "transpose_fp8", transpose)
    monkeypatch.setattr(F, "scaled_mm", fake_scaled_mm, raising=False)
    monkeypatch.setattr(gemm, "fast_path_ok", lambda t, n, k: n % 16 == 0 and k % 16 == 0)
    return calls


def _run(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    return [y, x.grad, layer.weight.grad, layer.bias.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lead", "k", "n"), [((2, 75), 640, 384), ((5,), 256, 128), ((130,), 1536, 272)])
def test_fast_path_agrees_with_emulation(
    fake_gpu: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
    lead: tuple[int, ...],
    k: int,
    n: int,
    dtype: torch.dtype,
) -> None:
    layer = Fp8Linear(k, n, bias=True, dtype=dtype)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(*lead, k).to(dtype)
    dy = torch.randn(*lead, n).to(dtype)
    fast = [*_run(layer, x, dy), Fp8InferenceLinear.from_linear(layer)(x)]
    # W^T is not cached with the weight: the backward made it (once) and let it go
    assert layer._fp8_cache is not None and layer._fp8_cache[1].w_fp8_t is None
    assert fake_gpu["transpose"] == 1
    monkeypatch.setattr(gemm, "fast_path_ok", lambda *a: False)
    emulated = [*_run(layer, x, dy), Fp8InferenceLinear.from_linear(layer)(x)]
    for name, a, b in zip(["y", "dx", "dw", "db", "inference"], fast, emulated):
        assert a.shape == b.shape and a.dtype == b.dtype == dtype, name
        rel = float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())
        assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-6), (name, rel)


def test_shared_input_is_quantized_once(fake_gpu: dict[str, int]) -> None:
    q, k, v = (Fp8InferenceLinear.from_linear(nn.Linear(256, 128)) for _ in range(3))
    x = torch.randn(4, 256)
    first = [m(x) for m in (q, k, v)]
    assert fake_gpu["rows"] == 1
    x.mul_(2.0)  # in place: the cached quantization is stale and must not be used
    second = [m(x) for m in (q, k, v)]
    assert fake_gpu["rows"] == 2
    assert not torch.equal(first[0], second[0])
    assert torch.equal(q(x.clone()), second[0])  # a different tensor object is quantized afresh
    assert fake_gpu["rows"] == 3
    layers = [Fp8Linear(256, 128) for _ in range(2)]
    xg = torch.randn(4, 256, requires_grad=True)
    outs = [m(xg) for m in layers]
    sum(o.square().sum() for o in outs).backward()
    assert fake_gpu["dual"] == 3 and ops._last_input[0] is not None  # X once for both layers, dY once each
    del xg, outs
    assert ops._last_input[0] is None  # dropped with its source tensor


def test_a_callers_fprop_makes_the_shared_inputs_token_tiles_once(
    fake_gpu: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The true_on_policy walk's q, k and v (``fp8_linear(fprop=...)``) read one input: its wgrad tiles are
    made once, each layer's weight gradient is the one it gets alone, and the tiles go with the input."""
    made: list[torch.Size] = []

    def cols(x2d: torch.Tensor, pow2_scales: bool = False, round_to: torch.dtype | None = None) -> tuple:
        made.append(x2d.shape)  # (not the tensor: that would keep the input alive)
        return _cols(x2d, pow2_scales, round_to)

    monkeypatch.setattr(quant_triton, "quantize_cols", cols)
    fprop = ops.fp8_linear_forward  # stands in for the walk's invariant GEMM
    layers = [Fp8Linear(256, n) for n in (128, 32, 32)]

    def grads(x: torch.Tensor, fresh: bool) -> list[torch.Tensor]:
        for m in layers:
            m.zero_grad(set_to_none=True)
        outs = []
        for m in layers:
            if fresh:  # every layer its own input tensor: nothing to share
                x = x.detach().clone().requires_grad_(True)
            w = m._fp8_weight()
            outs.append(ops.fp8_linear(x, m.weight, m.bias, w, False, torch.float32, fprop=fprop))
        sum(o.square().sum() for o in outs).backward()
        return [m.weight.grad for m in layers]

    x = torch.randn(5, 256)
    shared = grads(x.clone().requires_grad_(True), fresh=False)
    assert len(made) == 1
    assert ops._last_cols[0] is None  # dropped with its source tensor
    alone = grads(x, fresh=True)
    assert len(made) == 4
    assert all(torch.equal(a, b) for a, b in zip(shared, alone, strict=True))


def test_autocast_input_is_rounded_by_the_quantizer(fake_gpu: dict[str, int]) -> None:
    # Under autocast an FP32 input is quantized as its BF16 rounding (what a dense autocast linear multiplies)
    # without a BF16 copy per linear: q, k and v must give the outputs and gradients of linears fed an
    # explicit BF16 copy each, whose input gradients come back through the copy's cast and add in FP32.
    torch.manual_seed(0)
    layers = [Fp8Linear(256, n, bias=False) for n in (128, 32, 32)]
    x = torch.randn(3, 40, 256)
    dys = [torch.randn(3, 40, m.out_features) for m in layers]

    def run(explicit_copy: bool) -> list[torch.Tensor]:
        for m in layers:
            m.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_(True)
        if explicit_copy:
            outs = [m(xg.to(torch.bfloat16)) for m in layers]
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs = [m(xg) for m in layers]
        sum((o.float() * dy).sum() for o, dy in zip(outs, dys)).backward()
        assert xg.grad is not None and xg.grad.dtype == torch.float32
        return [*outs, xg.grad, *(m.weight.grad for m in layers)]

    before = fake_gpu["dual"]
    rounded = run(explicit_copy=False)
    assert fake_gpu["dual"] - before == 1 + len(layers)  # X once for the three, dY once each
    copied = run(explicit_copy=True)
    for a, b in zip(rounded, copied):
        assert a is not None and b is not None and a.dtype == b.dtype
        assert torch.equal(a, b)


def test_a_scale_grid_stored_rows_apart_reaches_cublaslt_without_a_copy(fake_gpu: dict[str, int]) -> None:
    """K = 640 (5 K blocks): a contiguous grid is padded per call, a ``scale_grid`` is handed over as a view
    of its own storage; both give the same product."""
    w = torch.randn(384, 640) * 0.05
    q_w, s_w = _weight(w)
    grid = gemm.scale_grid(*s_w.shape, "cpu")
    grid.copy_(s_w)
    assert grid.stride() == (8, 1) and not grid.is_contiguous()
    view = gemm.padded_grid(grid)
    assert view.shape == (3, 8) and view.data_ptr() == grid.data_ptr()
    assert torch.equal(view[:, :5], s_w) and not view[:, 5:].any()
    copied = gemm.padded_grid(s_w)
    assert copied.data_ptr() != s_w.data_ptr() and torch.equal(copied, view)
    q_x, s_x = _rows(torch.randn(20, 640))
    a = gemm.mm_1x128_128x128(q_x, s_x, q_w, grid, torch.float32)
    b = gemm.mm_1x128_128x128(q_x, s_x, q_w, s_w, torch.float32)
    assert torch.equal(a, b)


def test_the_no_workspace_gemm_refuses_what_cublaslt_would_misread() -> None:
    """``cublaslt.mm_1x128_128x128_no_workspace`` hands raw pointers to cuBLASLt: an output dtype it has no type
    for, or a grid still a view of padded storage (rows apart), is refused with one line before any GPU call."""
    from infir2_rl.fp8 import cublaslt

    q_w, s_w = _weight(torch.randn(384, 640) * 0.05)
    q_x, s_x = _rows(torch.randn(20, 640))
    grid = gemm.scale_grid(*s_w.shape, "cpu").copy_(s_w)
    with pytest.raises(ValueError, match="BF16 or FP32"):
        cublaslt.mm_1x128_128x128_no_workspace(q_x, s_x, q_w, gemm.padded_grid(grid), torch.float16)
    with pytest.raises(ValueError, match="w_scale_grid must be contiguous"):
        cublaslt.mm_1x128_128x128_no_workspace(q_x, s_x, q_w, grid, torch.bfloat16)
