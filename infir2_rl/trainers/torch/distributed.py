"""Data parallelism for the torch trainer: process group setup, gradient all-reduce, FSDP2.

Two ways to keep data-parallel ranks in step (`trainer.data_parallel`, resolved by `resolve_data_parallel`):

* Replicas (`replicate`; always on CPU over gloo): every rank holds the full model and runs the one-GPU path
  (on a GPU: a BF16 model with FP32 masters, the flat AdamW, CUDA layer graphs); after backward the
  gradients are SUM-all-reduced (with masters: each segment's FP32 gradient buffer in place,
  `MasterWeights.all_reduce_grads`). SUM, not mean: each rank already scales its micro-batch losses by
  num_units / total_units of the *global* batch, so the sum over ranks is exactly the gradient of the
  global-batch mean; every rank gets the same sums, so the replicas stay bit-equal.
* FSDP2 (`fsdp`): `fully_shard` on each decoder layer and the root. FSDP2's reduce-scatter averages over
  ranks, so the trainer multiplies the loss by world_size to undo it. Every all-gather is a collective: all
  ranks must run the same number of forwards, which the trainer guarantees by padding the shorter ranks
  with zero-weight dummy micro-batches. Any model size, but each rank runs eagerly on FP32 parameters.
  `auto` on GPUs takes replicas when a model's trainer state fits one GPU comfortably (`REPLICA_MAX_BYTES`;
  why and what it measured: the `trainer.data_parallel` comment in config/components.py).

What FSDP2 gathers (`trainer.fsdp_param_dtype`, resolved by `resolve_fsdp_param_dtype`): the sharded
parameters are always the FP32 masters (AdamW and its moments stay FP32). With `bfloat16` (`auto` on a GPU
whose compute dtype is bfloat16) each shard is cast to BF16 before the all-gather
(`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`): half the all-gather bytes, and no
per-forward FP32 -> BF16 cast of the weights under autocast. The gradients come out of the backward in BF16
and are reduce-scattered in FP32 into FP32 gradient shards (accumulation over micro-batches stays FP32).
What changes numerically, all of it BF16 rounding that autocast already applied to the GEMM inputs: the
norm weights and embeddings are BF16 in the forward (so is the residual stream, as in the rollout engine),
the per-micro-batch weight gradient is rounded to BF16 before its FP32 reduction, and an `Fp8Linear`
quantizes the gathered BF16 weight (its 128x128 amax and e4m3 rounding see BF16(master) instead of the FP32
master). `TorchTrainer.export_weights` quantizes BF16(master) the same way under FSDP, so the rollout gets
the bytes the trainer trains with. `float32` (`auto` on CPU) gathers the masters as they are: bit-for-bit
the single-worker numbers up to summation order, which is what the CPU tests pin.

One GPU: `auto` keeps the plain single-rank path (FP32 masters under autocast, no FSDP). Set to `bfloat16`,
a single rank also runs under FSDP2, on a one-rank group (`ensure_one_rank_group`), only for the BF16
forward copies: the trainer's forward then computes in the rollout engine's precision flow. On a 2-core
CPU's tiny model that cut the unified-FP8 train/rollout K3 3.9x; at 1.5B on an H100 only 1.07x (BF16 1.16x),
for 38% (FP8) and 17% (BF16) more step time (docs/mismatch.md, source 1).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

# A rank that waits longer than this on a collective is reported as hung instead of waiting forever.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
log = logging.getLogger(__name__)


# trainer.data_parallel=auto on GPUs: replicas when each GPU's trainer state is at most REPLICA_MAX_BYTES, at
# REPLICA_BYTES_PER_PARAM: BF16 model 2, FP32 masters 4, FP32 gradients 4, AdamW moments 8, kept FP8 weights
# ~1 (1.5B: ~27 GiB, 29.2 GiB measured at its training peak; 3B and up: FSDP2). Activations, CUDA graphs
# and a colocated engine need the rest of an 80 GB GPU.
REPLICA_BYTES_PER_PARAM = 19
REPLICA_MAX_BYTES = 40 << 30


def count_parameters(model_path: str) -> int:
    """The model's parameter count, from its config.json alone (built on the meta device: no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def resolve_data_parallel(
    setting: str, num_workers: int, use_gpu: bool, num_params: Callable[[], int]
) -> bool | None:
    """``trainer.data_parallel`` -> the ``fsdp`` flag of a group of ``num_workers`` ranks: True shards with
    FSDP2, False keeps replicas, None leaves it to the worker (one worker; or CPU, where it keeps replicas).
    ``auto`` on GPUs calls ``num_params`` (``count_parameters``) and keeps replicas when their state fits
    ``REPLICA_MAX_BYTES``; the choice is logged with the numbers it was made on."""
    if num_workers < 2:
        return None
    if setting != "auto":
        return setting == "fsdp"
    if not use_gpu:
        return None
    count = num_params()
    fsdp = count * REPLICA_BYTES_PER_PARAM > REPLICA_MAX_BYTES
    log.info(
        "trainer.data_parallel=auto: %s (%.2fB parameters, ~%.0f GiB of trainer state per replica, %s %.0f)",
        "fsdp" if fsdp else "replicate", count / 1e9, count * REPLICA_BYTES_PER_PARAM / 2**30,
        ">" if fsdp else "<=", REPLICA_MAX_BYTES / 2**30,
    )  # fmt: skip
    return fsdp


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


def ensure_one_rank_group() -> None:
    """A process group of this process alone (FSDP2 needs one even for a single rank), unless one exists."""
    if not dist.is_initialized():
        init_process_group("127.0.0.1", free_port(), 0, 1)


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


def resolve_fsdp_param_dtype(setting: str, device: torch.device, compute_dtype: torch.dtype) -> torch.dtype:
    """`trainer.fsdp_param_dtype`: `auto` gathers BF16 on a GPU that computes in BF16, else FP32."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" and compute_dtype == torch.bfloat16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[setting]


def apply_fsdp2(model: nn.Module, param_dtype: torch.dtype = torch.float32) -> None:
    """Shard each decoder layer, then the root (embeddings, final norm, lm_head), over all ranks.

    The shards are the FP32 masters; ``param_dtype`` is what the forward gathers (see the module docstring).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__}: FSDP2 needs a decoder with `model.layers` (HF causal LM layout)"
        )
    policy = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == torch.float32 else param_dtype, reduce_dtype=torch.float32
    )
    # The mesh on the model's device: fully_shard's default is a CUDA mesh whenever CUDA is available, which
    # would move a CPU trainer's shards to the GPU.
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def gathered_like_forward(full: torch.Tensor, param_dtype: torch.dtype) -> torch.Tensor:
    """A full FP32 master as the FSDP forward sees it (rounded to ``param_dtype``): what an ``Fp8Linear``
    quantizes, so an export that quantizes this sends the bytes the trainer trains with."""
    return full if full.dtype == param_dtype or not full.is_floating_point() else full.to(param_dtype)


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
