"""Continuous batching over cache slots: rows join as others finish; the n samples of a prompt share its prefill.

The loop (``Scheduler.generate``):
1. Admit: while slots are free and rows wait, take the next request's remaining samples (as many as fit),
   run the prompts of all admitted requests through one prefill (``Qwen2Runner.prefill``, or a CUDA graph
   of it for small prefills, ``prefill_graphs.py``; a prompt's K/V is computed once and copied into each of
   its rows' slots), and sample each row's first token eagerly; repeat (one prefill per ``max_prefill_tokens``
   prompt tokens) until the slots are full or no row waits, so the admitted rows decode together.
   Admission waits until at least 1/8 of the slots are free (or nothing runs), so prefills come in batches.
2. Decode ``k`` steps with no host synchronisation (``GraphDecoder.step``: CUDA-graph replays), where
   ``k = min(sync_every, fewest tokens any running row may still need)``, so a row that runs to its
   max_new_tokens never waits past its end; a row that stops early waits at most ``sync_every - 1`` steps.
3. Sync once: read every running row's done flag and token count; copy the tokens and log-probs of the
   finished rows to the host in one transfer, free their slots, and go to 1.
``abort()`` is seen at the sync: running rows finish "abort" with what they have; rows admitted later
finish "abort" after their first token (as in the eager path).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence

import torch

from infir2_rl.engines.native.cuda_graphs import GRAPH_BATCH_SIZES, DecodeState, GraphDecoder
from infir2_rl.engines.native.kv_cache import KVCache
from infir2_rl.engines.native.model_runner import Qwen2Runner
from infir2_rl.engines.native.prefill_graphs import PrefillGraphs
from infir2_rl.engines.sampling import RowSampling, row_key, sample_tokens
from infir2_rl.types import FinishReason, GenerateRequest, Sample

logger = logging.getLogger(__name__)

KV_MEMORY_FRACTION = (
    0.8  # of the GPU memory free at allocation time, for the KV cache (the rest: graphs, activations)
)
_LEN_QUANTUM = 256  # cache length is rounded up to this, so similar calls reuse the cache and graphs


class Scheduler:
    """Owns the KV cache, the decode state and the graphs of one engine; see the module docstring."""

    def __init__(
        self,
        runner: Qwen2Runner,
        num_slots: int,
        use_graphs: bool,
        pad_token_id: int,
        sync_every: int = 16,
        max_prefill_tokens: int = 16384,
    ) -> None:
        self.runner, self.max_slots, self.use_graphs = runner, num_slots, use_graphs
        # Slots of the current allocation: the rows of the call that made it (rounded up to a graph batch
        # size), at most max_slots, fewer when their KV cache would not fit in free GPU memory (``_ensure``).
        self.num_slots = num_slots
        self._slots_capped = False  # the current allocation got fewer slots than it wanted (memory)
        # (slots wanted, cache length) of the last call: what ``memory_wanted`` and ``slots_short`` report.
        self._last_ask: tuple[int, int] | None = None
        self.pad_token_id, self.sync_every, self.max_prefill_tokens = (
            pad_token_id,
            sync_every,
            max_prefill_tokens,
        )
        self.cache: KVCache | None = None
        self.state: DecodeState | None = None
        self.decoder: GraphDecoder | None = None
        # Small prefills from CUDA graphs (prefill_graphs.py; under true_on_policy graphs of its walk); off on
        # CPU; kept across a colocated release unless keep_prefill_graphs is off (``release``).
        self.prefill_graphs: PrefillGraphs | None = (
            PrefillGraphs(runner, pad_token_id) if use_graphs else None
        )
        self.keep_prefill_graphs = True  # across a colocated release (``release``)
        # Decode-graph shapes warmed up by an earlier decoder: a colocated engine's next capture skips the
        # warm-ups (cuda_graphs.py). None: warm up before every capture.
        self.warmed: set[tuple[object, ...]] | None = set()
        self.num_decode_steps = 0
        self._capture_s_before = 0.0  # capture seconds of the decoders already released
        # Work tally (benchmarks split a workload's time with it): prefill calls, their prompt tokens and
        # padded tokens, and decode steps per padded batch size.
        self.tally: Counter[str] = Counter()
        self.steps_by_size: Counter[int] = Counter()

    # ---- memory ---------------------------------------------------------------------------------
    def _ensure(self, max_len: int, max_response: int, max_stops: int, rows: int) -> None:
        """Allocate (or grow) cache, state and graphs for these sizes; keeps them when they already fit.

        Slots follow the call's rows, not max_batch_size: 64 rows of 16K tokens get a 29 GiB cache, where
        max_batch_size=256 slots took 80% of the free memory (99 GiB on an H200) for the same work. A later
        call with more rows grows it, unless the current one was already cut short by memory."""
        wanted = self._slots_wanted(rows)
        length = -(-max_len // _LEN_QUANTUM) * _LEN_QUANTUM
        length = min(length, self.runner.max_positions) if max_len <= self.runner.max_positions else max_len
        self._last_ask = (wanted, length)
        if (
            self.cache is not None
            and self.state is not None
            and self.cache.max_len >= max_len
            and self.state.max_response >= max_response
            and self.state.stop_ids.shape[1] >= max_stops
            and (self.num_slots >= wanted or self._slots_capped)
        ):
            return
        self.release()
        self.num_slots = self._slots_that_fit(length, wanted)
        self._slots_capped = self.num_slots < wanted
        self.cache = self.runner.new_cache(self.num_slots, length)
        self.state = DecodeState(self.num_slots, max_response, max_stops, self.runner.device)
        self.decoder = GraphDecoder(self.runner, self.cache, self.state, self.use_graphs, self.warmed)

    def prepare(self, requests: Sequence[GenerateRequest]) -> float:
        """Allocate for ``requests`` and capture the graph of every padded batch size now (else each is
        captured on first use); returns the capture seconds (benchmarks keep it out of timed calls)."""
        self._ensure(*self._sizes(requests))
        assert self.decoder is not None
        if self.decoder.use_graphs:
            for size in self.decoder.sizes:
                if (size, False) not in self.decoder.graphs:
                    self.decoder.capture(size, False)
        return self.decoder.capture_s

    @staticmethod
    def _sizes(requests: Sequence[GenerateRequest]) -> tuple[int, int, int, int]:
        return (
            max(len(r.prompt_ids) + r.params.max_new_tokens for r in requests),
            max(r.params.max_new_tokens for r in requests),
            max(len(r.params.stop_token_ids) for r in requests),
            sum(r.n for r in requests),
        )

    def _slots_wanted(self, rows: int) -> int:
        """Slots for a call of ``rows`` rows: the smallest graph batch size >= rows (so that calls of similar
        size share one allocation and its graphs), at most ``max_slots``."""
        size = next((s for s in GRAPH_BATCH_SIZES if s >= rows), rows)
        return min(size, self.max_slots)

    def _slots_that_fit(self, length: int, wanted: int) -> int:
        """``wanted``, or fewer when their KV cache would take more than KV_MEMORY_FRACTION of the free GPU
        memory (long responses, or a colocated trainer): fewer rows then decode at once, loudly logged."""
        if self.runner.device.type != "cuda":
            return wanted
        free, _ = torch.cuda.mem_get_info(self.runner.device)
        per_slot = self._slot_bytes(length)
        fit = int(KV_MEMORY_FRACTION * free) // per_slot - 1  # minus the scratch slot
        if fit < 1:
            raise RuntimeError(
                f"the KV cache of one sequence of {length} positions ({per_slot / 2**30:.2f} GiB) does not fit in "
                f"{KV_MEMORY_FRACTION:.0%} of the free GPU memory ({free / 2**30:.1f} GiB): lower max_new_tokens"
            )
        if fit < wanted:
            logger.warning(
                "native engine: KV cache for %d rows of %d positions needs %.1f GiB, %.0f%% of free GPU memory "
                "is %.1f GiB: decoding %d rows at a time instead of %d",
                wanted, length, wanted * per_slot / 2**30, 100 * KV_MEMORY_FRACTION,
                KV_MEMORY_FRACTION * free / 2**30, fit, wanted,
            )  # fmt: skip
        return min(fit, wanted)

    def _slot_bytes(self, length: int) -> int:
        """KV-cache bytes of one slot of ``length`` positions (K and V of every layer)."""
        r = self.runner
        return 2 * r.num_layers * r.num_kv_heads * length * r.head_dim * torch.finfo(r.dtype).bits // 8

    def memory_wanted(self) -> int | None:
        """Free GPU bytes the last call's KV cache wanted (its slots and the scratch slot, over
        KV_MEMORY_FRACTION, as ``_slots_that_fit`` admits them): a colocated trainer makes that much room before
        the next rollout when it can (``TorchTrainer.make_room``). None before the first call."""
        if self._last_ask is None:
            return None
        slots, length = self._last_ask
        return int((slots + 1) * self._slot_bytes(length) / KV_MEMORY_FRACTION) + 1

    def slots_short(self) -> int | None:
        """Slots the last call wanted and the cache did not hold (memory): its rows beyond the cache's slots took
        turns instead of decoding at once. 0 when all fit; None before the first call."""
        if self._last_ask is None:
            return None
        return max(0, self._last_ask[0] - self.num_slots)

    def release(self, colocated: bool = False) -> None:
        """Drop the KV cache, decode state and decode graphs (weights stay where they are). ``colocated``
        (the engine gives the GPU to a trainer): the prefill graphs stay unless ``keep_prefill_graphs`` is
        off, then they go for good (prefill_graphs.py)."""
        if self.decoder is not None:
            self._capture_s_before += self.decoder.capture_s
        self.cache = self.state = self.decoder = None
        if colocated and self.prefill_graphs is not None and not self.keep_prefill_graphs:
            logger.info("native engine: prefill graphs off (keep_prefill_graphs=False): prefills run eagerly")
            self.prefill_graphs = None
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()

    def capture_seconds(self) -> float:
        """Seconds spent capturing decode graphs (with their warm-ups) over this scheduler's life."""
        return self._capture_s_before + (self.decoder.capture_s if self.decoder is not None else 0.0)

    # ---- the loop -------------------------------------------------------------------------------
    def generate(
        self, requests: Sequence[GenerateRequest], abort: threading.Event, on_steps: Callable[[int], None]
    ) -> list[Sample]:
        """All samples of ``requests`` in request order then sample index."""
        self._ensure(*self._sizes(requests))
        assert self.state is not None and self.decoder is not None
        state, decoder = self.state, self.decoder
        vocab = self.runner.vocab_size
        truncating = any(0 < r.params.top_k < vocab or r.params.top_p < 1.0 for r in requests)
        pending = deque((pos, r, list(range(r.n))) for pos, r in enumerate(requests))
        free = list(range(self.num_slots - 1, -1, -1))
        active: dict[int, tuple[int, GenerateRequest, int]] = {}  # slot -> (request position, request, index)
        generated: dict[int, int] = {}  # slot -> tokens generated, as of the last sync
        results: dict[tuple[int, int], Sample] = {}
        running: list[int] = []
        while pending or active:
            # Admit until the slots are full or too few are free: several prefills back to back when the
            # waiting prompts exceed one prefill's token budget, so that all of them decode together (with
            # one prefill per loop, 256 prompts of 128 tokens decoded 16 steps at batch 128 first).
            while pending and free and (not active or len(free) >= self._admit_threshold(pending)):
                generated.update({s: 1 for s in self._admit(pending, free, active, state)})
            self._collect(active, generated, free, results, abort.is_set())
            if not active:
                continue
            if sorted(active) != running:
                running = sorted(active)
                decoder.set_rows(running)
            need = min(active[s][1].params.max_new_tokens - generated[s] for s in active)
            steps = max(1, min(self.sync_every, need))
            for _ in range(steps):
                decoder.step(truncating)
            self.num_decode_steps += steps
            self.steps_by_size[decoder.padded] += steps
            on_steps(steps)
        return [results[(pos, i)] for pos, r in enumerate(requests) for i in range(r.n)]

    def _admit_threshold(self, pending: deque[tuple[int, GenerateRequest, list[int]]]) -> int:
        """Free slots needed to admit while rows run: 1/8 of the slots (so prefills come in batches), or
        every waiting row when fewer wait."""
        waiting = sum(len(idx) for _, _, idx in pending)
        return min(waiting, max(1, self.num_slots // 8))

    def _admit(
        self,
        pending: deque[tuple[int, GenerateRequest, list[int]]],
        free: list[int],
        active: dict[int, tuple[int, GenerateRequest, int]],
        state: DecodeState,
    ) -> list[int]:
        """Take waiting rows into free slots, prefill their prompts (shared per request), sample token 1."""
        groups: list[tuple[GenerateRequest, list[int], list[int]]] = []
        positions: list[int] = []
        tokens = 0
        while pending and free:
            position, request, indices = pending[0]
            if groups and tokens + len(request.prompt_ids) > self.max_prefill_tokens:
                break
            take = indices[: len(free)]
            slots = [free.pop() for _ in take]
            groups.append((request, take, slots))
            positions.append(position)
            tokens += len(request.prompt_ids)
            del indices[: len(take)]
            if not indices:
                pending.popleft()
        device = self.runner.device
        lengths = [len(r.prompt_ids) for r, _, _ in groups]
        ids = torch.full((len(groups), max(lengths)), self.pad_token_id, dtype=torch.long)
        for p, (r, _, _) in enumerate(groups):
            ids[p, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids, dtype=torch.long)
        rows = [(r, i, s) for r, take, slots in groups for i, s in zip(take, slots)]
        row_positions = [pos for pos, (_, take, _) in zip(positions, groups) for _ in take]
        prompt_of_row = torch.tensor(
            [p for p, (_, take, _) in enumerate(groups) for _ in take], device=device
        )
        slots_t = torch.tensor([s for _, _, s in rows], device=device)
        lengths_t = torch.tensor(lengths, device=device)
        assert self.cache is not None
        self.tally.update(prefills=1, prompts=len(groups), prompt_tokens=sum(lengths),
                          padded_tokens=len(groups) * max(lengths), rows=len(rows))  # fmt: skip
        graphs = self.prefill_graphs
        if graphs is not None and graphs.bucket(len(groups), max(lengths)) is not None:
            self.tally.update(graph_prefills=1)
            logits = graphs.run(ids.to(device), lengths_t, self.cache, slots_t, prompt_of_row)
        else:
            logits = self.runner.prefill(ids.to(device), lengths_t, self.cache, slots_t, prompt_of_row)
        params = [r.params for r, _, _ in rows]
        sampling = RowSampling.build(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            greedy=[p.greedy for p in params],
            keys=[row_key(r.seed, i) for r, i, _ in rows],
            vocab_size=self.runner.vocab_size,
            device=device,
        )
        for name in ("temperature", "top_k", "top_p", "keys"):
            getattr(state, name)[slots_t] = getattr(sampling, f"{name}_B")
        state.greedy[slots_t] = sampling.greedy_B
        state.max_new[slots_t] = torch.tensor([p.max_new_tokens for p in params], device=device)
        stops = torch.full((len(rows), state.stop_ids.shape[1]), -1, dtype=torch.long)
        for b, row_params in enumerate(params):
            stops[b, : len(row_params.stop_token_ids)] = torch.tensor(
                row_params.stop_token_ids, dtype=torch.long
            )
        state.stop_ids[slots_t] = stops.to(device)
        if self.runner.true_on_policy:  # the log-prob by the sampler kernels the trainer's scoring shares
            truncating = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
            steps0 = torch.zeros(len(rows), dtype=torch.long, device=device)
            first, logprobs = self.runner.sample(logits[prompt_of_row], sampling, steps0, truncating)
        else:
            first, logprobs = sample_tokens(logits[prompt_of_row], sampling, 0)
        zeros = torch.zeros_like(slots_t)
        state.record(slots_t, first, logprobs, zeros, lengths_t[prompt_of_row])
        for pos, (r, i, s) in zip(row_positions, rows):
            active[s] = (pos, r, i)
        return [s for _, _, s in rows]

    def _collect(
        self,
        active: dict[int, tuple[int, GenerateRequest, int]],
        generated: dict[int, int],
        free: list[int],
        results: dict[tuple[int, int], Sample],
        aborting: bool,
    ) -> None:
        """Sync: finished rows (all running rows when aborting) become Samples and free their slots."""
        assert self.state is not None
        state = self.state
        if not active:
            return
        slots = sorted(active)
        slots_t = torch.tensor(slots, device=state.tokens.device)
        done, counts = torch.stack([state.done[slots_t].long(), state.num_generated[slots_t]]).tolist()
        generated.update(zip(slots, counts))
        finished = [(s, c) for s, d, c in zip(slots, done, counts) if d or aborting]
        if not finished:
            return
        longest = max(c for _, c in finished)
        rows_t = torch.tensor([s for s, _ in finished], device=state.tokens.device)
        tokens = state.tokens[rows_t, :longest].tolist()
        logprobs = state.logprobs[rows_t, :longest].tolist()
        for (slot, count), toks, lps in zip(finished, tokens, logprobs):
            position, request, index = active.pop(slot)
            generated.pop(slot, None)
            reason: FinishReason
            if count > 0 and toks[count - 1] in request.params.stop_token_ids:
                reason = "stop"
            elif count >= request.params.max_new_tokens:
                reason = "length"
            else:
                reason = "abort"
            results[(position, index)] = Sample(
                request_id=request.request_id,
                index=index,
                prompt_ids=list(request.prompt_ids),
                response_ids=toks[:count],
                logprobs=lps[:count],
                finish_reason=reason,
            )
            free.append(slot)
