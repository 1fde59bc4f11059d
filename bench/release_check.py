"""Colocated memory of the graph decode path, 1.5B shape on CUDA: release + resume time and memory freed.

    python bench/release_check.py

Per engine (BF16, FP8): allocate for the RL-shaped workload and capture every decode graph
(``Scheduler.prepare``), then time ``release_memory()`` + ``resume_memory()`` (KV cache, decode state and
graphs freed, weights resident), the memory freed, and the re-allocation + re-capture that the next
``generate`` pays (the FP8 GEMM choices are kept, so no re-timing).
"""

import sys
import time

import rollout_peers as peers
import torch
from train_step import model_dir

from infir2_rl.engines.native.engine import NativeEngine


def main() -> int:
    path = str(model_dir(False))
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
