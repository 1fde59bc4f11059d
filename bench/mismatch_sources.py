"""Each source of train/rollout disagreement alone: the same inputs through the trainer's and the engine's op.

    python bench/mismatch_sources.py [--device cpu|cuda] [--dtype float32|bfloat16] [--shape tiny|1.5b]
                                     [--rows 8] [--seq 256] [--out PATH]

``bench/mismatch_probe.py`` finds where a whole model's two runs first differ; this measures each candidate
cause on random inputs at a model's shapes, with everything else held equal:

* ``matmul_by_M``: one linear on all B x L rows (the trainer's full-sequence GEMM) against the same last B
  rows alone (a decode step's GEMM) and one row alone: does a row's output depend on how many rows share
  the GEMM (tiling / split-K chosen by M)?
* ``fp8_linear_by_M``: the same with ``fp8.ops.fp8_linear_forward`` (1x128 activation tiles are per row, so
  only the GEMM's order can differ).
* ``attention_cache_vs_causal``: row t of causal SDPA over L positions (trainer) against SDPA of query t over
  keys 0..t (a decode step over the cache, as transformers' DynamicCache holds them) and against query t over
  a longer masked cache (the runner's ``attention.decode_sdpa``).
* ``rotary_table``: transformers' cos/sin computed for the whole sequence, for one position alone (a decode
  call), and looked up in a table computed once over all positions (the runner).
* ``rms_norm_by_M``: RMSNorm of all rows against one row.
* ``log_softmax_formula``: ``z[y] - logsumexp(z)`` (trainer's chunked scorer) against ``log_softmax(z)[y]``
  (engine's sampler).
* ``fp32_vs_bf16_activation_before_quant``: the same FP32 activations quantized as they are (the trainer under
  autocast: FP32 residual stream and norm outputs) and after rounding to BF16 (a BF16 engine).
* ``e4m3_flip_rate``: how often a relative perturbation of one ulp of the compute dtype in every element
  changes a tile's e4m3 codes (how FP8 amplifies the differences above into whole e4m3 steps).
Each row reports the largest absolute difference and the fraction of elements that differ.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = {  # hidden, heads, kv heads, head dim, vocab
    "tiny": (128, 4, 2, 32, 310),
    "1.5b": (1536, 12, 2, 128, 151936),
}


def diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a.double() - b.double()).abs()
    return {"max_abs": float(d.max()), "frac_differ": float((d > 0).double().mean())}


def run(device: str, dtype: torch.dtype, shape: str, rows: int, seq: int) -> dict[str, Any]:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from infir2_rl.engines.native.attention import decode_sdpa
    from infir2_rl.engines.native.fused_ops import rms_norm_torch
    from infir2_rl.fp8.ops import fp8_linear_forward
    from infir2_rl.fp8.quant import quantize_activation_eager, quantize_weight_blockwise

    hidden, heads, kv_heads, dim, vocab = SHAPES[shape]
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*s: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*s, generator=g) * scale).to(device, dtype)

    out: dict[str, Any] = {}
    x = randn(rows * seq, hidden)
    w = randn(hidden, hidden, scale=hidden**-0.5)
    full = x @ w.t()
    out["matmul_by_M"] = {
        f"M={rows} vs M={rows * seq}": diff(full[-rows:], x[-rows:] @ w.t()),
        f"M=1 vs M={rows * seq}": diff(full[-1:], x[-1:] @ w.t()),
    }
    w8, s8 = quantize_weight_blockwise(w.float())
    f8 = fp8_linear_forward(x, w8, s8)
    out["fp8_linear_by_M"] = {
        f"M={rows} vs M={rows * seq}": diff(f8[-rows:], fp8_linear_forward(x[-rows:], w8, s8)),
        f"M=1 vs M={rows * seq}": diff(f8[-1:], fp8_linear_forward(x[-1:], w8, s8)),
    }
    q, k, v = randn(rows, heads, seq, dim), randn(rows, kv_heads, seq, dim), randn(rows, kv_heads, seq, dim)
    group = heads // kv_heads
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    causal = F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
    worst_exact, worst_masked = {"max_abs": 0.0, "frac_differ": 0.0}, {"max_abs": 0.0, "frac_differ": 0.0}
    cache_k = torch.zeros(rows, kv_heads, seq + 64, dim, device=device, dtype=dtype)
    cache_v = torch.zeros_like(cache_k)
    cache_k[:, :, :seq], cache_v[:, :, :seq] = k, v
    slots = torch.arange(rows, device=device)
    positions = range(seq // 2, seq, max(1, seq // 32))
    for t in positions:
        exact = F.scaled_dot_product_attention(q[:, :, t : t + 1], ke[:, :, : t + 1], ve[:, :, : t + 1])
        d = diff(causal[:, :, t : t + 1], exact)
        worst_exact = {k2: max(worst_exact[k2], d[k2]) for k2 in d}
        lengths = torch.full((rows,), t + 1, device=device)
        lengths[0] = seq + 64  # one longer row: the others read a masked tail, as in a real decode batch
        masked = decode_sdpa(q[:, :, t], cache_k, cache_v, slots, lengths)[1:]
        d = diff(causal[1:, :, t].reshape(rows - 1, -1), masked)
        worst_masked = {k2: max(worst_masked[k2], d[k2]) for k2 in d}
    out["attention_cache_vs_causal"] = {"keys 0..t": worst_exact, "masked longer cache": worst_masked}
    config = Qwen2Config(hidden_size=hidden, num_attention_heads=heads, max_position_embeddings=4 * seq)
    config.head_dim = dim  # not in Qwen2Config's typed signature; read by the rotary embedding
    rope = Qwen2RotaryEmbedding(config).to(device)
    probe = torch.empty(1, dtype=dtype, device=device)
    pos = torch.arange(seq, device=device)[None]
    cos_full, sin_full = rope(probe, pos)
    cos_table, sin_table = rope(probe, torch.arange(4 * seq, device=device)[None])
    worst = {"max_abs": 0.0, "frac_differ": 0.0}
    for t in positions:
        cos_one, sin_one = rope(probe, pos[:, t : t + 1])
        d = diff(torch.cat([cos_full[:, t], sin_full[:, t]]), torch.cat([cos_one[:, 0], sin_one[:, 0]]))
        worst = {k2: max(worst[k2], d[k2]) for k2 in d}
    out["rotary_table"] = {
        "one position vs whole sequence": worst,
        "table over 4L positions vs whole sequence": diff(
            torch.cat([cos_full, sin_full]), torch.cat([cos_table[:, :seq], sin_table[:, :seq]])
        ),
    }
    norm_w = randn(hidden) + 1
    normed = rms_norm_torch(x, norm_w, 1e-6)
    out["rms_norm_by_M"] = {f"M=1 vs M={rows * seq}": diff(normed[-1:], rms_norm_torch(x[-1:], norm_w, 1e-6))}
    z = (torch.randn(rows * 16, vocab, generator=g) * 4).to(device)
    y = torch.randint(0, vocab, (rows * 16, 1), generator=g).to(device)
    out["log_softmax_formula"] = diff(
        z.gather(1, y) - torch.logsumexp(z, -1, keepdim=True), torch.log_softmax(z, -1).gather(1, y)
    )
    a = (torch.randn(4096, 128, generator=g) * 3).to(device, dtype)
    ulp = torch.finfo(dtype).eps
    qa, sa = quantize_activation_eager(a)
    flips = {}
    for rel in (ulp, 4 * ulp):
        qb, sb = quantize_activation_eager(
            a * (1 + rel * torch.sign(torch.randn(a.shape, generator=g)).to(device, dtype))
        )
        flips[f"relative {rel:.1e}"] = {
            "tiles_with_code_change": float((qa.float() != qb.float()).any(-1).double().mean()),
            "elements_with_code_change": float((qa.float() != qb.float()).double().mean()),
            "scales_changed": float((sa != sb).double().mean()),
        }
    out["e4m3_flip_rate"] = flips
    a32 = (torch.randn(4096, 128, generator=g) * 3).to(device)
    q32, s32 = quantize_activation_eager(a32)
    q16, s16 = quantize_activation_eager(a32.bfloat16())
    out["fp32_vs_bf16_activation_before_quant"] = {
        "tiles_with_code_change": float((q32.float() != q16.float()).any(-1).double().mean()),
        "elements_with_code_change": float((q32.float() != q16.float()).double().mean()),
        "scales_changed": float((s32 != s16).double().mean()),
    }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--shape", choices=tuple(SHAPES), default="tiny")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--out", help="JSON file")
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    result = run(args.device, getattr(torch, args.dtype), args.shape, args.rows, args.seq)
    result["setup"] = {**vars(args), "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return result


if __name__ == "__main__":
    main()
