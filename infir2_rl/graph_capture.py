"""How this project captures CUDA graphs (the trainer's layer graphs, the engine's decode graphs, the FP8 GEMM
chooser's timing graphs): one warm-up stream per device and one capture mode.

* ``warmup_stream``: cuBLAS(Lt) keeps a workspace (32 MiB on Hopper) per stream it has run on, for the life of
  the process; a new warm-up stream per capture grew the engine by ~0.19 GiB per release/resume cycle until
  torch's pool of 32 streams came round (``bench/release_check.py --cycles``, docs/performance.md).
* ``capture``: ``torch.cuda.graph`` with ``capture_error_mode="thread_local"``. torch's default, "global",
  also fails the capture when *another thread* of the process makes a call CUDA deems unsafe during it
  (``cudaMalloc``, an event query, a synchronize): the NCCL watchdog of a process group, a Ray worker
  thread, a data loader. The capturing thread itself stays as strict as before, so a sync or an
  allocation outside the pool inside our own captured code still fails loudly. Why: twice the GPU suite's
  first run on a fresh machine failed a layer-graph capture ("operation failed due to a previous error
  during capture") in a process that held an NCCL process group from earlier tests; the offending call was
  not identified (docs/performance.md, "Packed micro-batches").
"""

from __future__ import annotations

import functools
from typing import Any

import torch

CAPTURE_ERROR_MODE = "thread_local"


@functools.cache
def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream per device on which every capture's warm-up runs (module docstring)."""
    return torch.cuda.Stream(device)


def capture(graph: torch.cuda.CUDAGraph, pool: Any = None) -> torch.cuda.graph:
    """``with capture(graph, pool): ...`` records the block into ``graph`` (module docstring)."""
    return torch.cuda.graph(graph, pool=pool, capture_error_mode=CAPTURE_ERROR_MODE)
