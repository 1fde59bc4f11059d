"""The decode step's producer kernels quantize with the trainer's rule (``quant_triton._to_e4m3``: x times the
tile's correctly rounded reciprocal scale, shared with the trainer's quantizers). Their codes and scales must
equal the eager reference's (``quant.quantize_activation_eager``: torch's reciprocal and products), or the
engine's FP8 GEMM inputs would differ from the trainer's. Checked here for every finite BF16 value, for
values at and next to every e4m3 rounding midpoint at "round" scales (where x / scale can be exact), for
tiles whose scale is tiny (down to BF16's subnormals, where the scale is raised to 2^-126), and with
power-of-two scales. GPU only (Triton)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

try:
    import triton
    import triton.language as tl

    from infir2_rl.engines.native.fused_ops import _quant_store

    @triton.jit
    def _tile_quant_kernel(x_ptr, q_ptr, s_ptr, rows_pad, POW2: tl.constexpr):
        """Row r of x (M, 128) BF16 through the producers' quantizing store."""
        row = tl.program_id(0)
        tiles = tl.arange(0, 1)[:, None]
        cols = tl.arange(0, 128)[None, :]
        y = tl.load(x_ptr + row.to(tl.int64) * 128 + cols).to(tl.float32)
        _quant_store(y, q_ptr, s_ptr, row, rows_pad, 128, tiles, cols, POW2)

except ImportError:  # pragma: no cover - CPU-only installs
    pass


def _finite_bf16_values() -> torch.Tensor:
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.bfloat16)
    return values[values.float().isfinite()]


def _midpoint_rows(amax: float) -> torch.Tensor:
    """Rows whose first element is ``amax`` (so the tile's scale is amax / 448) and whose others are the
    BF16 values nearest to s * m for every e4m3 rounding midpoint m, with their BF16 neighbours."""
    s = torch.tensor(amax / 448.0, dtype=torch.float32)
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[codes.isfinite() & (codes >= 0)].unique()
    mids = (codes[:-1] + codes[1:]) / 2
    y = (torch.cat([mids, -mids]) * s).to(torch.bfloat16)
    bits = y.view(torch.int16)
    around = torch.cat([bits - 1, bits, bits + 1]).view(torch.bfloat16)
    around = around[around.float().isfinite() & (around.float().abs() <= amax)]
    pad = (-around.numel()) % 127
    around = torch.cat([around, around[:pad]]).view(-1, 127)
    first = torch.full((around.shape[0], 1), amax, dtype=torch.bfloat16)
    return torch.cat([first, around], dim=1)


@pytest.mark.parametrize("pow2", [False, True])
def test_producer_quantization_equals_the_reference_for_every_bf16_value(pow2: bool) -> None:
    from infir2_rl.engines.native import fused_ops
    from infir2_rl.fp8.quant import quantize_activation_eager

    gen = torch.Generator().manual_seed(0)
    values = _finite_bf16_values()
    # Every finite BF16 value, in 16 shuffles of 128-wide rows: each row's amax sets its own scale.
    pad = (-values.numel()) % 128
    shuffles = []
    for _ in range(16):
        perm = values[torch.randperm(values.numel(), generator=gen)]
        shuffles.append(torch.cat([perm, perm[:pad]]).view(-1, 128))
    # The same values scaled down into each binade's range, so that small tiles get small scales too.
    small = [rows.float().clamp(-1, 1).to(torch.bfloat16) for rows in shuffles[:4]]
    # Tiny tiles: amax near 2^-j, down to BF16 subnormals (amax / 448 an FP32 subnormal: the scale is raised).
    unit = shuffles[0].float().clamp(-1, 1)
    tiny = [(unit * 2.0**-j).to(torch.bfloat16) for j in (40, 70, 100, 118, 124, 127, 130)]
    # Round amaxes (scale = amax / 448 with few bits), where a quotient can land exactly on a midpoint.
    round_amax = [448.0 * 2.0**k for k in range(-12, 12)] + [
        7.0 * m * 2.0**k for m in (1, 3, 5, 9, 15) for k in (-6, 0, 4)
    ]
    round_amax += [504.0, 336.0, 1.0, 3.0, 0.75]
    midpoints = [_midpoint_rows(a) for a in round_amax if a < 3e38]
    x = torch.cat(shuffles + small + tiny + midpoints).cuda()
    m = x.shape[0]
    q_ref, s_ref = quantize_activation_eager(x, pow2_scales=pow2)  # s_ref (M, 1)
    s_ref = s_ref.t()
    out = fused_ops.quant_buffers(m, 128, x.device)
    _tile_quant_kernel[(m,)](x, out.q, out.s_t, out.q.shape[0], POW2=pow2)
    assert torch.equal(out.s_t[:, :m], s_ref[:, :m])
    same = out.q[:m].view(torch.uint8) == q_ref[:m].view(torch.uint8)
    bad = (~same).nonzero()
    assert bad.numel() == 0, (
        f"{bad.shape[0]} codes differ, first at row/col {bad[:5].tolist()}: "
        f"x {x[bad[0, 0], bad[0, 1]].item()!r}, scale {s_ref[0, bad[0, 0]].item()!r}"
    )
