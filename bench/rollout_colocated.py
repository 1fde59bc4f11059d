"""The rollout as a colocated RL step meets it: BF16 vs FP8 W8A8 ``generate`` right after the engine gave its GPU
memory to the trainer and took it back, on a random Qwen2.5-1.5B-shape model.

    python bench/rollout_colocated.py [--prompts 32] [--samples 8] [--prompt-len 17 64] [--new-tokens 256]
                                      [--repeats 4] [--keep-memory] [--tiny]

A colocated engine releases its KV cache, decode state and decode graphs before the trainer's phases
(``NativeEngine.release_memory``), so each RL step's ``generate`` allocates them again and captures its decode
graphs again. ``bench/rollout.py`` times decode with the graphs already captured; this times the whole call
after ``release_memory`` + ``resume_memory``, as ``bench/rl_1p5b.sh``'s rollout phase runs it (32 prompts x 8
samples, prompts of 17-64 random tokens, 256 new tokens, T = 1, no stop token), and the decode-graph capture
inside it (the scheduler's ``decoder.capture_s``). Both engines live in this process and alternate (BF16, FP8,
BF16, ...), each warmed by one untimed call first. Prints per precision the median wall and capture of
--repeats calls, and FP8 / BF16 with and without the capture. ``--keep-memory``: the same calls without the
release and resume (cache, graphs and prefill graphs kept, as a dedicated engine runs), for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch
from rollout import timed_generate
from train_step import model_dir


def rl_requests(args: argparse.Namespace, vocab: int) -> list[Any]:
    from infir2_rl.types import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=[])
    low, high = args.prompt_len
    return [
        GenerateRequest(
            f"p{i}",
            torch.randint(
                0, vocab, (int(torch.randint(low, high + 1, (1,), generator=g)),), generator=g
            ).tolist(),
            args.samples,
            params,
            seed=i,
        )
        for i in range(args.prompts)
    ]


def colocated_call(engine: Any, reqs: list[Any], keep_memory: bool = False) -> tuple[float, float]:
    """(wall s, decode-graph capture s) of one ``generate`` after the engine released and resumed its memory
    (``keep_memory``: without that, so nothing is captured again)."""
    if not keep_memory:
        engine.release_memory()
        engine.resume_memory()
    decoder = getattr(engine._scheduler, "decoder", None)
    before = decoder.capture_s if keep_memory and decoder is not None else 0.0
    wall = timed_generate(engine, reqs)
    decoder = getattr(engine._scheduler, "decoder", None)  # a new one per allocation after a release
    return wall, (decoder.capture_s if decoder is not None else 0.0) - before


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[17, 64], metavar=("MIN", "MAX"))
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--keep-memory", action="store_true", help="no release/resume before each call")
    p.add_argument("--tiny", action="store_true", help="the tiny CPU model (a smoke run)")
    args = p.parse_args()
    from infir2_rl.engines.native.engine import NativeEngine

    device = torch.device("cpu" if args.tiny else "cuda")
    path = model_dir(args.tiny)
    batch = args.prompts * args.samples
    engines = {
        mode: NativeEngine(str(path), fp8=mode == "fp8", device=device, max_batch_size=batch)
        for mode in ("bf16", "fp8")
    }
    reqs = rl_requests(args, next(iter(engines.values())).vocab_size)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    how = "engine memory kept" if args.keep_memory else "colocated (release + resume before each call)"
    print(f"{name}: {args.prompts} prompts x {args.samples} samples, {args.new_tokens} new tokens, {how}")
    for engine in engines.values():
        colocated_call(engine, reqs)  # warm: GEMM choice, Triton compiles, first captures
    walls: dict[str, list[float]] = {m: [] for m in engines}
    captures: dict[str, list[float]] = {m: [] for m in engines}
    for _ in range(args.repeats):
        for mode, engine in engines.items():
            wall, capture = colocated_call(engine, reqs, args.keep_memory)
            walls[mode].append(wall)
            captures[mode].append(capture)
    med = {m: (statistics.median(walls[m]), statistics.median(captures[m])) for m in engines}
    for mode in engines:
        print(
            f"{mode:4s}: generate {1e3 * med[mode][0]:7.1f} ms (range {1e3 * min(walls[mode]):.1f}-"
            f"{1e3 * max(walls[mode]):.1f}), decode-graph capture in it {1e3 * med[mode][1]:6.1f} ms "
            f"(range {1e3 * min(captures[mode]):.1f}-{1e3 * max(captures[mode]):.1f})"
        )
    (bw, bc), (fw, fc) = med["bf16"], med["fp8"]
    print(f"FP8 / BF16: {fw / bw:.3f} with the capture, {(fw - fc) / (bw - bc):.3f} without it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
