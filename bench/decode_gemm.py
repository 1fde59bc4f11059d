"""Decode-sized GEMMs of the 1.5B shape: BF16 against FP8 W8A8 launch shapes, with weights hot in L2 and cold.

    python bench/decode_gemm.py [--batches 16 64 128 256] [--wide] [--gluon] [--gemms qkv o gate_up down] [--out PATH]

Why: the engine's GEMM chooser (``engines/native/linears.Fp8GemmChooser``) times each candidate inside a
CUDA graph. If every call in that graph reads the same weight, the weight sits in the H100's 50 MB L2 after
the first call, while in the decode step every layer's weights come from device memory once per step. This
script times each GEMM both ways - "hot" (one weight, as the chooser did before) and "cold" (a rotation over
copies of the weight totalling >= 256 MB, so each call reads from device memory) - for BF16 ``F.linear``
(cuBLAS), cuBLASLt blockwise FP8 and every Triton launch shape, on producer-quantized input (what the decode
graph feeds). ``--wide`` adds launch shapes outside ``fp8_gemm.candidates`` to find better ones.
``--gluon`` adds the Hopper Gluon kernel's launch shapes (``bench/wgmma_gemm.py``; with ``--wide`` also
stages / unroll variants) and checks its output against the Triton kernel's at the same split-K, bit for bit.
Prints one line per (batch, GEMM): BF16 cold, the best FP8 cold and its shape, the ratio, and the FP8
bandwidth floor at 3.35 TB/s; ``--out`` writes every timing as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import wgmma_gemm as fp8_wgmma  # noqa: E402  (bench/wgmma_gemm.py)

from infir2_rl.engines.native import fp8_gemm  # noqa: E402
from infir2_rl.engines.native.linears import Fp8GemmChooser  # noqa: E402
from infir2_rl.fp8 import gemm as cublas_gemm  # noqa: E402
from infir2_rl.fp8 import quant_triton  # noqa: E402
from infir2_rl.fp8.quant import quantize_weight_blockwise  # noqa: E402

# (name, N, K) of one Qwen2.5-1.5B decoder layer as the engine's runner fuses them.
SHAPES = [("qkv", 2048, 1536), ("o", 1536, 1536), ("gate_up", 17920, 1536), ("down", 1536, 8960)]
COLD_BYTES = 256 * 2**20


def time_graph(fns: list) -> float:
    """Median us per call of ``fns`` (called in turn, >= 20 calls) in one CUDA graph: the chooser's timer."""
    return 1e3 * Fp8GemmChooser._time(fns, calls=20, replays=7)


def _cublas(s_t: torch.Tensor, q: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return cublas_gemm.mm_1x128_128x128(q, s_t, w, s, torch.bfloat16)


def _triton(
    cfg: fp8_gemm.GemmConfig, s_t: torch.Tensor, m: int, q: torch.Tensor, w: torch.Tensor, s: torch.Tensor
) -> torch.Tensor:
    return fp8_gemm.w8a8_fused(q, w, s, None, cfg, False, s_t, m, torch.bfloat16)


def _gluon(
    cfg: fp8_wgmma.WgmmaConfig, s_t: torch.Tensor, m: int, q: torch.Tensor, w: torch.Tensor, s: torch.Tensor
) -> torch.Tensor:
    y = fp8_wgmma.w8a8_partials(q, s_t, m, w, s, None, cfg, torch.bfloat16)
    return y if isinstance(y, torch.Tensor) else fp8_gemm.sum_partials(y)


def gluon_configs(m: int, wide: bool) -> list[fp8_wgmma.WgmmaConfig]:
    out = fp8_wgmma.candidates(m)
    if wide and m >= 64:
        for bm in (64, 128) if m > 64 else (64,):
            for bn in (64, 128, 256) if bm == 64 else (64, 128):
                for sk in (1, 2, 4, 8):
                    for stages, unroll in ((4, 2), (4, 4), (6, 4), (5, 2)):
                        out.append(fp8_wgmma.WgmmaConfig(bm, bn, sk, stages, unroll))
    return list(dict.fromkeys(out))


def wide_configs(m: int) -> list[fp8_gemm.GemmConfig]:
    bms = [16] if m <= 16 else [64, 128, 256] if m >= 128 else [64]
    out = []
    for bm in bms:
        for bn in (32, 64, 128):
            shapes = ((4, 3), (4, 5), (8, 4), (4, 7)) if bm < 256 else ((8, 3), (8, 4), (4, 3))
            for warps, stages in shapes:
                for sk in (1, 2, 4, 8, 16):
                    out.append(fp8_gemm.GemmConfig(bm, bn, sk, warps, stages))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 256])
    parser.add_argument("--wide", action="store_true", help="time launch shapes beyond fp8_gemm.candidates")
    parser.add_argument("--gluon", action="store_true", help="time the Gluon wgmma kernel's shapes too")
    parser.add_argument("--gemms", nargs="+", choices=[name for name, _, _ in SHAPES], default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/decode_gemm.py: needs a CUDA GPU")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for name, n, k in SHAPES:
        if args.gemms and name not in args.gemms:
            continue
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_weight_blockwise(w)
        copies = max(1, COLD_BYTES // (n * k))  # FP8 bytes; BF16 copies below use the same count (2x bytes)
        wq_c = [wq.clone() for _ in range(copies)]
        ws_c = [ws.clone() for _ in range(copies)]
        w_c = [w.clone() for _ in range(copies)]
        for m in args.batches:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            q, s_t = quant_triton.quantize_rows(x)
            ref = F.linear(x, w).float()
            res: dict[str, dict[str, float]] = {}

            def hot_and_cold(fn, weights, x=x):  # fn(x, *weight) -> y; hot: the first weight only
                return {
                    "hot": time_graph([functools.partial(fn, x, *weights[0])]),
                    "cold": time_graph([functools.partial(fn, x, *wt) for wt in weights]),
                }

            res["bf16"] = hot_and_cold(F.linear, [(wi,) for wi in w_c])
            fp8_weights = list(zip(wq_c, ws_c, strict=True))
            if cublas_gemm.fast_path_ok(wq, n, k):
                res["cublaslt"] = hot_and_cold(functools.partial(_cublas, s_t), fp8_weights, x=q)
            cfgs = list(dict.fromkeys(fp8_gemm.candidates(m) + (wide_configs(m) if args.wide else [])))
            for cfg in cfgs:
                run = functools.partial(_triton, cfg, s_t, m)
                try:
                    y = run(q, wq, ws)
                    err = float((y.float() - ref).norm() / ref.norm())
                    if not err < 0.1:
                        raise RuntimeError(f"relative error {err:.3g}")
                    res[str(cfg)] = hot_and_cold(run, fp8_weights, x=q)
                except Exception as exc:  # a shape Triton cannot compile here
                    print(f"  {cfg}: failed ({str(exc).splitlines()[0][:100]})")
            if args.gluon and fp8_wgmma.available(dev):
                same_bits = []
                for gcfg in gluon_configs(m, args.wide):
                    run = functools.partial(_gluon, gcfg, s_t, m)
                    try:
                        y = run(q, wq, ws)
                        twin = _triton(fp8_gemm.GemmConfig(64, 64, gcfg.split_k, 4, 3), s_t, m, q, wq, ws)
                        same_bits.append(torch.equal(y, twin))
                        res[str(gcfg)] = hot_and_cold(run, fp8_weights, x=q)
                    except Exception as exc:
                        print(f"  {gcfg}: failed ({str(exc).splitlines()[0][:200]})")
                print(
                    f"  gluon: {sum(same_bits)} of {len(same_bits)} shapes equal to the Triton kernel bit for bit"
                )
            fp8 = {key: v for key, v in res.items() if key != "bf16"}
            in_list = {str(c) for c in fp8_gemm.candidates(m)} | {"cublaslt"}
            best_cold = min(fp8, key=lambda key: fp8[key]["cold"])
            best_old = min(
                (key for key in fp8 if not key.startswith("gluon")), key=lambda key: fp8[key]["cold"]
            )
            best_hot_listed = min((key for key in fp8 if key in in_list), key=lambda key: fp8[key]["hot"])
            floor = n * k / 3.35e12 * 1e6
            row = dict(gemm=name, m=m, n=n, k=k, floor_us=floor, timings=res, best_cold=best_cold, best_old=best_old,
                       chooser_hot_pick=best_hot_listed)  # fmt: skip
            rows.append(row)
            print(
                f"b{m:<4d} {name:8s} BF16 cold {res['bf16']['cold']:6.1f} (hot {res['bf16']['hot']:5.1f}) | "
                f"FP8 best cold {fp8[best_cold]['cold']:6.1f} [{best_cold}] x{res['bf16']['cold'] / fp8[best_cold]['cold']:.2f} | "
                f"best without gluon {fp8[best_old]['cold']:6.1f} [{best_old}] | floor {floor:4.1f} us",
                flush=True,
            )  # fmt: skip
        del wq_c, ws_c, w_c
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
