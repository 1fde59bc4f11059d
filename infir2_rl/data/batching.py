"""SFT micro-batches: padding collate and grouping under a token budget.

Shapes: B = examples in the micro-batch, T = longest example in it (right padding).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from infir2_rl.data.datasets import SftExample


@dataclass(frozen=True)
class SftBatch:
    """A right-padded SFT micro-batch; all tensors are [B, T]."""

    # Token ids, padded with the tokenizer's pad id (int64).
    input_ids: torch.Tensor
    # 1 for real tokens, 0 for padding (int64, as transformers expects).
    attention_mask: torch.Tensor
    # 1.0 where token t is a training target (assistant token), 0.0 elsewhere and on padding (float32).
    # The loss on logits[:, t-1] predicting input_ids[:, t] is weighted by loss_mask[:, t].
    loss_mask: torch.Tensor

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def collate_sft(examples: Sequence[SftExample], pad_token_id: int, pad_to_multiple_of: int = 1) -> SftBatch:
    """Right-pad `examples` to one length (rounded up to `pad_to_multiple_of`) and stack them."""
    if not examples:
        raise ValueError("examples is empty: a micro-batch needs at least one example")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of}: must be >= 1")
    longest = max(len(e.input_ids) for e in examples)
    length = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), length), dtype=torch.float32)
    for b, example in enumerate(examples):
        n = len(example.input_ids)
        assert len(example.loss_mask) == n, "loss_mask must align with input_ids"
        input_ids[b, :n] = torch.tensor(example.input_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(example.loss_mask, dtype=torch.float32)
    return SftBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)


def batch_by_token_budget(
    lengths: Sequence[int],
    max_tokens: int,
    max_examples: int | None = None,
    padded_length: Callable[[int], int] | None = None,
) -> list[list[int]]:
    """Group indices, in order, so each group's padded size len(group) * padded_length(max length) <= `max_tokens`.

    Greedy and order-preserving (shuffle or sort beforehand if wanted), so the grouping is
    deterministic. `max_examples` optionally caps the examples per group. `padded_length` (default: the
    length itself) is the length a group is padded to when it runs (the trainer's CUDA-graph length buckets,
    ``trainers/microbatch.bucket_length``); a group always takes its first example, even where that one's
    padded length alone is over the budget (its own length never is).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: must be >= 1")
    pad = padded_length or (lambda n: n)
    groups: list[list[int]] = []
    current: list[int] = []
    current_max = 0
    for index, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(
                f"example {index} has {length} tokens > max_tokens={max_tokens}: "
                "raise max_tokens or lower the maximum sequence length"
            )
        new_max = max(current_max, length)
        full = max_examples is not None and len(current) >= max_examples
        if current and (full or (len(current) + 1) * pad(new_max) > max_tokens):
            groups.append(current)
            current, new_max = [], length
        current.append(index)
        current_max = new_max
    if current:
        groups.append(current)
    return groups
