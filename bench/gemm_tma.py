"""Can a Triton W8A8 kernel with TMA loads and a software-pipelined promotion beat cuBLASLt at decode M? (CUDA)

At M = 256 the 1.5B decode GEMMs run no faster in FP8 than in BF16 (``bench/decode_gemm.py``: gate|up cuBLASLt
22.7 us against BF16's 27.1, the engine's Triton kernel 30.8; ~650 TFLOP/s where FP8's peak is ~2,000). The
engine's kernel (``engines/native/fp8_gemm._w8a8_kernel``) loads its FP8 tiles with pointer loads and, per
128-deep K block, waits for the tensor-core product before the FP32 promotion ``acc = fma(p, s_x * s_w, acc)``.
Variants tried here, all with that promotion in K order (so each should still give cuBLASLt's bits):

* ``ptr``: the engine's kernel as it is (producer-quantized input);
* ``tma``: the FP8 tiles through TMA descriptors (``triton.tools.tensor_descriptor``), pipelined by ``tl.range``;
* ``tma+pipe``: TMA, and block kb + 1's product issued before block kb's promotion, so that the promotion can
  overlap the next product.

For each 1.5B decode shape and M it prints the elements differing from cuBLASLt (BF16 output) and the time per
call with cold weights in a CUDA graph (``bench/decode_gemm.py``'s timer), best launch shape per variant.

    python bench/gemm_tma.py [--rows 64 128 256] [--gemms gate_up qkv o down]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}  # (N, K)
CONFIGS = [
    (64, 128, 4, 4),
    (64, 256, 8, 3),
    (128, 128, 8, 4),
    (128, 256, 8, 3),
    (64, 64, 4, 6),
    (128, 64, 4, 5),
]
COLD_BYTES = 256 * 2**20

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]

if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _tma_kernel(
        x_desc, xs_ptr, w_desc, ws_ptr, y_ptr, M, N, KB, xs_rows, stride_ws,
        BM: tl.constexpr, BN: tl.constexpr, PIPE: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        ws_row = ws_ptr + (cols // 128) * stride_ws
        acc = tl.zeros((BM, BN), tl.float32)
        if PIPE:
            q = x_desc.load([pid_m * BM, 0])
            w = w_desc.load([pid_n * BN, 0])
            p = tl.dot(q, w.T)
            s = (
                tl.load(xs_ptr + rows, mask=rows < M, other=0.0)[:, None]
                * tl.load(ws_row, mask=cols < N, other=0.0)[None, :]
            )
            for kb in tl.range(1, KB, num_stages=STAGES):
                q = x_desc.load([pid_m * BM, kb * 128])
                w = w_desc.load([pid_n * BN, kb * 128])
                p_next = tl.dot(q, w.T)
                acc = tl.fma(p, s, acc)
                s_x = tl.load(xs_ptr + kb * xs_rows + rows, mask=rows < M, other=0.0)
                s_w = tl.load(ws_row + kb, mask=cols < N, other=0.0)
                s = s_x[:, None] * s_w[None, :]
                p = p_next
            acc = tl.fma(p, s, acc)
        else:
            for kb in tl.range(0, KB, num_stages=STAGES):
                q = x_desc.load([pid_m * BM, kb * 128])
                w = w_desc.load([pid_n * BN, kb * 128])
                s_x = tl.load(xs_ptr + kb * xs_rows + rows, mask=rows < M, other=0.0)
                s_w = tl.load(ws_row + kb, mask=cols < N, other=0.0)
                acc = tl.fma(tl.dot(q, w.T), s_x[:, None] * s_w[None, :], acc)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(
            y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask
        )


def tma_gemm(
    cfg: tuple[int, int, int, int],
    pipe: bool,
    q: torch.Tensor,
    s_t: torch.Tensor,
    m: int,
    w: torch.Tensor,
    s: torch.Tensor,
) -> torch.Tensor:
    bm, bn, warps, stages = cfg
    n, k = w.shape
    y = torch.empty(m, n, dtype=torch.bfloat16, device=q.device)
    x_desc = TensorDescriptor.from_tensor(q, [bm, 128])
    w_desc = TensorDescriptor.from_tensor(w, [bn, 128])
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _tma_kernel[grid](
        x_desc, s_t, w_desc, s, y, m, n, s.shape[1], s_t.shape[1], s.stride(0),
        BM=bm, BN=bn, PIPE=pipe, STAGES=stages, num_warps=warps,
    )  # fmt: skip
    return y


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--gemms", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = parser.parse_args(argv)
    if triton is None or not torch.cuda.is_available():
        print("bench/gemm_tma.py needs a CUDA GPU and Triton")
        return 2
    from invariant_split import cold_us, triton_split, whole_k

    from infir2_rl.engines.native import fp8_gemm
    from infir2_rl.fp8 import quant_triton

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.gemms:
        n, k = SHAPES[name]
        w8, s8 = quant_triton.quantize_weight(torch.randn(n, k, device="cuda", generator=gen) * 0.05)
        copies = [(w8, s8)] + [(w8.clone(), s8.clone()) for _ in range(max(1, COLD_BYTES // (n * k)) - 1)]
        for m in args.rows:
            x = (torch.randn(m, k, device="cuda", generator=gen) * 2).bfloat16()
            q, s_t = quant_triton.quantize_rows(x)
            ref = whole_k(q, s_t, m, w8, s8)
            line = [f"{name:8s} M {m:4d}: cuBLASLt {cold_us(whole_k, q, s_t, m, copies):6.1f}"]
            ptr = [
                (cold_us(functools.partial(triton_split, c), q, s_t, m, copies), str(c))
                for c in fp8_gemm.candidates(m)
            ]
            best_ptr = min(ptr)
            line.append(f"ptr {best_ptr[0]:6.1f} [{best_ptr[1]}]")
            for pipe in (False, True):
                results = []
                for cfg in CONFIGS:
                    try:
                        y = tma_gemm(cfg, pipe, q, s_t, m, w8, s8)
                        bad = int((y != ref).sum())
                        results.append(
                            (cold_us(functools.partial(tma_gemm, cfg, pipe), q, s_t, m, copies), cfg, bad)
                        )
                    except Exception as exc:  # a launch shape Triton cannot compile or fit
                        print(
                            f"  {name} M {m} {'tma+pipe' if pipe else 'tma'} {cfg}: {str(exc).splitlines()[0][:90]}"
                        )
                if results:
                    t, cfg, _ = min(results)
                    bits = max(r[2] for r in results)
                    line.append(f"{'tma+pipe' if pipe else 'tma'} {t:6.1f} {cfg} (max differing {bits})")
            print(" | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
