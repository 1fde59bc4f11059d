"""bench/graph_shapes.py counts the graph shapes the trainer's own micro-batching makes (CPU)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from infir2_rl.trainers.microbatch import bucket_length, micro_batches, row_lengths, shard_rows, take_rows


@pytest.fixture(scope="module")
def graph_shapes() -> Iterator[ModuleType]:
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    try:
        yield importlib.import_module("graph_shapes")
    finally:
        sys.path.remove(str(Path(__file__).parents[1] / "bench"))


def test_sorted_keys_are_the_shapes_of_the_trainers_sorted_micro_batches(graph_shapes: ModuleType) -> None:
    from train_packed import rl_batch

    batch = rl_batch(64, 1000, seed=3)
    lengths = row_lengths(batch)
    budget = 8192
    sorted_batch = take_rows(batch, shard_rows(lengths, 1, sort_by_length=True)[0])
    for rule, bucketed in (("bucket", True), ("longest", False)):  # the group's split where rows are bucketed
        for name, rows in (("sorted", sorted_batch), ("padded", batch)):
            parts = micro_batches(rows, 1, budget, bucketed=bucketed)
            expected = [(p.num_sequences, bucket_length(p.input_ids.shape[1])) for p in parts]
            assert graph_shapes.shape_keys(lengths, budget, name, rule) == expected
    # Like lengths share a micro-batch: fewer distinct shapes than in batch order, and packed rows fewer still.
    distinct = {
        name: len(set(graph_shapes.shape_keys(lengths, budget, name)))
        for name in ("padded", "sorted", "packed")
    }
    assert distinct["packed"] < distinct["sorted"] < distinct["padded"]
    assert distinct["sorted"] <= len(set(graph_shapes.shape_keys(lengths, budget, "sorted", "longest")))
    # Sorted micro-batches: one row count per length bucket (budget // bucket), but for the batch's last one.
    keys = graph_shapes.shape_keys(lengths, budget, "sorted")
    assert all(rows == budget // bucket for rows, bucket in keys[:-1])
    assert keys[-1][0] <= budget // keys[-1][1]
