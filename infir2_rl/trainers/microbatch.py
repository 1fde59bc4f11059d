"""Splitting a global TokenBatch into data-parallel shards and micro-batches.

Shapes: G rows in the global batch, L its padded length. A shard is a contiguous block of rows
(rank r of W gets rows [r*G/W, (r+1)*G/W) when W divides G); its micro-batches are contiguous
runs of rows, each trimmed to its own longest row so padding is not computed. Order is kept, so
the split is deterministic and `merge_rows` puts per-row results back in place.

Two micro-batch rules (trainer config): a fixed number of rows (`micro_batch_size`), or a token
budget (`max_tokens_per_gpu`): as many rows as fit with rows x longest row <= budget, or, when the
trainer packs micro-batches (`pack_sequences`: it computes only real tokens), with the sum of the rows'
lengths <= budget.

Sorted shards (`shard_rows(sort_by_length=True)`, `trainer.sort_by_length` with a token budget): the rows
ordered by length, longest first, and dealt to the ranks in turn (rank r takes the r-th, (r+W)-th, ...), so
rows of like length share a micro-batch (little padding) and every rank gets as many long rows as another.
The rows are then not in batch order: `shard_rows` returns each rank's row indices, and `unshuffle_rows`
puts per-row results back in place.

Where the trainer runs padded micro-batches padded to a length bucket (its CUDA graphs, `bucket_length`), the
budget counts the bucket (`bucketed`: rows x `bucket_length(longest)` <= budget), so it bounds the tokens
computed, padding included, and every sorted micro-batch whose longest row falls in one bucket has as many
rows as another: one graph shape per bucket (but for a shard's last micro-batch), where rows x longest gave
a bucket several row counts (bench/graph_shapes.py: 73 shapes against 98 over 50 RL-shaped batches, sorted).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from infir2_rl.data.batching import batch_by_token_budget
from infir2_rl.types import LossOutput, TokenBatch


def row_lengths(batch: TokenBatch) -> list[int]:
    """Real (non-pad) tokens per row; rows are right-padded, so this is the index after the last real token."""
    mask = batch.attention_mask
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.ne(0) * positions).amax(dim=1).tolist()


def select_rows(batch: TokenBatch, start: int, stop: int, lengths: Sequence[int] | None = None) -> TokenBatch:
    """Rows [start, stop) of `batch`, cut to the longest of them (B x L fields) or sliced (B fields)."""
    return take_rows(batch, range(start, stop), lengths)


def take_rows(batch: TokenBatch, index: Sequence[int], lengths: Sequence[int] | None = None) -> TokenBatch:
    """Rows ``index`` of ``batch`` in that order, cut to the longest of them: views for a run of consecutive
    rows (``select_rows``), copies otherwise. ``lengths``: ``row_lengths(batch)`` where the caller has them."""
    index = list(index)
    if lengths is None:
        lengths = row_lengths(batch)
    length = max(max((lengths[i] for i in index), default=1), 1)
    run = bool(index) and index == list(range(index[0], index[-1] + 1))
    rows: slice | Tensor = (
        slice(index[0], index[-1] + 1)
        if run
        else torch.tensor(index, dtype=torch.long, device=batch.input_ids.device)
    )
    fields: dict[str, Tensor | None] = {}
    for name, value in batch.tensors().items():
        if value is None:
            fields[name] = None
        else:
            picked = value[rows]
            fields[name] = picked if value.dim() == 1 else picked[:, :length]
    counts = batch.counts.take(index) if batch.counts is not None else None
    return TokenBatch(**fields, counts=counts)  # type: ignore[arg-type]


def bucket_length(length: int, smallest: int = 64) -> int:
    """The padded length a micro-batch of ``length`` tokens per row gets under ``trainer.cuda_graphs``: the
    next of 64, 72, 80, ..., 128, 144, 160, ..., 256, 288, 320, ... (eight steps per doubling), so micro-batches
    of any length fall into a few shapes, each one captured once, with at most 12.5% padding (~6% on average).

    Eight, not four: an RL stage's micro-batches all end near prompt + max_response_len (the longest of 32
    rows), and the 1.5B RL run (17-token prompts, 256-token responses: rows of ~276) padded every micro-batch to
    320 with four steps, 16% more tokens than eager BF16 computed (docs/performance.md)."""
    if length <= smallest:
        return smallest
    top = 1 << (length - 1).bit_length()  # the power of two >= length
    step = top // 16  # top/2 .. top in eight steps of top/16
    return -(-length // step) * step


def pad_length(batch: TokenBatch, length: int) -> TokenBatch:
    """``batch`` with every B x L field right-padded with zeros to ``length`` (pads: attention and loss mask 0,
    so no loss reads them, and causal attention keeps them out of every real token's output)."""
    extra = length - int(batch.input_ids.shape[1])
    if extra < 0:
        raise ValueError(f"pad_length: the batch has {batch.input_ids.shape[1]} tokens per row > {length}")
    if extra == 0:
        return batch
    fields: dict[str, Tensor | None] = {}
    for name, value in batch.tensors().items():
        fields[name] = (
            value if value is None or value.dim() == 1 else torch.nn.functional.pad(value, (0, extra))
        )
    return TokenBatch(**fields, counts=batch.counts)  # type: ignore[arg-type]  # pads add no token


def shard_bounds(num_rows: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) row ranges, one per rank, sizes differing by at most one."""
    base, extra = divmod(num_rows, world_size)
    bounds, start = [], 0
    for rank in range(world_size):
        stop = start + base + (1 if rank < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def shard_rows(lengths: Sequence[int], world_size: int, sort_by_length: bool = False) -> list[list[int]]:
    """Each rank's row indices: contiguous blocks (``shard_bounds``), or with ``sort_by_length`` the rows by
    length, longest first (ties in batch order), dealt to the ranks in turn (module docstring)."""
    if not sort_by_length:
        return [list(range(start, stop)) for start, stop in shard_bounds(len(lengths), world_size)]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[rank::world_size] for rank in range(world_size)]


def packed_token_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group indices, in order, so each group's summed length <= `max_tokens` (one packed row each)."""
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for index, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(
                f"row {index} has {length} tokens > trainer.max_tokens_per_gpu={max_tokens}: raise the budget "
                "or lower the maximum sequence length"
            )
        if current and total + length > max_tokens:
            groups.append(current)
            current, total = [], 0
        current.append(index)
        total += length
    if current:
        groups.append(current)
    return groups


def micro_batches(
    batch: TokenBatch,
    micro_batch_size: int,
    max_tokens_per_gpu: int | None = None,
    packed: bool = False,
    bucketed: bool = False,
    lengths: Sequence[int] | None = None,
) -> list[TokenBatch]:
    """Split `batch` (one rank's shard) into micro-batches by row count or by token budget (padded rows:
    rows x longest, or with ``bucketed`` rows x ``bucket_length(longest)``, <= budget; module docstring).
    ``lengths``: ``row_lengths(batch)`` where the caller has them."""
    num_rows = batch.num_sequences
    if num_rows == 0:
        return []
    if lengths is None:
        lengths = row_lengths(batch)
    if max_tokens_per_gpu is None:
        groups = [
            list(range(i, min(i + micro_batch_size, num_rows))) for i in range(0, num_rows, micro_batch_size)
        ]
    elif packed:
        groups = packed_token_budget(lengths, max_tokens_per_gpu)
    else:
        pad = bucket_length if bucketed else None
        groups = batch_by_token_budget(lengths, max_tokens_per_gpu, padded_length=pad)
    return [select_rows(batch, g[0], g[-1] + 1, lengths) for g in groups]


def shard_micro_batches(
    batch: TokenBatch,
    world_size: int,
    micro_batch_size: int,
    max_tokens_per_gpu: int | None = None,
    packed: bool = False,
    rows: Sequence[Sequence[int]] | None = None,
    bucketed: bool = False,
) -> list[list[TokenBatch]]:
    """Per rank, its list of micro-batches of the global `batch`: of the rows ``rows[rank]``, in that order
    (default: contiguous blocks, ``shard_bounds``); ``bucketed`` as in ``micro_batches``."""
    if rows is None:
        rows = [list(range(start, stop)) for start, stop in shard_bounds(batch.num_sequences, world_size)]
    lengths = row_lengths(batch)
    return [
        micro_batches(
            take_rows(batch, index, lengths),
            micro_batch_size,
            max_tokens_per_gpu,
            packed,
            bucketed,
            [lengths[i] for i in index],
        )
        if index
        else []
        for index in rows
    ]


def compact(batch: TokenBatch) -> TokenBatch:
    """``batch`` with each tensor that is a view of a larger buffer copied to its own. Micro-batches are views of
    the global batch; pickled for a Ray call, a view carries its whole buffer, so each rank was sent its
    micro-batch count times the global batch (96 MB for 2.6 MB of rows at 128 x 2,048 tokens, 2 ranks)."""
    fields = {
        name: None
        if value is None
        else value.clone()
        if value.untyped_storage().nbytes() > value.numel() * value.element_size()
        else value
        for name, value in batch.tensors().items()
    }
    return TokenBatch(**fields, counts=batch.counts)  # type: ignore[arg-type]


def unshuffle_rows(merged: Tensor, order: Sequence[int]) -> Tensor:
    """Per-row results in batch order: row i of ``merged`` belongs to batch row ``order[i]`` (the ranks' row
    indices of ``shard_rows``, concatenated in rank order)."""
    if list(order) == list(range(len(order))):
        return merged
    out = torch.empty_like(merged)
    out[torch.tensor(list(order), dtype=torch.long)] = merged
    return out


def merge_rows(parts: Sequence[Tensor], length: int) -> Tensor:
    """Stack per-micro-batch B_i x L_i tensors (in row order) into one sum(B_i) x `length`, zero-padded."""
    if not parts:
        return torch.zeros(0, length)
    rows = sum(int(p.shape[0]) for p in parts)
    out = torch.zeros(rows, length, dtype=parts[0].dtype)
    r = 0
    for p in parts:
        out[r : r + p.shape[0], : p.shape[1]] = p
        r += int(p.shape[0])
    return out


def merge_on_host(parts: Sequence[Tensor | None]) -> Tensor:
    """A rank's per-micro-batch B_i x L_i results (on its device; None for FSDP's dummy micro-batches: skipped) as
    one CPU sum(B_i) x max(L_i), rows in the order given (``merge_rows``)."""
    real = [p.cpu() for p in parts if p is not None]
    return merge_rows(real, max((int(p.shape[1]) for p in real), default=1))


class MetricMeans:
    """The loss function's metrics of one train step, averaged over micro-batches and ranks by their weights.

    Each micro-batch's value is a mean over ``LossOutput.metric_weight`` units (``num_units`` when None), so the
    step's value is sum(value * weight) / sum(weight): the mean over all units, however the batch was split.
    A micro-batch with weight 0 (no response token) adds nothing; a metric no unit had is left out.
    """

    def __init__(self) -> None:
        self.sums: dict[str, float | Tensor] = {}
        self.weights: dict[str, float] = {}

    def add(self, out: LossOutput) -> None:
        """Add a micro-batch's metrics; values that are device tensors are summed on the device."""
        weight = float(out.num_units if out.metric_weight is None else out.metric_weight)
        for name, value in out.metrics.items():
            self.weights[name] = self.weights.get(name, 0.0) + weight
            if weight > 0:
                term = (
                    value.detach().double() * weight if isinstance(value, Tensor) else float(value) * weight
                )
                self.sums[name] = self.sums.get(name, 0.0) + term

    def totals(self, names: Sequence[str]) -> list[float]:
        """Weighted sums, then weights, of `names` (in that order): the values to add up over ranks. Sums held
        on the device come to the host together (one wait)."""
        sums = [self.sums.get(n, 0.0) for n in names]
        on_device = [i for i, v in enumerate(sums) if isinstance(v, Tensor)]
        if on_device:
            host = torch.stack([sums[i] for i in on_device]).tolist()  # type: ignore[misc]
            for i, v in zip(on_device, host, strict=True):
                sums[i] = v
        return [float(v) for v in sums] + [self.weights.get(n, 0.0) for n in names]

    @staticmethod
    def means(names: Sequence[str], totals: Sequence[float]) -> dict[str, float]:
        """The metrics from `totals(names)` added up over ranks."""
        sums, weights = totals[: len(names)], totals[len(names) :]
        return {n: s / w for n, s, w in zip(names, sums, weights, strict=True) if w > 0}
