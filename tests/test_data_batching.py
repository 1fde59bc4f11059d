"""SFT collate and token-budget grouping."""

from __future__ import annotations

import pytest
import torch

from infir2_rl.data.batching import batch_by_token_budget, collate_sft
from infir2_rl.data.datasets import SftExample


def test_collate_pads_right_and_aligns_masks() -> None:
    examples = [SftExample([5, 6, 7], [0, 1, 1]), SftExample([8], [1])]
    batch = collate_sft(examples, pad_token_id=0, pad_to_multiple_of=4)
    assert batch.input_ids.tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert batch.input_ids.dtype == torch.long and batch.loss_mask.dtype == torch.float32
    assert batch.num_loss_tokens == 3


def test_collate_rejects_empty() -> None:
    with pytest.raises(ValueError, match="at least one"):
        collate_sft([], pad_token_id=0)


def test_token_budget_groups_respect_padded_size() -> None:
    lengths = [3, 5, 2, 8, 1, 1, 3]
    groups = batch_by_token_budget(lengths, max_tokens=10)
    assert groups == [[0, 1], [2], [3], [4, 5, 6]]
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 10
    assert batch_by_token_budget([1] * 5, max_tokens=100, max_examples=2) == [[0, 1], [2, 3], [4]]


def test_token_budget_counts_the_padded_length_a_group_runs_at() -> None:
    """padded_length: the length a group is padded to when it runs (CUDA-graph buckets); a group still takes
    its first example when that one's padded length alone is over the budget."""
    lengths = [9, 7, 7, 5, 3]
    assert batch_by_token_budget(lengths, max_tokens=19) == [[0, 1], [2, 3], [4]]  # 2 x 9, 2 x 7
    to_even = lambda n: n + n % 2  # noqa: E731
    groups = batch_by_token_budget(lengths, max_tokens=19, padded_length=to_even)
    assert groups == [[0], [1, 2], [3, 4]]  # 2 x 10 > 19; then 2 x 8, 2 x 6
    for g in groups:
        assert len(g) == 1 or len(g) * to_even(max(lengths[i] for i in g)) <= 19
    assert batch_by_token_budget([9, 1], max_tokens=9, padded_length=to_even) == [[0], [1]]


def test_token_budget_rejects_an_example_over_budget() -> None:
    with pytest.raises(ValueError, match="example 1 has 11 tokens > max_tokens=10"):
        batch_by_token_budget([2, 11], max_tokens=10)
