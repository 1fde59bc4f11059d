"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (Hopper and later GPUs).

Why: an FP8 decode step at 1.5B is ~370 small kernels (13 per layer), most of them a few microseconds
long, and in a CUDA graph each one starts only after the previous one has finished and flushed its writes.
With PDL (CUDA's programmatic stream serialization, Triton's ``launch_pdl=True``) a kernel is launched as
soon as every program of the kernel before it has executed ``griddepcontrol.launch_dependents``; it then
runs up to its own ``griddepcontrol.wait``, which returns once the kernel before it has completed and its
writes are visible. The launch and the programs' start overlap the previous kernel's tail. CUDA graph
capture keeps these programmatic edges (CUDA >= 12.3).

Measured on an H100 (docs/performance.md, "Rollout decode", session 14): a chain of tiny dependent kernels
in a graph costs 0.7-0.9 us per kernel with PDL against 1.0-1.3 us without (``bench/pdl_chain.py``); the FP8
decode step, whose GEMMs are our Triton kernels, gained 1-13% depending on batch size; BF16, whose GEMMs are
cuBLAS (no PDL), about nothing. Prefetching the GEMM's weight rows into L2 before the wait was tried and
dropped: it did not help and the FP8 step at batch 256 was slower with it.

The rule every kernel launched with ``launch_kwargs`` follows, so that results are the same bits as without
PDL (GPU test ``test_pdl_decode_equals_plain_launches``):

1. Before ``gdc_wait()`` it reads nothing an earlier kernel writes and writes nothing at all; every program
   calls ``gdc_wait()``, so a kernel completes only after the one before it did, and the order holds
   transitively along the chain.
2. It calls ``gdc_launch_dependents()`` right after the wait, so at most one kernel runs ahead.

Kernels launched without PDL (torch ops, cuBLAS) keep the usual stream order; a PDL kernel after one of them
is launched only when it has completed. ``INFIR2_PDL=0`` turns PDL off (kernels then compile without the
wait and trigger instructions); it is read at every launch, and ``forced(on)`` overrides it for a block, so
a benchmark can compare both in one process (``bench/rollout.py --pdl both``). A CUDA graph keeps the launches
it captured: what counts for a graph is the setting when it was captured.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch

from infir2_rl.env import env_flag, env_flag_set

log = logging.getLogger(__name__)

try:
    import triton

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    _HAVE_TRITON = False
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAVE_GDC = True
except ImportError:  # pragma: no cover - CPU-only installs, or a Triton without grid dependency control
    _HAVE_GDC = False

ENV = "INFIR2_PDL"
_forced: bool | None = None  # set by ``forced`` (benchmarks and tests comparing both in one process)


def requested() -> bool:
    """False when ``INFIR2_PDL`` is ``0``, ``false``, ``off`` or ``no``, on otherwise (the default), unless
    inside ``forced``."""
    if _forced is not None:
        return _forced
    return env_flag(ENV, True)


@contextlib.contextmanager
def forced(on: bool) -> Iterator[None]:
    """PDL on or off for the launches (and CUDA graph captures) made inside the block, whatever the env."""
    global _forced
    before, _forced = _forced, on
    try:
        yield
    finally:
        _forced = before


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """PDL for kernels on ``device``: a CUDA device of compute capability 9.0 or later, a Triton with grid
    dependency control, and not turned off by ``INFIR2_PDL``."""
    if device.type != "cuda" or not requested():
        return False
    if not _HAVE_GDC:
        if env_flag_set(ENV):
            _say_no_gdc()
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _say_no_gdc() -> None:
    log.warning("%s is set, but this Triton has no grid dependency control: kernels launch without PDL", ENV)


if _HAVE_GDC:

    @triton.jit
    def wait_then_release():
        """Rule 1 then rule 2 of the module docstring: call it first thing in a kernel."""
        gdc_wait()
        gdc_launch_dependents()

elif _HAVE_TRITON:  # pragma: no cover - enabled() is False here, so no kernel compiles the call

    @triton.jit
    def wait_then_release():
        pass


def launch_kwargs(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a Triton launch: the ``PDL`` constexpr of our kernels, and ``launch_pdl``."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}
