"""How the weight sync's many tensor copies are issued: foreach copies by dtype vs one copy_ per tensor.

    python bench/copy_pairs.py [--reps 20] [--precision unified_fp8 bf16]

The engine's receiver copies every pushed tensor into its weights, and the trainer copies its export into
the one CUDA IPC buffer (``weight_sync.buckets.copy_pairs``, ``transport.flatten``). This times those copies
alone for the tensors of one push at the Qwen2.5-1.5B shape (28 layers; FP8: 534 tensors, 1.78 GB; BF16:
338 tensors, 3.09 GB), random bytes, sources views of one flat buffer as in a push: each way of issuing them,
host time from the first call until ``torch.cuda.synchronize()`` returns (what the receiver waits for),
median of --reps after 3 warm-ups, all ways in one process.
  foreach   ``torch._foreach_copy_`` per (dtype) group (``copy_pairs`` until session 43)
  each      ``dst.copy_(src)`` per pair (a cudaMemcpyAsync per tensor for same-dtype contiguous pairs)
  split:X   pairs of >= X bytes one by one, the rest by foreach
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from infir2_rl.weight_sync.transport import flatten

HIDDEN, INTER, LAYERS, VOCAB, HEAD, KV_HEADS = 1536, 8960, 28, 151_936, 128, 2


def push_tensors(fp8: bool, device: torch.device) -> list[torch.Tensor]:
    """Random tensors shaped and typed as one push of the 1.5B shape (embedding, then each layer)."""
    g = torch.Generator(device=device).manual_seed(0)

    def u8(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Random bytes viewed as ``dtype`` (no NaN questions: the copies move bytes)."""
        width = shape[-1] * dtype.itemsize
        raw = torch.randint(0, 120, (*shape[:-1], width), generator=g, device=device, dtype=torch.uint8)
        return raw.view(dtype)

    out = [u8((VOCAB, HIDDEN), torch.bfloat16)]
    kv = KV_HEADS * HEAD
    for _ in range(LAYERS):
        out += [u8((HIDDEN,), torch.bfloat16)]  # input norm
        for n, k in (
            (HIDDEN, HIDDEN),
            (kv, HIDDEN),
            (kv, HIDDEN),
            (HIDDEN, HIDDEN),
            (INTER, HIDDEN),
            (INTER, HIDDEN),
            (HIDDEN, INTER),
        ):
            if fp8:
                out += [u8((n, k), torch.float8_e4m3fn), u8((-(-n // 128), -(-k // 128)), torch.float32)]
            else:
                out += [u8((n, k), torch.bfloat16)]
        out += [u8((HIDDEN,), torch.bfloat16) for _ in range(3)]  # q/k/v biases (by size)
        out += [u8((HIDDEN,), torch.bfloat16)]  # post-attention norm
    out += [u8((HIDDEN,), torch.bfloat16)]  # final norm
    return out


def issue(pairs: list[tuple[torch.Tensor, torch.Tensor]], how: str) -> None:
    if how == "each":
        for dst, src in pairs:
            dst.copy_(src)
        return
    limit = int(how.split(":")[1]) if how.startswith("split:") else None
    groups: dict[tuple[torch.dtype, torch.dtype], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for dst, src in pairs:
        if limit is not None and dst.dtype == src.dtype and src.numel() * src.element_size() >= limit:
            dst.copy_(src)
        else:
            groups.setdefault((dst.dtype, src.dtype), []).append((dst, src))
    for group in groups.values():
        torch._foreach_copy_([d for d, _ in group], [s for _, s in group])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cpu: checks the script")
    parser.add_argument(
        "--precision", nargs="+", default=["unified_fp8", "bf16"], choices=("unified_fp8", "bf16")
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    ways = ["foreach", "each", "split:65536", "split:1048576"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"# {name} | torch {torch.__version__} | host ms until synchronized, median of {args.reps}")
    for precision in args.precision:
        tensors = push_tensors(precision == "unified_fp8", device)
        _, sources, _ = flatten(tensors)
        pairs = list(zip([torch.empty_like(t) for t in tensors], sources))
        gb = sum(t.numel() * t.element_size() for t in tensors) / 1e9
        times: dict[str, list[float]] = {w: [] for w in ways}
        for rep in range(args.reps + 3):
            for way in ways:  # interleaved: no way gets a quieter machine
                sync()
                start = time.perf_counter()
                issue(pairs, way)
                sync()
                if rep >= 3:
                    times[way].append((time.perf_counter() - start) * 1e3)
        for dst, src in pairs:
            assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
        base = statistics.median(times["foreach"])
        print(f"\n## {precision}: {len(pairs)} tensors, {gb:.2f} GB")
        for way, ms in times.items():
            med = statistics.median(ms)
            print(f"{way:<16} {med:7.2f} ms  [{min(ms):.2f}, {max(ms):.2f}]  foreach / this {base / med:.2f}")


if __name__ == "__main__":
    main()
