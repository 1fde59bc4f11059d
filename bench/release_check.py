"""Colocated memory of the graph decode path, 1.5B shape on CUDA: release + resume time and memory freed.

    python bench/release_check.py
    python bench/release_check.py --cycles 20    # FP8 engine: does memory grow over RL-like cycles?

Per engine (BF16, FP8): allocate for the RL-shaped workload and capture every decode graph
(``Scheduler.prepare``), then time ``release_memory()`` + ``resume_memory()`` (KV cache, decode state and
graphs freed, weights resident), the memory freed, and the re-allocation + re-capture that the next
``generate`` pays (the FP8 GEMM choices are kept, so no re-timing).

``--cycles N``: one FP8 engine runs N cycles of what an RL step asks of it (generate 32 prompts x 8 samples
of 64 random tokens + up to 256 new ones, release, resume, load two layers' weights in place as a new
version) and prints, per cycle, the peak allocated during generate and what stays allocated and reserved
after each part: a number that climbs cycle after cycle is a leak, and the part after which it climbs is
where.
"""

import argparse
import sys
import time

import rollout_peers as peers
import torch
from train_step import model_dir

from infir2_rl.engines.native.engine import NativeEngine
from infir2_rl.types import WeightBucket


def cycles(path: str, n: int) -> None:
    engine = NativeEngine(path, fp8=True, device="cuda", max_batch_size=256)
    reqs = peers.rl_requests(engine.vocab_size, 32, 8, 64, 256, 200)
    names = [f"model.layers.{i}.mlp.down_proj.{t}" for i in (0, 1) for t in ("weight", "weight_scale_inv")]
    gib = 2**30

    def now() -> str:
        torch.cuda.synchronize()
        return f"{torch.cuda.memory_allocated() / gib:7.3f} / {torch.cuda.memory_reserved() / gib:7.3f}"

    print("cycle | generate peak GiB | allocated / reserved GiB after: generate | release | resume | load")
    for i in range(n):
        torch.cuda.reset_peak_memory_stats()
        engine.generate(reqs)
        peak = torch.cuda.max_memory_allocated() / gib
        after_generate = now()
        engine.release_memory()
        after_release = now()
        engine.resume_memory()
        after_resume = now()
        weights = engine.read_weights(names)
        bucket = WeightBucket(
            version=i + 1, index=0, num_buckets=1, names=names, tensors=[weights[k].cuda() for k in names]
        )
        engine.update_weights(bucket)
        del bucket, weights
        print(f"{i:5d} | {peak:17.3f} | {after_generate} | {after_release} | {after_resume} | {now()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cycles", type=int, default=0, help="run N RL-like cycles of one FP8 engine instead"
    )
    args = parser.parse_args(argv)
    path = str(model_dir(False))
    if args.cycles:
        cycles(path, args.cycles)
        return 0
    for fp8 in (False, True):
        engine = NativeEngine(path, fp8=fp8, device="cuda", max_batch_size=256)
        reqs = peers.rl_requests(engine.vocab_size, 64, 16, 128, 2048, 450)
        start = time.perf_counter()
        engine._scheduler.prepare(reqs)
        first = time.perf_counter() - start
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        engine.release_memory()
        engine.resume_memory()
        torch.cuda.synchronize()
        release_ms = 1e3 * (time.perf_counter() - start)
        freed = (before - torch.cuda.memory_allocated()) / 2**30
        resident = torch.cuda.memory_allocated() / 2**30
        start = time.perf_counter()
        engine._scheduler.prepare(reqs)
        again = time.perf_counter() - start
        print(
            f"fp8={fp8}: first allocate+capture {first:.2f} s | release+resume {release_ms:.1f} ms, freed "
            f"{freed:.1f} GiB, resident after release {resident:.1f} GiB | re-allocate+re-capture {again:.2f} s"
        )
        del engine
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
