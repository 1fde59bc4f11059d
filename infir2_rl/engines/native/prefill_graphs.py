"""Small prefills replayed from CUDA graphs, one per (prompts, length) bucket, so their host work is one replay.

Why: a prefill of a few prompts is host-bound. On an H100 at the 1.5B shape, 2 prompts x 128 tokens took
16 ms (BF16) and 28-34 ms (FP8) of wall for 4.1 / 4.6 ms of kernels: Triton's launcher alone costs ~50 us
per kernel and FP8 launches more kernels (docs/performance.md, "Small FP8 prefills"), so FP8 was the slower
precision exactly where a user runs ``generate`` on a few prompts.

How (``PrefillGraphs.run``): the prompts are padded to a bucket, a power of two of at least 64 positions by a
power of two of prompts, up to ``max_tokens`` tokens (larger prefills are kernel-bound and run eagerly). Each
bucket's graph is captured on first use from ``Qwen2Runner.prefill_forward`` over static input buffers (pad
prompts take the pad token and length 1). Its FP8 GEMMs take the chooser's timed choice at the bucket's M,
as decode does (cuBLASLt's blockwise kernels are slow at M <= 256). Keys and values go to a staging buffer of
the graph's own, and after the replay one indexed copy per group of layers puts the real prompts' into
their rows' slots: the graphs never see the KV cache, so they survive its re-allocation. Replays read the
weights in place, so weight sync reaches them.

A colocated engine keeps them across ``release_memory`` (``Scheduler.release(colocated=True)``): the graphs
and their pool stay while the trainer runs, about 0.26 GiB per engine at the 1.5B shape for the RL step's one
bucket (32 prompts x 64 tokens; ``bench/rollout_colocated.py --ab``, H200). A run whose admissions meet every
bucket (21 of them up to 2,048 tokens) would hold ~0.9 GiB at 1.5B (arithmetic, not measured: each bucket keeps
its K/V staging and logits, ~0.66 GB summed, the intermediates share the pool, ~0.2 GB); all buckets share one
pool, so dropping some would return nothing. Each RL step's first prefill has no
decode steps queued to hide behind, and eagerly it cost the FP8 engine 45 ms of host-bound launches against
17 ms from the graph (BF16: 20 against 18). ``Scheduler.keep_prefill_graphs = False`` drops them at the first
colocated release instead, for good (before session 41, the only rule). On CPU prefill is eager.

Under ``true_on_policy`` the graphs replay the runner's prefill by the trainer's walk (``invariant.py``), whose
every kernel gives a row the same bits at any number of rows: the pad prompts and pad positions of a bucket
change no real token's keys, values or logits (GPU test ``test_true_on_policy_gpu.py``). Eagerly that walk
is host-bound: one launch per op, each FP8 GEMM's input quantized in a launch of its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from infir2_rl.engines.native.kv_cache import KVCache
from infir2_rl.engines.native.model_runner import Qwen2Runner
from infir2_rl.graph_capture import capture, warmup_stream

logger = logging.getLogger(__name__)

MIN_LENGTH = 64
MAX_TOKENS = 2048  # prompts x length of the largest graphed bucket; beyond, the prefill is kernel-bound
_SCATTER_BYTES = 64 * 2**20  # the indexed K/V copy runs over groups of layers of about this many bytes


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class _Bucket:
    graph: torch.cuda.CUDAGraph
    ids: Tensor  # (P, L) prompt ids, right-padded
    lengths: Tensor  # (P,)
    kv: Tensor  # (layers, 2, P, KVH, L, D): the staged keys and values
    logits: Tensor  # (P, V)


class PrefillGraphs:
    """CUDA graphs of the runner's prefill per (prompts, length) bucket (module docstring)."""

    def __init__(self, runner: Qwen2Runner, pad_token_id: int, max_tokens: int = MAX_TOKENS) -> None:
        self.runner, self.pad_token_id, self.max_tokens = runner, pad_token_id, max_tokens
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def bucket(self, num_prompts: int, length: int) -> tuple[int, int] | None:
        """The (prompts, length) bucket of a prefill, or None when it runs eagerly (too large)."""
        p, n = _pow2(num_prompts), max(MIN_LENGTH, _pow2(length))
        if p * n > self.max_tokens or n > self.runner.max_positions:
            return None
        return p, n

    def run(
        self, ids_PL: Tensor, lengths_P: Tensor, cache: KVCache, slots: Tensor, prompt_of_row: Tensor
    ) -> Tensor:
        """``Qwen2Runner.prefill`` through the bucket's graph: logits (P, V), valid until the next run."""
        num_prompts, length = ids_PL.shape
        key = self.bucket(num_prompts, length)
        if key is None:
            raise ValueError(f"a prefill of {num_prompts} x {length} tokens has no graph bucket")
        b = self.buckets.get(key) or self._capture(*key)
        b.ids.fill_(self.pad_token_id)
        b.ids[:num_prompts, :length].copy_(ids_PL)
        b.lengths.fill_(1)
        b.lengths[:num_prompts].copy_(lengths_P)
        b.graph.replay()
        self._scatter(b.kv, cache, slots, prompt_of_row, length)
        return b.logits[:num_prompts]

    @staticmethod
    def _scatter(kv: Tensor, cache: KVCache, slots: Tensor, prompt_of_row: Tensor, length: int) -> None:
        """Every row's prompt keys and values (positions [0, length)) into its slot, all layers; what
        ``attention.write_prefill`` does per layer in the eager prefill."""
        layers = kv.shape[0]
        per_layer = 2 * prompt_of_row.numel() * kv[0, 0, 0, :, :length].numel() * kv.element_size()
        step = max(1, _SCATTER_BYTES // max(per_layer, 1))
        for start in range(0, layers, step):
            sl = slice(start, min(start + step, layers))
            cache.buffer[sl, :, slots, :, :length] = kv[sl, :, prompt_of_row, :, :length]

    def _capture(self, num_prompts: int, length: int) -> _Bucket:
        start = time.perf_counter()
        r = self.runner
        device = r.device
        ids = torch.full((num_prompts, length), self.pad_token_id, dtype=torch.long, device=device)
        lengths = torch.ones(num_prompts, dtype=torch.long, device=device)
        shape = (r.num_layers, 2, num_prompts, r.num_kv_heads, length, r.head_dim)
        kv = torch.empty(shape, dtype=r.dtype, device=device)

        def kv_out(i: int) -> tuple[Tensor, Tensor]:
            return kv[i, 0], kv[i, 1]  # the rotary kernel writes layer i's keys and values here

        side = warmup_stream(device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # Triton compiles and FP8 GEMM choices at this M happen here
            for _ in range(2):
                r.prefill_forward(ids, lengths, kv_out, choose_gemms=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capture(graph, self.pool):
            logits = r.prefill_forward(ids, lengths, kv_out, choose_gemms=True)
        torch.cuda.synchronize()
        bucket = _Bucket(graph, ids, lengths, kv, logits)
        self.buckets[(num_prompts, length)] = bucket
        logger.info(
            "captured the prefill graph of %d prompts x %d tokens: %.2f s",
            num_prompts, length, time.perf_counter() - start,
        )  # fmt: skip
        return bucket
