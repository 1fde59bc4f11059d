"""Where do the trainer's and the rollout engine's log-probs first disagree? Op by op, layer by layer.

    python bench/mismatch_probe.py [--model DIR | --shape tiny|1.5b] [--device cpu|cuda]
                                   [--precision bf16|fp8] [--dtype auto|float32|bfloat16]
                                   [--engine-path eager|runner] [--rows 4] [--prompt-len 16]
                                   [--new-tokens 32] [--temperature 1.0] [--pow2-scales] [--out DIR]

The same B x N random token ids go through
* the trainer's scoring forward: ``TorchTrainer.forward_logprobs`` (the full-sequence forward of
  ``trainers/torch``, FP8 linears ``fp8.linear.Fp8Linear`` with ``--precision fp8``, autocast on a GPU), and
* the native engine with the trainer's weights pushed into it (``export_weights`` -> ``update_weights``, as in
  RL): a prefill of the first P tokens, then teacher-forced decode steps, one token per row per step, through
  the eager transformers path (``--engine-path eager``, the CPU default) or the model runner
  (``runner``, the CUDA default: fused GEMMs, fused norm/rotary/SiLU kernels, split-K decode attention).
Every op's output is recorded on both sides (``engines/native/probe.py`` names them). For each op the
report gives, over prefill positions and over decode positions separately, the largest absolute
difference, that difference relative to the op's largest trainer value, and for an FP8 linear's input the
fraction of 1x128 tiles whose e4m3 codes differ and of tiles whose scales differ. "First disagreement":
the earliest position where any op differs, and the first op (forward order) that differs there: the
root; everything after it in the same row inherits the difference.

Log-probs: the trainer's are ``forward_logprobs``'s own; the engine's are ``log_softmax(logits / T)`` of the
token that follows, the sampler's formula (``engines/sampling.py``). The trainer's ``logits`` row is
recomputed from its ``final_norm`` output as its chunked scorer does (GEMM in the compute dtype).
``--shape 1.5b`` needs a GPU (random weights at the Qwen2.5-1.5B shape, Qwen's vocabulary, as bench/rollout.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from infir2_rl.engines.native.probe import (
    FP8_INPUT_OPS,
    Taps,
    hf_taps,
    op_names,
    runner_decode,
    runner_prefill_kv,
)
from infir2_rl.fp8.quant import quantize_activation_eager


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF model directory (default: a random --shape model)")
    p.add_argument("--shape", choices=("tiny", "1.5b"), default="tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="fp8", help="bf16 = no FP8 linears")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--engine-path", choices=("eager", "runner"), default=None)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fsdp-param-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="trainer.fsdp_param_dtype: bfloat16 runs the trainer under FSDP2 (a one-rank group) on BF16 "
        "copies of its FP32 masters, as the engine's precision flow; auto and float32: FP32 masters under "
        "autocast, no FSDP",
    )
    p.add_argument(
        "--pow2-scales",
        action="store_true",
        help="FP8 scales rounded up to powers of two on both sides (trainer.fp8_pow2_scales): a tile's scale "
        "then changes only when its amax crosses a power of two, not with its last bit",
    )
    p.add_argument("--out", help="directory for probe.json")
    args = p.parse_args(argv)
    args.engine_path = args.engine_path or ("runner" if args.device == "cuda" else "eager")
    if args.shape == "1.5b" and args.device != "cuda" and not args.model:
        p.error("--shape 1.5b: needs --device cuda (a 1.3B model on a CPU takes minutes per op)")
    return args


def model_path(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    if args.shape == "1.5b":
        sys.path.insert(0, str(Path(__file__).parent))
        from train_step import model_dir  # the same random 1.5B-shape model as bench/rollout.py

        return str(model_dir(tiny=False))
    from infir2_rl.models.factory import init_model

    return str(init_model(Path(tempfile.mkdtemp(prefix="probe_")) / "tiny", "tiny", seed=args.seed))


def build(args: argparse.Namespace, path: str) -> tuple[Any, Any]:
    """(trainer, engine holding the trainer's weights, FP8 bytes included)."""
    from infir2_rl.config import ModelConfig, OptimizerConfig
    from infir2_rl.config.components import RlTrainerConfig
    from infir2_rl.engines.native.engine import NativeEngine
    from infir2_rl.trainers.torch.trainer import TorchTrainer
    from infir2_rl.types import WeightBucket

    fp8 = args.precision == "fp8"
    trainer = TorchTrainer(
        ModelConfig(path=path, dtype=args.dtype),
        # Padded rows: the probe compares each op's output row by row (a packed row would mix them).
        RlTrainerConfig(
            fsdp_param_dtype=args.fsdp_param_dtype, fp8_pow2_scales=args.pow2_scales, pack_sequences=False
        ),
        OptimizerConfig(),
        fp8=fp8,
        total_steps=1,
        device=args.device,
        fsdp={"auto": None, "float32": False, "bfloat16": True}[args.fsdp_param_dtype],
    )
    engine = NativeEngine(
        path,
        fp8=fp8,
        dtype=args.dtype,
        device=args.device,
        decode_path=args.engine_path,
        cuda_graphs=False,
        pow2_scales=args.pow2_scales,
    )
    names, tensors = zip(*trainer.export_weights(fp8=fp8))
    engine.update_weights(WeightBucket(1, 0, 1, list(names), list(tensors)))
    return trainer, engine


def trainer_taps(trainer: Any, ids: torch.Tensor, temperature: float) -> Taps:
    from infir2_rl.trainers.token_scores import chunk_z
    from infir2_rl.types import TokenBatch

    taps = Taps()
    batch = TokenBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids))
    with hf_taps(trainer.model, taps):
        (logprobs_BL,) = trainer.forward_logprobs([batch], temperature)
    head = trainer.model.get_output_embeddings().weight.detach()
    dtype = trainer.compute_dtype
    with torch.no_grad():
        for pos, h in taps.values["final_norm"].items():
            z = chunk_z(h.to(head.device, dtype), head.to(dtype), 1.0)  # the scorer's GEMM, untempered
            taps.add("logits", z[:, None], start=pos)
    for pos in range(ids.shape[1] - 1):  # the log-prob of token pos + 1, made at position pos
        taps.add("logprob", logprobs_BL[:, pos + 1, None, None], start=pos)
    return taps


def _engine_logprob(
    taps: Taps, logits_BV: torch.Tensor, ids: torch.Tensor, pos: int, temperature: float
) -> None:
    taps.add("logits", logits_BV[:, None], start=pos)
    if pos + 1 < ids.shape[1]:
        lp = torch.log_softmax(logits_BV.float() / temperature, dim=-1)
        taps.add("logprob", lp.gather(1, ids[:, pos + 1, None].to(lp.device))[:, None], start=pos)


@torch.no_grad()
def engine_taps(engine: Any, ids: torch.Tensor, prompt_len: int, temperature: float, path: str) -> Taps:
    taps, device = Taps(), engine.device
    rows, length = ids.shape
    ids_d = ids.to(device)
    if path == "runner":
        runner = engine._scheduler.runner
        cache = runner.new_cache(rows, length)
        slots = torch.arange(rows, device=device)
        full = torch.full((rows,), prompt_len, device=device)
        logits = runner.prefill(ids_d[:, :prompt_len], full, cache, slots, slots)
        runner_prefill_kv(runner, taps, cache, slots, prompt_len)
        _engine_logprob(taps, logits, ids, prompt_len - 1, temperature)
        for pos in range(prompt_len, length):
            taps.start = pos
            positions = torch.full((rows,), pos, device=device)
            logits = runner_decode(runner, taps, ids_d[:, pos], positions, slots, cache)
            _engine_logprob(taps, logits, ids, pos, temperature)
        return taps
    from transformers import DynamicCache

    cache = DynamicCache(config=engine.config)  # engine.py's _generate_chunk, fed the given tokens
    mask = torch.ones(rows, prompt_len, dtype=torch.long, device=device)
    with hf_taps(engine.model, taps):
        positions = torch.arange(prompt_len, device=device)[None].expand(rows, -1)
        out = engine.model(
            input_ids=ids_d[:, :prompt_len], attention_mask=mask, position_ids=positions,
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        _engine_logprob(taps, out.logits[:, -1], ids, prompt_len - 1, temperature)
        for pos in range(prompt_len, length):
            taps.start = pos
            mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=1)
            out = engine.model(
                input_ids=ids_d[:, pos, None], attention_mask=mask,
                position_ids=torch.full((rows, 1), pos, device=device), past_key_values=cache, use_cache=True,
            )  # fmt: skip
            _engine_logprob(taps, out.logits[:, -1], ids, pos, temperature)
    return taps


def _codes(taps: Taps, name: str, x: torch.Tensor, positions: list[int], pow2: bool) -> torch.Tensor:
    """Dequantized 1x128 e4m3 values (B, T, F): the engine's own codes where it quantized, else ours."""
    own = taps.codes.get(name, {})
    if positions and all(p in own for p in positions):
        q = torch.stack([own[p][0] for p in positions], 1).float()
        s = torch.stack([own[p][1] for p in positions], 1)
    else:
        q8, s = quantize_activation_eager(x, pow2_scales=pow2)
        q = q8.float()
    return torch.cat([q.unflatten(-1, (-1, 128)), s[..., None]], dim=-1)  # (B, T, Kb, 129): codes | scale


def compare_op(name: str, a: Taps, b: Taps, positions: list[int], pow2: bool | None) -> dict[str, Any] | None:
    """Stats of op ``name`` over ``positions`` (a: trainer, b: engine); None when a side lacks them.
    ``pow2`` None: no FP8 linears (no code statistics)."""
    x, y = a.stacked(name, positions), b.stacked(name, positions)
    if x is None or y is None:
        return None
    x64, y64 = x.double(), y.double()
    diff = (x64 - y64).abs()
    per_pos = diff.flatten(2).amax(dim=(0, 2))  # (T,)
    stats: dict[str, Any] = {
        "max_abs": float(diff.max()),
        "rel": float(diff.max() / x64.abs().max().clamp_min(1e-30)),
        "frac_elems_differ": float((diff > 0).double().mean()),
        "first_position": next((positions[t] for t in range(len(positions)) if per_pos[t] > 0), None),
    }
    if pow2 is not None and name.split(".")[-1] in FP8_INPUT_OPS and x.shape[-1] % 128 == 0:
        ca, cb = _codes(a, name, x, positions, pow2), _codes(b, name, y, positions, pow2)
        stats["fp8_tiles_differ"] = float((ca[..., :128] != cb[..., :128]).any(-1).double().mean())
        stats["fp8_scales_differ"] = float((ca[..., 128] != cb[..., 128]).double().mean())
    return stats


def compare(
    trainer: Taps, engine: Taps, num_layers: int, prompt_len: int, length: int, pow2: bool | None
) -> dict:
    phases = {"prefill": list(range(prompt_len)), "decode": list(range(prompt_len, length))}
    ops: dict[str, dict[str, Any]] = {}
    for name in op_names(num_layers):
        row = {}
        for phase, positions in phases.items():
            if name in ("logits", "logprob"):  # made at the last prompt position, then at each decode step
                positions = [p for p in positions if p >= prompt_len - 1 and p < length - 1]
                positions = positions if phase == "decode" else positions[-1:]
            stats = compare_op(name, trainer, engine, positions, pow2)
            if stats is not None:
                row[phase] = stats
        ops[name] = row
    first = None
    for pos in range(length):
        for name, row in ops.items():
            for stats in row.values():
                if stats["first_position"] == pos:
                    first = {"position": pos, "op": name, "prompt_len": prompt_len}
                    break
            if first:
                break
        if first:
            break
    return {"ops": ops, "first_disagreement": first}


def print_table(report: dict) -> None:
    print(
        f"{'op':<16}{'phase':<9}{'max |d|':>11}{'rel':>11}{'elems':>8}{'1st pos':>8}{'fp8 tiles':>10}{'scales':>8}"
    )
    for name, row in report["ops"].items():
        for phase, s in row.items():
            tiles = f"{s['fp8_tiles_differ']:.3f}" if "fp8_tiles_differ" in s else ""
            scales = f"{s['fp8_scales_differ']:.3f}" if "fp8_scales_differ" in s else ""
            first = "" if s["first_position"] is None else str(s["first_position"])
            print(
                f"{name:<16}{phase:<9}{s['max_abs']:>11.3e}{s['rel']:>11.2e}{s['frac_elems_differ']:>8.3f}"
                f"{first:>8}{tiles:>10}{scales:>8}"
            )
    print("first disagreement:", report["first_disagreement"])


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    torch.manual_seed(args.seed)
    path = model_path(args)
    trainer, engine = build(args, path)
    vocab = engine.vocab_size
    length = args.prompt_len + args.new_tokens
    ids = torch.randint(0, vocab, (args.rows, length), generator=torch.Generator().manual_seed(args.seed))
    a = trainer_taps(trainer, ids.to(trainer.device), args.temperature)
    b = engine_taps(engine, ids, args.prompt_len, args.temperature, args.engine_path)
    pow2 = trainer.pow2_scales if args.precision == "fp8" else None
    report = compare(a, b, engine.config.num_hidden_layers, args.prompt_len, length, pow2)
    decode = [p for p in range(args.prompt_len, length - 1)]
    lp_train, lp_engine = a.stacked("logprob", decode), b.stacked("logprob", decode)
    assert lp_train is not None and lp_engine is not None
    r = (lp_train.double() - lp_engine.double()).flatten()
    report["summary"] = {  # over decode positions; r = logp_train - logp_engine, K3 = E[e^r - r - 1]
        "max_abs_dlogp_decode": float(r.abs().max()),
        "mean_abs_dlogp_decode": float(r.abs().mean()),
        "k3_decode": float((r.exp() - r - 1).mean()),
    }
    if args.precision == "fp8":  # the same engine log-probs against a dense (BF16) trainer: the mixed setup
        from infir2_rl.fp8.linear import fp8_disabled
        from infir2_rl.types import TokenBatch

        ids_d = ids.to(trainer.device)
        batch = TokenBatch(ids_d, torch.ones_like(ids_d), torch.ones_like(ids_d))
        with fp8_disabled(trainer.model):
            (dense_BL,) = trainer.forward_logprobs([batch], args.temperature)
        rd = dense_BL[:, [p + 1 for p in decode]].double().cpu() - lp_engine.double().reshape(args.rows, -1)
        rd = rd.flatten()
        report["summary"] |= {
            "mean_abs_dlogp_decode_dense_trainer": float(rd.abs().mean()),
            "k3_decode_dense_trainer": float((rd.exp() - rd - 1).mean()),
        }
        report["summary"]["mixed_over_unified_k3"] = report["summary"]["k3_decode_dense_trainer"] / max(
            report["summary"]["k3_decode"], 1e-30
        )
    report["setup"] = {
        **{k: v for k, v in vars(args).items() if k != "out"}, "model_path": path,
        "torch": torch.__version__, "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "trainer_compute_dtype": str(trainer.compute_dtype), "engine_dtype": str(engine.dtype),
        "trainer_fsdp": trainer.fsdp, "trainer_gathers": str(trainer.fsdp_param_dtype),
    }  # fmt: skip
    print_table(report)
    print("decode log-probs:", report["summary"])
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "probe.json").write_text(json.dumps(report, indent=1))
        print("wrote", out / "probe.json")
    return report


if __name__ == "__main__":
    main()
