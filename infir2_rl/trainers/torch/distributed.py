"""Data parallelism for the torch trainer: process group setup, gradient all-reduce, FSDP2.

Two ways to keep data-parallel replicas in step, chosen by device:

* CPU (gloo): every rank holds the full model; after backward the gradients are SUM-all-reduced.
  SUM, not mean: each rank already scales its micro-batch losses by num_units / total_units of the
  *global* batch, so the sum over ranks is exactly the gradient of the global-batch mean.
* CUDA (nccl), world size > 1: FSDP2 `fully_shard` on each decoder layer and the root. FSDP2's
  reduce-scatter averages over ranks, so the trainer multiplies the loss by world_size to undo it.
  Every all-gather is a collective: all ranks must run the same number of forwards, which the
  trainer guarantees by padding the shorter ranks with zero-weight dummy micro-batches.

Gradient reduction stays in FP32 (the parameters are FP32 masters).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

# A rank that waits longer than this on a collective is reported as hung instead of waiting forever.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def free_port() -> int:
    """A TCP port that was free a moment ago on this host (for the process-group rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_process_group(master_addr: str, master_port: int, rank: int, world_size: int) -> None:
    """Join the trainer's process group: nccl when this process has a GPU, else gloo."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum_(tensors: Sequence[torch.Tensor]) -> None:
    """In-place SUM all-reduce of same-device tensors, flattened per dtype into one message each."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = _flatten_dense_tensors(group)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for t, reduced in zip(group, _unflatten_dense_tensors(flat, group)):
            t.copy_(reduced)


def all_reduce_grads_(params: Sequence[nn.Parameter]) -> None:
    """SUM-all-reduce the gradients of replicated parameters (a rank without a gradient sends zeros)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    all_reduce_sum_([p.grad for p in params if p.grad is not None])


def all_reduce_max_int(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def apply_fsdp2(model: nn.Module) -> None:
    """Shard each decoder layer, then the root (embeddings, final norm, lm_head), over all ranks.

    Parameters stay FP32 (the masters); compute runs under autocast, so all-gathers move FP32.
    A MixedPrecisionPolicy(param_dtype=bf16) would halve that traffic; not done here so that
    the FP8 weight cache and the optimizer see one set of FP32 tensors on every path.
    """
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__}: FSDP2 needs a decoder with `model.layers` (HF causal LM layout)"
        )
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
