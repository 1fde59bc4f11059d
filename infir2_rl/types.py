"""The typed boundaries every layer shares: what crosses a process boundary between the stage loops,
trainer backends, rollout engines and the weight-sync service. This module imports nothing else of the
package (tests/test_imports.py checks), so every layer may import it.

Shape legend: B sequences in a micro-batch, L padded sequence length (prompt + response), V vocabulary.
Token-aligned tensors use one convention everywhere: the value at position t belongs to token
`input_ids[:, t]`, predicted from the prefix `input_ids[:, :t]`. Position 0 is never trained.

Weight buckets travel from the trainer to the rollout engines. Pickling FP8 tensors: torch 2.13 pickles a float8 tensor's storage under the legacy typed-storage path
and cannot load it back (``UntypedStorage has no attribute 'dtype'``), so a float8 tensor does not
survive Ray's object store or any ``pickle`` round trip. ``WeightBucket`` and ``TensorMap`` therefore
pickle FP8 tensors as ``uint8`` views of the same bytes plus the dtype name, and view them back on load
(zero-copy both ways; every other tensor pickles as usual).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class HostCounts:
    """A micro-batch's token counts as the host knows them without asking the device: counted from its CPU
    tensors by ``TokenBatch.to``. Losses and the trainer's scoring read these instead of counting device
    tensors (``.item()``, ``nonzero``): each such count made the host wait for the GPU to finish all queued
    work, and the GPU then idled while the host launched the next (docs/performance.md, "The GPU waiting for
    the host")."""

    lengths: tuple[int, ...]  # real tokens of each row (attention_mask > 0: a prefix, rows are right-padded)
    targets: tuple[int, ...]  # each row's trained positions t >= 1 (loss_mask > 0, all on real tokens)

    @classmethod
    def of(cls, attention_mask: Tensor, loss_mask: Tensor) -> HostCounts:
        """Count a CPU batch; a row that is not right-padded, or trains a pad, is refused (ValueError)."""
        real = attention_mask > 0
        lengths = real.sum(1)
        prefix = torch.arange(real.shape[1]) < lengths[:, None]
        if not torch.equal(real, prefix):
            row = int((real != prefix).any(1).nonzero()[0])
            raise ValueError(
                f"TokenBatch row {row}: attention_mask is not right-padded (real tokens, then pads)"
            )
        trained = loss_mask[:, 1:] > 0
        if bool((trained & ~real[:, 1:]).any()):
            row = int((trained & ~real[:, 1:]).any(1).nonzero()[0])
            raise ValueError(f"TokenBatch row {row}: loss_mask selects a pad position (attention_mask 0)")
        return cls(tuple(lengths.tolist()), tuple(trained.sum(1).tolist()))

    @property
    def num_targets(self) -> int:
        return sum(self.targets)

    def rows(self, start: int, stop: int) -> HostCounts:
        return HostCounts(self.lengths[start:stop], self.targets[start:stop])

    def take(self, index: Sequence[int]) -> HostCounts:
        return HostCounts(tuple(self.lengths[i] for i in index), tuple(self.targets[i] for i in index))


@dataclass
class TokenBatch:
    """One micro-batch of token sequences (right-padded) for the trainer."""

    # B x L token ids, right-padded.
    input_ids: Tensor
    # B x L, 1 on real tokens, 0 on padding.
    attention_mask: Tensor
    # B x L float, 1 where token t is trained (SFT: assistant tokens; RL: response tokens).
    loss_mask: Tensor
    # RL: B x L log-prob of token t under the rollout engine's sampling distribution (0 off the mask).
    rollout_logprobs: Tensor | None = None
    # RL: B x L log-prob of token t under the trainer's weights before this step (recomputed).
    old_logprobs: Tensor | None = None
    # RL with algorithm.kl_coef > 0: B x L log-prob of token t under the frozen reference model.
    ref_logprobs: Tensor | None = None
    # RL: B advantages (one per sequence).
    advantages: Tensor | None = None
    # Set by ``to`` from the CPU tensors (None: count on the device when needed).
    counts: HostCounts | None = None

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_targets(self) -> int:
        """Trained positions t >= 1 (loss_mask > 0): the host's count when known, else the device's."""
        if self.counts is not None:
            return self.counts.num_targets
        return int((self.loss_mask[:, 1:] > 0).sum().item())

    def tensors(self) -> dict[str, Tensor | None]:
        """The tensor fields by name (None where unset)."""
        return {name: v for name, v in self.__dict__.items() if name != "counts"}

    def rows(self, start: int, stop: int) -> TokenBatch:
        """Sequences ``start:stop`` (views; per-sequence and per-token fields alike)."""
        return replace(
            self,
            **{name: v[start:stop] for name, v in self.tensors().items() if v is not None},
            counts=self.counts.rows(start, stop) if self.counts is not None else None,
        )

    def to(self, device: torch.device | str) -> TokenBatch:
        """The batch on ``device``; from CPU tensors it also counts them (``counts``) on the way."""
        counts = self.counts
        if counts is None and self.attention_mask.device.type == "cpu":
            counts = HostCounts.of(self.attention_mask, self.loss_mask)
        moved = {name: (v.to(device) if v is not None else None) for name, v in self.tensors().items()}
        return replace(self, **moved, counts=counts)  # type: ignore[arg-type]


@dataclass
class LossOutput:
    """What a loss function returns for one micro-batch."""

    # Mean loss over the micro-batch's units (tokens or sequences); differentiable.
    loss: Tensor
    # How many units the mean is over; the trainer weights micro-batches by it so the gradient is
    # that of the mean over the whole global batch, independent of how it was split.
    num_units: int
    # Detached scalars for logging (metric name -> value), each a mean over `metric_weight` units: floats, or
    # 0-dim tensors left on the device (the trainer brings a step's to the host at once, MetricMeans).
    metrics: dict[str, float | Tensor] = field(default_factory=dict)
    # What the metrics are means over (GRPO's statistics: the micro-batch's response tokens; None: num_units).
    # The trainer's value is sum(value * weight) / sum(weight) over micro-batches and ranks, so it does not
    # depend on how the global batch was split (trainers/microbatch.MetricMeans).
    metric_weight: float | None = None


@dataclass
class TokenScores:
    """Per-token scores of a micro-batch under the trainer's weights, aligned like ``TokenBatch``.

    ``logprobs_BL[b, t]`` is log p(input_ids[b, t] | input_ids[b, :t]) under softmax(logits / temperature),
    float32; ``entropy_BL[b, t]`` the entropy (nats) of that same distribution (None unless the loss asked
    for it). Only positions t >= 1 with ``loss_mask[b, t] > 0`` are computed: every other position holds 0
    (the trainer never forms the full-vocabulary logits, see trainers/token_scores.py).
    """

    logprobs_BL: Tensor
    entropy_BL: Tensor | None = None


class LossFn(Protocol):
    """Turns a micro-batch's per-token scores into a loss. Must be picklable (it is sent to trainer actors).

    The trainer scores at ``temperature`` (the rollout's sampling temperature for RL, 1 for SFT) and adds
    the entropy to the scores only when ``needs_entropy`` is True.
    """

    @property
    def temperature(self) -> float: ...

    @property
    def needs_entropy(self) -> bool: ...

    def __call__(self, scores: TokenScores, batch: TokenBatch) -> LossOutput: ...


@dataclass
class TrainStats:
    """Result of one optimizer step (already reduced over data-parallel ranks)."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    num_tokens: int
    num_sequences: int
    # True when the gradient norm was NaN/inf and the update was skipped.
    skipped: bool
    step_time_s: float
    # Loss-function metrics averaged over the global batch (e.g. "mismatch/k3").
    metrics: dict[str, float] = field(default_factory=dict)
    # ``train_step(keep_logprobs=True)``: B x L float32 (CPU) log-probs of the trained tokens from this step's
    # own forward (the loss's ``TokenScores.logprobs_BL``; 0 off the loss mask), one row per sequence trained,
    # in the order given (a rank: its micro-batches' rows; ``TrainerGroup``: the global batch's). None otherwise.
    logprobs: Tensor | None = None


class TrainerBackend(Protocol):
    """A data-parallel rank of the trainer (torch or megatron)."""

    def forward_logprobs(
        self, batches: Sequence[TokenBatch], temperature: float, fp8: bool = True
    ) -> list[Tensor]:
        """Per-token log-probs (B x L, float32, CPU) of each batch at the given sampling temperature.

        ``fp8=False`` runs an FP8 trainer's linears dense on their master weights (a no-op without FP8).
        """
        ...

    def train_step(
        self, batches: Sequence[TokenBatch], loss_fn: LossFn, total_units: int, keep_logprobs: bool = False
    ) -> TrainStats:
        """Forward/backward over the micro-batches, then one optimizer step.

        total_units: loss units (tokens or sequences) in the global batch over all ranks.
        keep_logprobs: return the training forward's log-probs of the trained tokens (``TrainStats.logprobs``).
        """
        ...

    def export_weights(self, fp8: bool = True) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors; FP8 decoder linears as the exact (weight fp8, weight_scale_inv) they train with
        (``fp8=False``: plain tensors, for BF16 engines)."""
        ...

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path) -> None: ...

    def make_room(self, wanted_bytes: int) -> bool:
        """Before a colocated rollout: free GPU memory until ``wanted_bytes`` are free, as far as this backend
        can without losing state; True when it dropped its CUDA graphs (the next step captures them again)."""
        ...


FinishReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    # Generation ends after any of these tokens (it is kept in the response).
    stop_token_ids: list[int] = field(default_factory=list)
    # Greedy decoding (evaluation); log-probs are then those of the temperature-1 softmax.
    greedy: bool = False


@dataclass
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    # Independent samples of this prompt (the GRPO group).
    n: int
    params: SamplingParams
    # Seed of this request's sampling; the same seed gives the same samples.
    seed: int = 0


@dataclass
class Sample:
    request_id: str
    # Index of this sample within its request's n samples.
    index: int
    prompt_ids: list[int]
    response_ids: list[int]
    # Log-prob of each response token under the sampling distribution (tempered softmax).
    logprobs: list[float]
    finish_reason: FinishReason


@dataclass
class EngineHealth:
    ok: bool
    weight_version: int
    fp8: bool
    device: str
    detail: str = ""


class EngineBackend(Protocol):
    """A rollout engine (native or SGLang)."""

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        """All samples of all requests (n per request), batched together."""
        ...

    def update_weights(self, bucket: WeightBucket) -> None:
        """Load one bucket of weights; a bucket older than the engine's version raises StaleWeightsError."""
        ...

    def read_weights(self, names: Sequence[str]) -> dict[str, Tensor]:
        """CPU copies of the engine's current tensors of those names (tests and tools)."""
        ...

    def weight_digests(self, names: Sequence[str]) -> dict[str, Any]:
        """``weight_sync.digest.Digest`` of each of those tensors, computed where the engine holds them: what
        the post-push self-check compares with the sender's digests."""
        ...

    def abort(self) -> None: ...

    def health(self) -> EngineHealth: ...

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...

    def close(self) -> None:
        """Let go of what the engine holds outside its process (its side of the weight group, a server)."""
        ...


# ---------------------------------------------------------------- weight sync
_FP8_DTYPES = {str(d): d for d in (torch.float8_e4m3fn, torch.float8_e5m2)}


def _pack(t: Tensor) -> tuple[Tensor, str | None]:
    name = str(t.dtype)
    return (t.view(torch.uint8), name) if name in _FP8_DTYPES else (t, None)


def _unpack(t: Tensor, dtype_name: str | None) -> Tensor:
    return t.view(_FP8_DTYPES[dtype_name]) if dtype_name is not None else t


class StaleWeightsError(RuntimeError):
    """An engine was sent weights older than the ones it already holds."""


@dataclass
class WeightBucket:
    """A bounded group of HF-named tensors of one weight version.

    FP8 decoder linears travel as two tensors: `X.weight` (float8_e4m3fn) and `X.weight_scale_inv`
    (float32, one per 128x128 block), the exact bytes the trainer trains with.
    """

    version: int
    # Position of this bucket in the push and the number of buckets in it.
    index: int
    num_buckets: int
    names: list[str]
    tensors: list[Tensor]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def is_last(self) -> bool:
        return self.index == self.num_buckets - 1

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["tensors"] = [_pack(t) for t in self.tensors]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["tensors"] = [_unpack(t, d) for t, d in state["tensors"]]
        self.__dict__.update(state)


def _rebuild_tensor_map(names: list[str], packed: list[tuple[Tensor, str | None]]) -> TensorMap:
    return TensorMap({n: _unpack(t, d) for n, (t, d) in zip(names, packed)})


class TensorMap(dict[str, Tensor]):
    """A ``dict`` of named tensors that survives pickling with FP8 tensors inside (see the module docstring)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_tensor_map, (list(self.keys()), [_pack(t) for t in self.values()]))


class WeightSyncError(RuntimeError):
    """A push failed: an engine did not load it, timed out, or the read-back self-check found different bytes."""


@dataclass
class PushStats:
    """What one weight push did (returned by ``WeightSyncService.push``)."""

    version: int
    # Wall time of the transfer to every engine (all buckets loaded), seconds.
    seconds: float
    # Bytes sent once (each engine receives all of them).
    bytes: int
    num_buckets: int
    num_tensors: int
    # Tensors read back from one engine and compared byte for byte, and the time that took.
    num_checked: int = 0
    check_seconds: float = 0.0
    # Index of the engine the self-check read from (rotates push by push); -1 when none.
    checked_engine: int = -1
