"""The engine's FP8 W8A8 decode GEMM kernel against variants of its K loop, in the same launch shapes.

    python bench/gemm_variants.py [--batches 16 64 256] [--gemms qkv o gate_up down] [--unroll 1 2 4]
                                  [--small-bm] [--streamk] [--ws]

"kuU": the engine's kernel (``fp8_gemm._w8a8_kernel``, producer-quantized input) as it was before its scale
loads were issued a K block ahead (session 19), with U consecutive 128-deep K blocks per loop iteration: U loads per row issued together, so each weight row is read in U x 128
contiguous bytes, still promoted to FP32 one block at a time in K order, so the output must equal the
engine's bit for bit (checked). Why: at M = 64 the kernel pulls the down projection's weights at 38% of
DRAM bandwidth (Nsight Compute, ``bench/gemm_ncu.py``) with 128-byte reads from 64 rows 8,960 bytes apart.
A first variant here (pointer increments, no K/N masks, a scalar weight scale) was 0.89-1.07x the kernel and
was dropped. Cold weights (a rotation over copies larger than the L2), CUDA-graph timing as the engine's
chooser does; prints the best us per call of each kind and its launch shape. ``--small-bm`` adds launch
shapes with BM 16 and 32 at M > 16 (several row tiles, each re-reading the weight tile from L2).

"sk" (``--streamk``): a stream-K kernel, one run of equal work per program with P = 1..3 programs per SM,
against the grid's 1.5-2.1 waves of unequal SMs at decode shapes; its FP32 partials are summed per tile in a
fixed order (so it is deterministic, though not bit-equal to the split-K kernel: checked to 1e-2 of the
output's scale). It measured 1.2-1.6x slower than the kernel at every decode shape (docs/performance.md).

"ws" (``--ws``): the kernel with TMA tile loads and ``tl.range(..., warp_specialize=True)``, so a producer
warp group keeps tiles in flight while the consumers promote. It compiles for sm_90 (Triton 3.6: a TMA
producer and two consumer warp groups, 12 warps); it had not run on a GPU when it was written (session 19).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infir2_rl.engines.native import fp8_gemm, pdl  # noqa: E402
from infir2_rl.engines.native.linears import Fp8GemmChooser  # noqa: E402
from infir2_rl.engines.native.pdl import wait_then_release  # noqa: E402
from infir2_rl.fp8 import quant_triton  # noqa: E402
from infir2_rl.fp8.quant import quantize_weight_blockwise  # noqa: E402

SHAPES = [("qkv", 2048, 1536), ("o", 1536, 1536), ("gate_up", 17920, 1536), ("down", 1536, 8960)]


@triton.jit(do_not_specialize=["M"])
def _ku_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, KB, kb_per_split, stride_xm, xs_rows,
    SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KU: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The engine's kernel with KU consecutive K blocks per loop iteration (KU loads per row issued together,
    KU x 128 contiguous weight bytes per row), promoted one block at a time in K order as before."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, 128)
    row_ok = rows < M
    acc = tl.zeros((BM, BN), tl.float32)
    kb_start = pid_k * kb_per_split
    kb_end = tl.minimum(kb_start + kb_per_split, KB)
    if PDL:
        wait_then_release()
    for kb0 in range(kb_start, kb_end, KU):
        for u in tl.static_range(KU):
            kb = kb0 + u
            ok = kb < kb_end
            ks = kb * 128 + kk
            q = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & ok, other=0.0)
            s_x = tl.load(xs_ptr + kb * xs_rows + rows, mask=row_ok & ok, other=0.0)
            w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=ok, other=0.0)
            s_w = tl.load(ws_ptr + (cols // 128) * KB + kb, mask=ok, other=0.0)
            acc += tl.dot(q, w) * s_x[:, None] * s_w[None, :]
    out_mask = row_ok[:, None]
    if SPLIT:
        offs = (pid_k * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(y_ptr + offs, acc, mask=out_mask)
    else:
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _first_program(tile, KB, U, P):
    """The stream-K program that computes unit ``tile * KB`` (the tile's first K block): p with
    p * U // P <= u < (p + 1) * U // P is ((u + 1) * P - 1) // U."""
    return ((tile * KB + 1) * P - 1) // U


@triton.jit
def _sk_unit(u, KB, T, BM: tl.constexpr, BN: tl.constexpr):
    """Rows, columns and K block of stream-K unit u (tile-major: row tile, column tile, then K)."""
    tile = u // KB
    mt = tile // T
    return mt * BM + tl.arange(0, BM), (tile - mt * T) * BN + tl.arange(0, BN), u - tile * KB


@triton.jit(do_not_specialize=["M"])
def _sk_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, part_ptr, M, N, K, KB, T, U, P, stride_xm, xs_rows,
    BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Stream-K: the U = row tiles x column tiles x K blocks units of work are cut into P equal runs, one per
    program (P a multiple of the SM count), so every SM pulls the same number of weight bytes. A run walks
    its units in order (tile-major, K inside) and stores an FP32 partial at each tile boundary it crosses,
    in slot (program - the tile's first program); ``_sk_sum_kernel`` adds a tile's partials in slot order.
    Why: with one program per (tile, K split) the grid is 1.5-2.1 waves of the 132 SMs at decode shapes, so
    some SMs pull twice the bytes of others while the rest idle."""
    pid = tl.program_id(0)
    u0 = pid * U // P
    u1 = (pid + 1) * U // P
    kk = tl.arange(0, 128)
    acc = tl.zeros((BM, BN), tl.float32)
    if PDL:
        wait_then_release()
    rows, cols, kb = _sk_unit(u0, KB, T, BM, BN)  # unit u + 1's scales load during unit u
    s_x_next = tl.load(xs_ptr + kb * xs_rows + rows, mask=rows < M, other=0.0)
    s_w_next = tl.load(ws_ptr + (cols // 128) * KB + kb)
    for u in range(u0, u1):
        rows, cols, kb = _sk_unit(u, KB, T, BM, BN)
        row_ok = rows < M
        s_x, s_w = s_x_next, s_w_next
        more = u + 1 < u1
        rows_n, cols_n, kb_n = _sk_unit(u + 1, KB, T, BM, BN)
        s_x_next = tl.load(xs_ptr + kb_n * xs_rows + rows_n, mask=(rows_n < M) & more, other=0.0)
        s_w_next = tl.load(ws_ptr + (cols_n // 128) * KB + kb_n, mask=more & (cols_n < N), other=0.0)
        ks = kb * 128 + kk
        q = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :], mask=row_ok[:, None], other=0.0
        )
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None])
        acc += tl.dot(q, w) * s_x[:, None] * s_w[None, :]
        if (kb == KB - 1) | (u == u1 - 1):
            slot = pid - _first_program(u // KB, KB, U, P)
            offs = (slot * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
            tl.store(part_ptr + offs, acc, mask=row_ok[:, None])
            acc = tl.zeros((BM, BN), tl.float32)


@triton.jit
def _sk_sum_kernel(
    part_ptr, y_ptr, M, N, KB, T, U, P,
    BM: tl.constexpr, BN: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """y = the sum of each tile's stream-K partials in slot order, cast to y's dtype."""
    if PDL:
        wait_then_release()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    r = (offs // N).to(tl.int32)
    c = (offs % N).to(tl.int32)
    tile = (r // BM) * T + c // BN
    first = _first_program(tile, KB, U, P)
    last = (((tile + 1) * KB) * P - 1) // U
    count = last - first + 1
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(SLOTS):
        acc += tl.load(part_ptr + j * M * N + offs, mask=mask & (j < count), other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _ws_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, KB, kb_per_split, xs_rows,
    SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The engine's kernel with TMA tile loads and Triton's warp specialization: a producer warp group keeps
    ``STAGES`` tiles in flight whatever the consumers' FP32 promotion is doing (in the kernel, each warp both
    loads and promotes)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, 128])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, 128])
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < M
    acc = tl.zeros((BM, BN), tl.float32)
    kb_start = pid_k * kb_per_split
    kb_end = tl.minimum(kb_start + kb_per_split, KB)
    if PDL:
        wait_then_release()
    for kb in tl.range(kb_start, kb_end, num_stages=STAGES, warp_specialize=True):
        q = x_desc.load([pid_m * BM, kb * 128])
        w = w_desc.load([pid_n * BN, kb * 128])
        s_x = tl.load(xs_ptr + kb * xs_rows + rows, mask=row_ok, other=0.0)
        s_w = tl.load(ws_ptr + (cols // 128) * KB + kb)
        acc += tl.dot(q, w.T) * s_x[:, None] * s_w[None, :]
    if SPLIT:
        offs = (pid_k * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(y_ptr + offs, acc, mask=row_ok[:, None])
    else:
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])


def ws(q, s_t, m, w, s, cfg: fp8_gemm.GemmConfig):
    """Launch the warp-specialized TMA kernel (``--ws``) in ``cfg``'s tile, split-K and stages."""

    def run(y, kb, per, split, grid, launch):
        _ws_kernel[grid](
            q, s_t, w, s, y, m, w.shape[0], w.shape[1], kb, per, s_t.shape[1],
            SPLIT=split > 1, BM=cfg.bm, BN=cfg.bn, STAGES=cfg.stages, num_warps=4, **launch,
        )  # fmt: skip

    return _split_k(q, m, w, cfg, run)


def streamk(q, s_t, m, w, s, bm: int, bn: int, per_sm: int, warps: int, stages: int):
    """Launch the stream-K kernel with ``per_sm`` programs per SM (capped at one unit each) and its sum."""
    n, k = w.shape
    kb = k // 128
    t = n // bn
    u = triton.cdiv(m, bm) * t * kb
    p = min(u, per_sm * torch.cuda.get_device_properties(q.device).multi_processor_count)
    slots = triton.cdiv(kb, u // p) + 1  # a tile has KB units, a run at least U // P of them
    part = torch.empty(slots, m, n, dtype=torch.float32, device=q.device)
    launch = pdl.launch_kwargs(q.device)
    _sk_kernel[(p,)](
        q, s_t, w, s, part, m, n, k, kb, t, u, p, q.stride(0), s_t.shape[1],
        BM=bm, BN=bn, num_warps=warps, num_stages=stages, **launch,
    )  # fmt: skip
    out = torch.empty(m, n, dtype=torch.bfloat16, device=q.device)
    _sk_sum_kernel[(triton.cdiv(m * n, 1024),)](
        part, out, m, n, kb, t, u, p, BM=bm, BN=bn, SLOTS=triton.next_power_of_2(slots), BLOCK=1024,
        num_warps=4, **launch,
    )  # fmt: skip
    return out


def ku(
    q: torch.Tensor,
    s_t: torch.Tensor,
    m: int,
    w: torch.Tensor,
    s: torch.Tensor,
    cfg: fp8_gemm.GemmConfig,
    unroll: int,
):
    n, k = w.shape
    assert n % cfg.bn == 0 and k % 128 == 0

    def run(y, kb, per, split, grid, launch):
        _ku_kernel[grid](q, s_t, w, s, y, m, n, k, kb, per, q.stride(0), s_t.shape[1], SPLIT=split > 1,
                         BM=cfg.bm, BN=cfg.bn, KU=unroll, num_warps=cfg.warps, num_stages=cfg.stages,
                         **launch)  # fmt: skip

    return _split_k(q, m, w, cfg, run)


def _split_k(q: torch.Tensor, m: int, w: torch.Tensor, cfg: fp8_gemm.GemmConfig, run) -> torch.Tensor:
    """A variant's launch around ``run(y, kb, per, split, grid, launch)``: the engine's split-K plan
    (``fp8_gemm.w8a8_fused``), the output or FP32 partials buffer, and the engine's sum kernel."""
    n, k = w.shape
    kb = k // 128
    split = min(cfg.split_k, kb)
    per = triton.cdiv(kb, split)
    split = triton.cdiv(kb, per)
    y = torch.empty((split, m, n) if split > 1 else (m, n), device=q.device,
                    dtype=torch.float32 if split > 1 else torch.bfloat16)  # fmt: skip
    launch = pdl.launch_kwargs(q.device)
    run(y, kb, per, split, (triton.cdiv(m, cfg.bm), n // cfg.bn, split), launch)
    if split == 1:
        return y
    out = torch.empty(m, n, dtype=torch.bfloat16, device=q.device)
    fp8_gemm._split_sum_kernel[(triton.cdiv(m * n, 1024),)](
        y, y, out, m * n, n, SPLIT=split, HAS_BIAS=False, BLOCK=1024, num_warps=4, **launch
    )
    return out


def v1(
    q: torch.Tensor, s_t: torch.Tensor, m: int, w: torch.Tensor, s: torch.Tensor, cfg: fp8_gemm.GemmConfig
):
    return fp8_gemm.w8a8_fused(q, w, s, None, cfg, False, s_t, m, torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--gemms", nargs="+", default=[g for g, _, _ in SHAPES])
    parser.add_argument("--unroll", type=int, nargs="*", default=[1, 2, 4], help="K blocks per iteration")
    parser.add_argument("--streamk", action="store_true", help="also the stream-K kernel (sk)")
    parser.add_argument("--ws", action="store_true", help="also the warp-specialized TMA kernel (ws)")
    parser.add_argument("--small-bm", action="store_true", help="also BM 16 and 32 tiles where M > 16")
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    # tensor descriptors made inside a kernel (--ws) need global scratch memory from this allocator
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=dev))
    for name, n, k in SHAPES:
        if name not in args.gemms:
            continue
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        wq, wsc = quantize_weight_blockwise(w)
        copies = [(wq.clone(), wsc.clone()) for _ in range(Fp8GemmChooser.cold_copies(wq, wsc))]
        for m in args.batches:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            q, s_t = quant_triton.quantize_rows(x)
            pad = -(-m // 16) * 16
            qp = torch.zeros(pad, k, dtype=q.dtype, device=dev)
            qp[:m] = q
            sp = torch.ones(s_t.shape[0], pad, dtype=s_t.dtype, device=dev)
            sp[:, :m] = s_t
            best: dict[str, tuple[float, str]] = {}
            bms = [16] if m <= 16 else [16, 32, 64]  # BM below M: more, smaller programs (--small-bm)
            extra = [
                fp8_gemm.GemmConfig(bm, bn, sk, 4, st)
                for bm in (bms if args.small_bm else bms[-1:])
                for bn, sk, st in ((128, 4, 3), (128, 8, 3), (64, 4, 3), (64, 8, 4), (32, 8, 3), (32, 4, 3))
            ]
            for cfg in dict.fromkeys(fp8_gemm.candidates(m) + extra):
                kinds = [("v1", v1)] + [(f"ku{u}", functools.partial(ku, unroll=u)) for u in args.unroll]
                if args.ws:
                    kinds.append(("ws", ws))
                for kind, fn in kinds:
                    try:
                        same = torch.equal(fn(qp, sp, m, wq, wsc, cfg), v1(qp, sp, m, wq, wsc, cfg))
                        us = 1e3 * Fp8GemmChooser._time(
                            [functools.partial(fn, qp, sp, m, wc, sc, cfg) for wc, sc in copies],
                            calls=20,
                            replays=7,
                        )
                    except Exception as exc:  # e.g. shared memory: KU x stages tiles do not fit
                        print(f"  {name} M {m} {cfg} {kind}: failed ({str(exc).splitlines()[0][:80]})")
                        continue
                    if kind not in best or us < best[kind][0]:
                        best[kind] = (us, str(cfg))
                    if not same:
                        print(f"  {name} M {m} {cfg} {kind}: NOT bit-equal to v1")
            ref = v1(qp, sp, m, wq, wsc, fp8_gemm.candidates(m)[0])
            for bn, per_sm, warps, stages in (
                [(bn, c, 4, st) for bn in (32, 64, 128) for c in (1, 2, 3) for st in (3, 4)]
                if args.streamk
                else []
            ):
                bm = 16 if m <= 16 else 64
                label = f"sk bm{bm} bn{bn} {per_sm}/SM w{warps} s{stages}"
                try:
                    out = streamk(qp, sp, m, wq, wsc, bm, bn, per_sm, warps, stages)
                    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    us = 1e3 * Fp8GemmChooser._time(
                        [functools.partial(streamk, qp, sp, m, wc, sc, bm, bn, per_sm, warps, stages)
                         for wc, sc in copies],
                        calls=20,
                        replays=7,
                    )  # fmt: skip
                except Exception as exc:
                    print(f"  {name} M {m} {label}: failed ({str(exc).splitlines()[0][:80]})")
                    continue
                if err > 1e-2:
                    print(f"  {name} M {m} {label}: WRONG, max rel err {err:.2e}")
                    continue
                if "sk" not in best or us < best["sk"][0]:
                    best["sk"] = (us, label)
            floor = n * k / 3.35e12 * 1e6
            line = "  ".join(f"{kind} {us:6.2f} [{shape}]" for kind, (us, shape) in best.items())
            print(f"{name:8s} M {m:4d} floor {floor:4.1f}: {line}", flush=True)


if __name__ == "__main__":
    main()
