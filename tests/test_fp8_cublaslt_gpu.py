"""On a Hopper GPU: the FP8 wgrad that adds into an FP32 gradient inside the GEMM (``fp8/cublaslt.py``, cuBLASLt
with beta = 1, called through ctypes) gives the bits of ``F.scaled_mm`` followed by an FP32 add: alone, in an
``Fp8Linear`` whose weight names its gradient target (``ops.WGRAD_INTO``), and for q|k|v grouped over the
trainer's FP32 masters, whose gradients it adds into as one stacked view; and the forward GEMM without workspace
(the engine's decode candidate) gives ``F.scaled_mm``'s bits wherever that does not split K, and every row the
bits of the same row in a larger batch. Skipped without one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from infir2_rl.fp8 import cublaslt, gemm, quant_triton
from infir2_rl.fp8.grouped import group_projections
from infir2_rl.fp8.linear import Fp8Linear
from infir2_rl.fp8.ops import WGRAD_INTO
from infir2_rl.trainers.torch.master_weights import MasterWeights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="needs a Hopper GPU (blockwise FP8 in cuBLASLt)",
    ),
]


def _device_index() -> int:
    index = torch.cuda.current_device()
    assert gemm.fast_path_ok(torch.empty(1, device="cuda"), 128, 128)  # runs the device checks once
    return index


@pytest.mark.parametrize(("n", "k", "tokens"), [(256, 384, 640), (1536, 1536, 1000), (208, 96, 77)])
def test_accumulating_gemm_equals_scaled_mm_plus_an_add(n: int, k: int, tokens: int) -> None:
    assert gemm.accumulate_ok(torch.device("cuda", _device_index()))
    gen = torch.Generator(device="cuda").manual_seed(n + k + tokens)
    target = torch.randn(n, k, device="cuda", generator=gen)
    ref = target.clone()
    for _ in range(2):  # twice: micro-batches adding into one gradient
        dy = torch.randn(tokens, n, device="cuda", generator=gen, dtype=torch.bfloat16)
        x = torch.randn(tokens, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        dytq, dyts = quant_triton.quantize_cols(dy)
        xtq, xts = quant_triton.quantize_cols(x)
        ref += gemm.mm_1x128_1x128(dytq, dyts, xtq, xts, torch.float32)
        cublaslt.add_mm_1x128_1x128(target, dytq, dyts, xtq, xts)
        assert torch.equal(target, ref)
    with pytest.raises(ValueError, match="FP32"):
        cublaslt.add_mm_1x128_1x128(target.bfloat16(), dytq, dyts, xtq, xts)


@pytest.mark.parametrize("bias", [False, True])
def test_a_linear_adds_its_weight_gradient_into_the_named_target(bias: bool) -> None:
    _device_index()
    torch.manual_seed(0)
    plain = Fp8Linear(384, 256, bias=bias).cuda()
    into = Fp8Linear(384, 256, bias=bias).cuda()
    into.load_state_dict(plain.state_dict())
    start = torch.randn(256, 384, device="cuda")
    target = start.clone()
    calls = []

    def wgrad_into(weight: torch.Tensor) -> torch.Tensor:
        calls.append(weight)
        return target

    setattr(into.weight, WGRAD_INTO, wgrad_into)
    x = torch.randn(4, 160, 384, device="cuda")
    dy = torch.randn(4, 160, 256, device="cuda", dtype=torch.bfloat16)
    outs = []
    for layer in (plain, into):
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(xi)
        y.backward(dy)
        outs.append((y, xi.grad))
    assert calls == [into.weight]
    assert into.weight.grad is None  # added where it belongs, not returned
    assert plain.weight.grad is not None
    assert torch.equal(target, start + plain.weight.grad)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    if bias:
        assert torch.equal(into.bias.grad, plain.bias.grad)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = Fp8Linear(256, 256)
        self.k_proj = Fp8Linear(256, 128)
        self.v_proj = Fp8Linear(256, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)


def test_grouped_qkv_adds_into_the_masters_stacked_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    index = _device_index()
    torch.manual_seed(0)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(2, 300, 512, device="cuda", dtype=torch.bfloat16)
    grads = {}
    for fused in (False, True):
        monkeypatch.setitem(gemm._accumulate, index, fused)
        torch.manual_seed(1)
        model = _Attention().cuda()
        assert group_projections(model) == 1
        masters = MasterWeights(model)
        for _ in range(2):  # two micro-batches into one gradient
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = model(x)
            y.backward(dy)
        assert all(p.grad is None for p in model.parameters())  # every gradient went into the masters'
        grads[fused] = [m.grad.clone() for m in masters.optimizer_params]
    for a, b in zip(grads[False], grads[True], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("n", "k"), [(1536, 1536), (17920, 1536), (1536, 8960)])
@pytest.mark.parametrize("pow2", [False, True], ids=["scales", "pow2"])
def test_the_w8a8_kernel_gives_cublaslt_bits(n: int, k: int, pow2: bool) -> None:
    """The engine's Triton W8A8 kernel promotes each K block's tensor-core sum with cuBLASLt's rounding, so on
    the same FP8 operands it gives cuBLASLt's blockwise GEMM bit for bit (FP32 and BF16 output) in every
    launch shape without split-K, at M where cuBLASLt does not split K either (down_proj's K 8960 splits
    at M <= 80 on an H100). The 1.5B shapes: o_proj, gate|up fused, down_proj. Measured over more shapes
    and the other roundings by bench/cublaslt_bits.py."""
    from infir2_rl.engines.native import fp8_gemm

    _device_index()
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w8, s8 = quant_triton.quantize_weight(torch.randn(n, k, device="cuda", generator=gen) * 0.05, pow2)
    for m in (96, 256, 1000):
        x = (torch.randn(m, k, device="cuda", generator=gen) * 2).bfloat16()
        q, s_t = quant_triton.quantize_rows(x, pow2)
        for dtype in (torch.float32, torch.bfloat16):
            ref = gemm.mm_1x128_128x128(q, s_t, w8, s8, dtype)[:m]
            for cfg in (
                fp8_gemm.GemmConfig(64, 64, 1),
                fp8_gemm.GemmConfig(128, 128, 1, 8),
                fp8_gemm.GemmConfig(64, 32, 1, 4, 4),
            ):
                y = fp8_gemm.w8a8_fused(q, w8, s8, None, cfg, pow2, s_t, m, dtype)
                assert torch.equal(y, ref), (m, dtype, cfg)
            inside = fp8_gemm.w8a8_fused(
                x, w8, s8, None, fp8_gemm.GemmConfig(64, 64, 1), pow2, out_dtype=dtype
            )
            assert torch.equal(inside, ref), (m, dtype, "quantized inside the kernel")


@pytest.mark.parametrize(("n", "k"), [(2048, 1536), (17920, 1536), (1536, 8960)])
def test_the_forward_gemm_without_workspace_gives_scaled_mms_bits(n: int, k: int) -> None:
    """The 1.5B decoder's FP8 GEMMs (q|k|v, gate|up, down_proj), the engine's weight grid (rows stored apart).
    torch's GEMM splits K for down_proj at M <= 80 (models/invariant_ops); without workspace none splits, so
    from 96 rows on both give one row's bits, and below that the no-workspace rows still equal their own rows
    of the large batch."""
    _device_index()
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = (torch.randn(1024, k, device="cuda", generator=gen) * 2).bfloat16()
    w8, s_plain = quant_triton.quantize_weight(torch.randn(n, k, device="cuda", generator=gen) * 0.05)
    s8 = gemm.scale_grid(s_plain.shape[0], s_plain.shape[1], "cuda").copy_(s_plain)
    q_all, s_all = quant_triton.quantize_rows(x)
    big = cublaslt.mm_1x128_128x128_no_workspace(q_all, s_all, w8, gemm.padded_grid(s8), torch.bfloat16)
    assert torch.equal(big, gemm.mm_1x128_128x128(q_all, s_all, w8, s8, torch.bfloat16))
    for m in (1, 16, 80, 96, 256, 1000):
        q, s_t = quant_triton.quantize_rows(x[:m].contiguous())
        y = cublaslt.mm_1x128_128x128_no_workspace(q, s_t, w8, gemm.padded_grid(s8), torch.bfloat16)[:m]
        assert torch.equal(y, big[:m]), f"M {m}"
        if m >= 96:
            assert torch.equal(y, gemm.mm_1x128_128x128(q, s_t, w8, s8, torch.bfloat16)[:m]), f"M {m}"
    if not s8.is_contiguous():  # K blocks not a multiple of 4: the grid must come padded, not as the view
        with pytest.raises(ValueError, match="contiguous"):
            cublaslt.mm_1x128_128x128_no_workspace(q_all, s_all, w8, s8, torch.bfloat16)


@pytest.mark.parametrize(("n", "k", "chunks"), [(1536, 8960, 2), (1536, 8960, 4), (384, 1024, 2)])
def test_k_chunks_added_by_the_epilogue_equal_their_fp32_sum(n: int, k: int, chunks: int) -> None:
    """``mm_1x128_128x128_into`` over column slices of the operands (row stride K), chunk c added into chunks
    0..c-1 by beta = 1: the FP32 sum of each chunk's own product in chunk order, bit for bit (what
    models/invariant_ops' split GEMMs rely on); and the split-K Triton launch's partials sum to the same."""
    from infir2_rl.engines.native import fp8_gemm
    from infir2_rl.models.invariant_ops import SPLIT_CHUNKS, split_chunks

    _device_index()
    gen = torch.Generator(device="cuda").manual_seed(n + k + chunks)
    m = 1000
    x = (torch.randn(m, k, device="cuda", generator=gen) * 2).bfloat16()
    w8, s8 = quant_triton.quantize_weight(torch.randn(n, k, device="cuda", generator=gen) * 0.05)
    q, s_t = quant_triton.quantize_rows(x)
    out = torch.empty(q.shape[0], n, device="cuda")
    ref: torch.Tensor | None = None
    for i, (b0, b1) in enumerate(split_chunks(s8.shape[1], chunks)):
        cols = slice(b0 * 128, b1 * 128)
        a, w, a_s = q[:, cols], w8[:, cols], s_t[b0:b1].contiguous()
        part = gemm.mm_1x128_128x128(a.contiguous(), a_s, w.contiguous(), s8[:, b0:b1], torch.float32)
        ref = part if ref is None else ref + part
        cublaslt.mm_1x128_128x128_into(out, a, a_s, w, gemm.padded_grid(s8[:, b0:b1]), i > 0)
        assert torch.equal(out, ref), f"after chunk {i}"
    assert ref is not None
    if chunks == SPLIT_CHUNKS:  # the engine's launch splits K alike
        cfg = fp8_gemm.GemmConfig(64, 32, chunks, 4, 5)
        y = fp8_gemm.w8a8_fused(q, w8, s8, None, cfg, False, s_t, m, torch.bfloat16)
        assert torch.equal(y, ref[:m].bfloat16())
    with pytest.raises(ValueError, match="FP32"):
        cublaslt.mm_1x128_128x128_into(out.bfloat16(), q, s_t, w8, gemm.padded_grid(s8), False)
