"""The decode step as device-only work, and its CUDA graphs per padded batch size.

Shapes: B rows in the step (a padded batch size), S cache slots, C the longest response the state holds.

``DecodeState`` keeps everything a running sequence needs on the device, indexed by its cache slot (slot
S is scratch): the last token, its position, how many tokens it has generated (= its sampling step), its
sampling parameters and stop ids, the done flag, and the generated tokens and log-probs so far. One
``decode_step(slot_ids)`` reads the rows of those slots, runs the model (``Qwen2Runner.decode``), samples
with each row's own key at its own step (``engines.sampling``: the CPU path's rule), appends token and
log-prob, and sets done on a stop token or at max_new_tokens. Rows already done are redirected to the
scratch slot, so they compute garbage there and change nothing of theirs. No host synchronisation: the
scheduler replays the step several times, then reads the done flags and counts once (``scheduler.py``).

``GraphDecoder`` captures ``decode_step`` once per padded batch size, when that size is first needed
(all graphs share one memory pool), after two eager warm-up runs on a side stream, which compile the Triton
kernels and time the FP8 GEMM candidates (``linears.Fp8GemmChooser``). A colocated engine drops its decoder
at every ``release_memory`` and captures again in the next ``generate``; a capture whose shapes (batch size,
sampler variant, cache and state sizes) the engine's earlier decoders already warmed up on the same thread
skips the warm-ups (``warmed``): the kernels are compiled and the GEMMs chosen, and each eager run costs as
much host time as the capture itself (the FP8 step launches more kernels, so its warm-ups cost more; on an
H200 at 1.5B they were ~28 of FP8's 45 ms of capture, ``bench/rollout_colocated.py --ab``). The thread is in the
key because torch makes a thread's cuBLAS handle on its first GEMM, which must not happen inside a capture
(``bench/thread_capture_check.py``). The graph's only input is the static ``slot_ids`` buffer, rewritten by
the scheduler when the set of running rows changes. Without CUDA (tests on CPU) the same ``decode_step``
runs eagerly.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from torch import Tensor

from infir2_rl.engines.native.kv_cache import KVCache
from infir2_rl.engines.native.model_runner import Qwen2Runner
from infir2_rl.engines.sampling import RowSampling
from infir2_rl.graph_capture import capture, warmup_stream

logger = logging.getLogger(__name__)

# Padded batch sizes with a captured graph (those <= the engine's slot count, plus the slot count).
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeState:
    """Per-slot device state of the running sequences (module docstring)."""

    def __init__(self, num_slots: int, max_response: int, max_stops: int, device: torch.device) -> None:
        n = num_slots + 1
        self.scratch = num_slots
        self.max_response = max_response
        self.last_token = torch.zeros(n, dtype=torch.int64, device=device)
        self.position = torch.zeros(n, dtype=torch.int64, device=device)
        self.num_generated = torch.zeros(n, dtype=torch.int64, device=device)
        self.max_new = torch.ones(n, dtype=torch.int64, device=device)
        self.done = torch.ones(n, dtype=torch.bool, device=device)
        self.temperature = torch.ones(n, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(n, dtype=torch.int64, device=device)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.greedy = torch.zeros(n, dtype=torch.bool, device=device)
        self.keys = torch.zeros(n, dtype=torch.int64, device=device)
        self.stop_ids = torch.full((n, max(max_stops, 1)), -1, dtype=torch.int64, device=device)
        self.tokens = torch.zeros((n, max_response), dtype=torch.int64, device=device)
        self.logprobs = torch.zeros((n, max_response), dtype=torch.float32, device=device)

    def sampling(self, slots: Tensor) -> RowSampling:
        return RowSampling(
            self.temperature[slots],
            self.top_k[slots],
            self.top_p[slots],
            self.greedy[slots],
            self.keys[slots],
        )

    def record(
        self, slots: Tensor, tokens: Tensor, logprobs: Tensor, steps: Tensor, positions: Tensor
    ) -> None:
        """Append each row's sampled token at index ``steps`` and advance its state (all on the device)."""
        column = steps.clamp(max=self.max_response - 1)
        self.tokens[slots, column] = tokens
        self.logprobs[slots, column] = logprobs
        self.last_token[slots] = tokens
        self.position[slots] = positions
        self.num_generated[slots] = steps + 1
        stop = (tokens[:, None] == self.stop_ids[slots]).any(-1) | (steps + 1 >= self.max_new[slots])
        self.done[slots] = stop
        self.done[self.scratch :].fill_(True)


def decode_step(
    runner: Qwen2Runner, cache: KVCache, state: DecodeState, slot_ids: Tensor, truncating: bool
) -> None:
    """One token for every row of ``slot_ids`` (module docstring); device work only."""
    slots = torch.where(state.done[slot_ids], state.scratch, slot_ids)
    positions = state.position[slots]
    logits = runner.decode(state.last_token[slots], positions, slots, cache)
    steps = state.num_generated[slots]
    tokens, logprobs = runner.sample(logits, state.sampling(slots), steps, truncating)
    state.record(slots, tokens, logprobs, steps, (positions + 1).clamp(max=cache.max_len - 1))


def padded_size(num_rows: int, sizes: list[int]) -> int:
    return next(s for s in sizes if s >= num_rows)


class GraphDecoder:
    """Replays ``decode_step`` from CUDA graphs per padded batch size (eager on CPU)."""

    def __init__(
        self,
        runner: Qwen2Runner,
        cache: KVCache,
        state: DecodeState,
        use_graphs: bool,
        warmed: set[tuple[object, ...]] | None = None,
    ) -> None:
        self.runner, self.cache, self.state = runner, cache, state
        self.use_graphs = use_graphs
        # Capture shapes warmed up by this engine before (the scheduler's set, kept across decoders); None:
        # warm up before every capture.
        self.warmed = warmed
        slots = cache.num_slots
        self.sizes = sorted({s for s in GRAPH_BATCH_SIZES if s < slots} | {slots})
        self.slot_input = torch.full((slots,), state.scratch, dtype=torch.int64, device=runner.device)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.capture_s = 0.0
        self.warmups = 0  # eager warm-up runs so far (benchmarks and tests)
        self.batch = 0
        self.padded = 0

    def capture(self, size: int, truncating: bool) -> None:
        """Capture the step at one padded size and sampler variant (on first use; all share one pool)."""
        start = time.perf_counter()
        ids = self.slot_input[:size]
        saved = ids.clone()
        ids.fill_(self.state.scratch)  # warm-up and capture touch only the scratch slot
        # Per thread too: torch keeps a cuBLAS(Lt) handle per thread, made on its first GEMM (not allowed
        # inside a capture), and a threaded Ray actor runs each generate on any of its threads.
        shapes = (threading.get_ident(), size, truncating, tuple(self.cache.buffer.shape),
                  tuple(self.state.tokens.shape), tuple(self.state.stop_ids.shape))  # fmt: skip
        if self.warmed is None or shapes not in self.warmed:
            stream = warmup_stream(self.runner.device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles kernels, picks FP8 GEMMs, settles the allocator
                    decode_step(self.runner, self.cache, self.state, ids, truncating)
            torch.cuda.current_stream().wait_stream(stream)
            self.warmups += 2
        graph = torch.cuda.CUDAGraph()
        with capture(graph, self.pool):
            decode_step(self.runner, self.cache, self.state, ids, truncating)
        ids.copy_(saved)
        self.graphs[(size, truncating)] = graph
        if self.warmed is not None:
            self.warmed.add(shapes)
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - start
        logger.info("captured the decode graph of batch %d (truncating=%s): %.2f s", size, truncating,
                    time.perf_counter() - start)  # fmt: skip

    def set_rows(self, slots: list[int]) -> None:
        """The slots that the next steps decode (called when rows join or leave)."""
        self.batch = len(slots)
        self.padded = padded_size(self.batch, self.sizes)
        ids = torch.full((self.padded,), self.state.scratch, dtype=torch.int64)
        ids[: self.batch] = torch.tensor(slots, dtype=torch.int64)
        self.slot_input[: self.padded].copy_(ids, non_blocking=False)

    def step(self, truncating: bool) -> None:
        if not self.use_graphs:  # the same padded shapes as the graphs, so both compute the same numbers
            decode_step(self.runner, self.cache, self.state, self.slot_input[: self.padded], truncating)
            return
        key = (self.padded, truncating)
        if key not in self.graphs:
            self.capture(self.padded, truncating)
        self.graphs[key].replay()
