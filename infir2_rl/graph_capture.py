"""How this project captures CUDA graphs (the trainer's layer graphs, the engine's decode graphs, the FP8 GEMM
chooser's timing graphs): one warm-up stream per device, one capture mode, no garbage collection inside.

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
* ``capture`` also turns Python's cyclic garbage collector off for the capture. torch (2.11) no longer
  collects before a capture, so a collection could run inside one, triggered by any allocation of Python
  objects, and free an unreachable ``CUDAGraph`` from earlier work (an engine's graphs, a timing graph):
  its ``cudaGraphExecDestroy`` on the capturing thread invalidates the capture. That was the cause of the
  failures above: the GPU suite's first run on a fresh machine failed the same two tests again in session
  21, and CUDA's error log (``CUDA_LOG_FILE``) showed 14 ``cuGraphExecDestroy`` calls rejected on the
  capturing thread just before "Capture was invalidated by a prior API call". GPU test:
  ``tests/test_graph_capture_gpu.py``.
* ``time_in_graph`` and ``cold_copies``: how GEMM candidates are timed (the engine's FP8 chooser,
  ``engines/native/linears.py``, and the true_on_policy plan's workspace choice, ``models/invariant_ops.py``):
  inside a CUDA graph, over copies of the weight that together exceed the L2 cache.
* ``sm_count``: the GPU's multiprocessors, for kernels that size their grids by it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch

CAPTURE_ERROR_MODE = "thread_local"


@functools.cache
def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream per device on which every capture's warm-up runs (module docstring)."""
    return torch.cuda.Stream(device)


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, pool: Any = None) -> Iterator[None]:
    """``with capture(graph, pool): ...`` records the block into ``graph``, with the cyclic garbage collector
    off meanwhile (module docstring)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=CAPTURE_ERROR_MODE):
            yield
    finally:
        if collecting:
            gc.enable()


def time_in_graph(
    fn: Callable[[], Any] | list[Callable[[], Any]], calls: int = 10, replays: int = 5
) -> float:
    """Milliseconds per call: the callables in turn (a list rotates over operands), ``calls`` or more per
    graph replay, median over ``replays`` replays. Launch overhead is excluded, which favours neither
    Triton's nor cuBLAS's launcher."""
    fns = fn if isinstance(fn, list) else [fn]
    for f in fns:
        f()
    torch.cuda.synchronize()
    sequence = fns * -(-calls // len(fns))
    graph = torch.cuda.CUDAGraph()
    with capture(graph):
        for f in sequence:
            f()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(sequence))
    return statistics.median(times)


def cold_copies(*tensors: torch.Tensor) -> int:
    """How many copies of ``tensors`` exceed twice the L2 cache (at least 1, at most 64): timed calls that rotate
    over them read their weight from device memory, as every layer's GEMM does once per decode step."""
    l2 = getattr(torch.cuda.get_device_properties(tensors[0].device), "L2_cache_size", 50 * 2**20)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return max(1, min(64, -(-2 * l2 // max(nbytes, 1))))


@functools.lru_cache(maxsize=8)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The CUDA device's multiprocessors (the current device for a bare ``cuda``)."""
    return _sms(device.index if device.index is not None else torch.cuda.current_device())
