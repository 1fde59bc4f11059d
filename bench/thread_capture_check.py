"""Why a decode-graph capture that skips its warm-ups must be on a thread that captured that shape before
(``engines/native/cuda_graphs.py``), 1.5B shape on CUDA.

    python bench/thread_capture_check.py            # the engine as it is: expect "ok" for BF16 and FP8
    python bench/thread_capture_check.py --control  # warm-ups keyed without the thread: expect the capture error

Per engine (BF16, FP8 W8A8): one ``generate`` on the main thread (8 prompts x 8 samples, 32 new tokens; captures
the decode graphs after warm-ups), ``release_memory`` + ``resume_memory`` as a colocated engine between RL
steps, then the same ``generate`` on a new thread, as a threaded Ray actor may run it. Prints whether it ran and
how many eager warm-up steps its capture took. ``--control`` keys the warmed shapes without the thread (the
first version of session 41): the new thread's capture then runs without warm-ups and fails ("operation failed
due to a previous error during capture"; torch makes a thread's cuBLAS handle on its first GEMM). Run each mode
in its own process: a failed capture leaves the process's CUDA state unusable.
"""

from __future__ import annotations

import argparse
import sys
import threading
import types
from typing import Any

from rollout_colocated import rl_requests
from train_step import model_dir


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--control", action="store_true", help="warmed shapes keyed without the thread")
    args = p.parse_args()
    from infir2_rl.engines.native import cuda_graphs
    from infir2_rl.engines.native.engine import NativeEngine

    if args.control:
        cuda_graphs.threading = types.SimpleNamespace(get_ident=lambda: 0)  # type: ignore[assignment]
    shape = argparse.Namespace(prompts=8, samples=8, prompt_len=[17, 64], new_tokens=32)
    for fp8 in (False, True):
        engine = NativeEngine(str(model_dir(False)), fp8=fp8, device="cuda", max_batch_size=64)
        reqs = rl_requests(shape, engine.vocab_size)
        engine.generate(reqs)
        engine.release_memory()
        engine.resume_memory()
        errors: list[str] = []

        def run(engine: Any = engine, reqs: Any = reqs, errors: list[str] = errors) -> None:
            try:
                engine.generate(reqs)
            except Exception as exc:  # the capture error is the result the control shows
                errors.append(repr(exc)[:200])

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        decoder = engine._scheduler.decoder
        print(
            f"{'control' if args.control else 'engine'} {'fp8' if fp8 else 'bf16'}: "
            f"{'FAILED ' + errors[0] if errors else 'ok'}, warm-up steps on the new thread: "
            f"{decoder.warmups if decoder is not None else '-'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
