"""``infir2-rl cast-fp8``: BF16 Hugging Face checkpoint -> blockwise FP8 checkpoint (see checkpoint.py)."""

from __future__ import annotations

import argparse
import sys

from infir2_rl.fp8.checkpoint import cast_checkpoint


def build_parser(prog: str = "infir2-rl cast-fp8") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Cast a BF16/FP32 Hugging Face checkpoint to blockwise FP8 (e4m3, 128x128 weight blocks).",
    )
    parser.add_argument(
        "--input", required=True, help="Hugging Face model directory with config.json + safetensors"
    )
    parser.add_argument("--output", required=True, help="new directory to write (must not exist)")
    # A real flag: `--pow2-scales` / `--no-pow2-scales`; never a string such as "False" parsed as true.
    parser.add_argument(
        "--pow2-scales",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="round every block scale up to a power of two (Transformer Engine's default rule)",
    )
    parser.add_argument(
        "--block-size", type=int, default=128, help="weight block size (only 128 is supported)"
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show a progress bar over shards",
    )
    return parser


def cast_fp8_main(argv: list[str] | None = None, raise_errors: bool = False) -> int:
    """Entry point; returns the process exit code (0 ok, 2 for a refused input or output). ``raise_errors``:
    let a refused input or output propagate (``infir2-rl cast-fp8``, whose handler prints the one line as
    every command does, and the traceback with -v)."""
    args = build_parser().parse_args(argv)
    try:
        report = cast_checkpoint(
            args.input,
            args.output,
            pow2_scales=args.pow2_scales,
            block_size=args.block_size,
            progress=args.progress,
        )
    except ValueError as exc:
        if raise_errors:
            raise
        print(f"cast-fp8: error: {exc}", file=sys.stderr)
        return 2
    gb_in, gb_out = report.bytes_in / 1e9, report.bytes_out / 1e9
    print(
        f"cast-fp8: {report.num_quantized} tensors quantized, {report.num_kept} kept, "
        f"{gb_in:.3f} GB -> {gb_out:.3f} GB in {report.seconds:.1f} s "
        f"({gb_in / max(report.seconds, 1e-9):.2f} GB/s read) -> {args.output}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(cast_fp8_main())
