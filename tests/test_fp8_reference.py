"""An independent float64 model of blockwise e4m3 quantization, used by the other FP8 tests.

It shares no code with ``infir2_rl.fp8``: rounding is done by searching the table of all finite e4m3fn
values (ties to the even code), scales and block loops are written out in float64. Tests in this file
check the reference itself against facts about the format.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """All finite non-negative e4m3fn values (float64, ascending) and their 7-bit codes."""
    codes = torch.arange(0, 128, dtype=torch.int64)
    values = codes.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    finite = ~values.isnan()
    return values[finite], codes[finite]


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round float64 values (|v| <= 448) to the nearest e4m3fn value, ties to the even code."""
    grid, codes = e4m3_grid()
    mag = v.abs().clamp(max=E4M3_MAX).contiguous()
    hi = torch.searchsorted(grid, mag).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    return torch.where(pick_hi, grid[hi], grid[lo]) * torch.sign(v)


def ref_scale(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    """FP32 dequant multiplier from a float64 amax: amax/448 rounded once to FP32; 1 where that is 0 (an
    all-zero block, or an amax whose quotient underflows), at least 2^-126 (FP32's smallest normal) elsewhere."""
    s = (amax / E4M3_MAX).to(torch.float32).to(torch.float64)
    s = torch.where(s > 0, s.clamp(min=2.0**-126), torch.ones_like(s))
    if pow2:
        s = torch.exp2(torch.ceil(torch.log2(s)))  # float64 log2 of a power of two is exact
    return s


def _fp32_product(x64: torch.Tensor, s64: torch.Tensor) -> torch.Tensor:
    """x times the scale's reciprocal as the format defines it: r = 1 / scale rounded to FP32, then x * r
    rounded to FP32 (Transformer Engine's and DeepSeek's rule: codes from a product, not a quotient).

    Both in float64 and then rounded to FP32: the float64 product of two FP32 values is exact (48 <= 53
    bits), and the float64 reciprocal rounds to the correctly rounded FP32 one (53 >= 2 * 24 + 2 bits, so
    this double rounding is harmless). The FP32 rounding of the product matters: with BF16 inputs many
    products land exactly on an e4m3 tie only after it, so a float64 product would round some ties the
    other way.
    """
    r = (1.0 / s64).to(torch.float32).to(torch.float64)
    return (x64 * r).to(torch.float32).to(torch.float64)


def ref_quant_rows(x: torch.Tensor, tile: int = 128, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along the last dim of a 2-D tensor: (fp8 values as float64, scales float64)."""
    x64 = x.to(torch.float64)
    m, k = x64.shape
    kb = -(-k // tile)
    q = torch.empty_like(x64)
    s = torch.empty(m, kb, dtype=torch.float64)
    for j in range(kb):
        block = x64[:, j * tile : (j + 1) * tile]
        s[:, j] = ref_scale(block.abs().amax(dim=1), pow2)
        q[:, j * tile : (j + 1) * tile] = round_e4m3(_fp32_product(block, s[:, j : j + 1]))
    return q, s


def ref_quant_weight(
    w: torch.Tensor, block: int = 128, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks: (fp8 values as float64, scales (ceil(N/128), ceil(K/128)) float64)."""
    w64 = w.to(torch.float64)
    n, k = w64.shape
    nb, kb = -(-n // block), -(-k // block)
    q = torch.empty_like(w64)
    s = torch.empty(nb, kb, dtype=torch.float64)
    for i in range(nb):
        for j in range(kb):
            blk = w64[i * block : (i + 1) * block, j * block : (j + 1) * block]
            s[i, j] = ref_scale(blk.abs().amax(), pow2)
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = round_e4m3(
                _fp32_product(blk, s[i, j])
            )
    return q, s


def ref_dequant_rows(q: torch.Tensor, s: torch.Tensor, tile: int = 128) -> torch.Tensor:
    return q * s.repeat_interleave(tile, dim=1)[:, : q.shape[1]]


def ref_dequant_weight(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    n, k = q.shape
    return q * s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]


def test_grid_has_the_e4m3fn_landmarks() -> None:
    grid, _ = e4m3_grid()
    assert grid[0] == 0 and grid[-1] == 448.0 and len(grid) == 127  # 0x7F is NaN
    assert grid[1] == 2.0**-9  # smallest subnormal
    assert 2.0**-6 in grid.tolist()  # smallest normal


def test_round_e4m3_nearest_and_ties_to_even() -> None:
    # 17 lies between 16 (code 0x50) and 18 (0x51): a tie, the even code wins; 17.01 goes up.
    v = torch.tensor([17.0, 17.01, -17.0, 500.0, 0.0, 2.0**-10, 3 * 2.0**-10], dtype=torch.float64)
    expect = torch.tensor([16.0, 18.0, -16.0, 448.0, 0.0, 0.0, 2.0**-8], dtype=torch.float64)
    assert torch.equal(round_e4m3(v), expect)
