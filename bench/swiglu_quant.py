"""The fused SwiGLU that quantizes for its FP8 neighbours against SwiGLU then the FP8 quantizers (one GPU).

    python bench/swiglu_quant.py [--m 8192] [--n 8960] [--reps 50]

Forward: ``_swiglu_fwd_rows_kernel`` (h and its row tiles) plus ``quantize_cols(h)`` against ``swiglu``
followed by ``quant_triton.quantize_rows_and_cols(h)``. Backward: ``_swiglu_bwd_rows_kernel`` (dgate, dup and
their row tiles) plus two ``quantize_cols`` against the SwiGLU backward followed by two
``quantize_rows_and_cols``. Every launch shape in
``CANDIDATES`` is timed (CUDA events, median); the ratio is separate / fused (> 1: fused is faster). Prints
the bandwidth each moves at, counting the bytes each must read and write once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# (bench/ is on sys.path when this file runs as a script: the timing helper is fp8_linear.py's.)
from fp8_linear import cuda_time_ms

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CANDIDATES = [{"bm": bm, "warps": w} for bm in (16, 32, 64) for w in (4, 8)]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--m", type=int, default=8192, help="tokens")
    parser.add_argument("--n", type=int, default=8960, help="intermediate features")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/swiglu_quant.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    from infir2_rl.fp8 import quant_triton
    from infir2_rl.trainers.torch import fused_layers as fl

    m, n = args.m, args.n
    g = torch.randn(m, n, device="cuda").bfloat16()
    u = torch.randn(m, n, device="cuda").bfloat16()
    dh = torch.randn(m, n, device="cuda").bfloat16()
    plan = fl.Fp8Plan(False, True, True, True)
    gb = 1e9 / 1e3  # bytes per ms -> GB/s

    def sep_fwd() -> None:
        quant_triton.quantize_rows_and_cols(fl.swiglu(g, u))

    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
    h_graph = fl.swiglu(gr, ur)

    def sep_bwd() -> None:
        dg, du = torch.autograd.grad(h_graph, (gr, ur), dh, retain_graph=True)
        quant_triton.quantize_rows_and_cols(dg)
        quant_triton.quantize_rows_and_cols(du)

    def fused_fwd() -> None:
        fl._SwiGLUFn.apply(g, u, plan, [])

    hq = fl._SwiGLUFn.apply(gr, ur, plan, [])

    def fused_bwd() -> None:
        torch.autograd.grad(hq, (gr, ur), dh, retain_graph=True)

    e = m * n
    print(
        f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | M {m} x N {n} BF16 | median of {args.reps}"
    )
    t_sf, t_sb = cuda_time_ms(sep_fwd, args.reps), cuda_time_ms(sep_bwd, args.reps)
    print(f"separate forward  {t_sf:7.3f} ms   ({e * (4 + 2 + 2 + 2 + 2) / t_sf / gb:6.0f} GB/s counted)")
    print(f"separate backward {t_sb:7.3f} ms   ({e * (6 + 4 + 2 * 6) / t_sb / gb:6.0f} GB/s counted)")
    best = None
    for cand in CANDIDATES:
        fl.QUANT_LAUNCH.update(cand)
        t_f, t_b = cuda_time_ms(fused_fwd, args.reps), cuda_time_ms(fused_bwd, args.reps)
        print(
            f"fused bm {cand['bm']:3d} warps {cand['warps']}: forward {t_f:7.3f} ms (x{t_sf / t_f:5.2f}, "
            f"{e * (4 + 2 + 1 + 2 + 1) / t_f / gb:6.0f} GB/s)  backward {t_b:7.3f} ms (x{t_sb / t_b:5.2f}, "
            f"{e * (6 + 4 + 2 + 2 * 3) / t_b / gb:6.0f} GB/s)"
        )
        if best is None or t_f + t_b < best[0]:
            best = (t_f + t_b, cand)
    assert best is not None
    print(f"fastest: {best[1]}  separate/fused forward+backward x{(t_sf + t_sb) / best[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
