"""Small prefills replayed from CUDA graphs (``engines/native/prefill_graphs.py``). GPU only.

A graph replay gives the eager prefill's logits and KV-cache contents bit for bit at the bucket's shape (the
same kernels and FP8 GEMM choices), writes each row's prompt K/V into its own slot, survives a new KV cache,
sees in-place weight updates, and stays across a colocated engine's release (dropped for good there only when
``Scheduler.keep_prefill_graphs`` is off)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infir2_rl.engines.native import attention
from infir2_rl.engines.native.engine import NativeEngine
from infir2_rl.models.factory import init_model
from infir2_rl.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Head dim 128 and 128-aligned projections: FP8 GEMMs on the fast path, as at 1.5B.
    return init_model(
        tmp_path_factory.mktemp("prefill") / "model", "100m",
        num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=3,
    )  # fmt: skip


def _inputs(runner, pad: int, lengths: list[int], rows_per_prompt: int, cache):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(len(lengths))
    ids = torch.full((len(lengths), max(lengths)), pad, dtype=torch.long)
    for p, n in enumerate(lengths):
        ids[p, :n] = torch.randint(10, runner.vocab_size, (n,), generator=g)
    num_rows = rows_per_prompt * len(lengths)
    slots = torch.randperm(cache.num_slots, generator=g)[:num_rows].cuda()
    prompt_of_row = torch.arange(len(lengths)).repeat_interleave(rows_per_prompt).cuda()
    return ids.cuda(), torch.tensor(lengths).cuda(), slots, prompt_of_row


@pytest.mark.parametrize("fp8", [False, True])
def test_graph_prefill_equals_the_eager_prefill_at_the_bucket_shape(model_dir: Path, fp8: bool) -> None:
    engine = NativeEngine(str(model_dir), fp8=fp8, device="cuda", max_batch_size=8)
    sched = engine._scheduler
    runner, graphs, pad = sched.runner, sched.prefill_graphs, sched.pad_token_id
    assert graphs is not None
    cache = runner.new_cache(8, 256)
    lengths = [37, 50, 61]  # bucket: 4 prompts x 64 positions
    ids, lengths_t, slots, prompt_of_row = _inputs(runner, pad, lengths, 2, cache)
    assert graphs.bucket(3, max(lengths)) == (4, 64)
    got = graphs.run(ids, lengths_t, cache, slots, prompt_of_row).clone()
    assert len(graphs.buckets) == 1

    # The eager forward over the same padded inputs, with the same FP8 GEMM choices, K/V into a second cache.
    padded = torch.full((4, 64), pad, dtype=torch.long, device="cuda")
    padded[:3, : max(lengths)] = ids
    padded_len = torch.tensor([*lengths, 1], device="cuda")
    ref_cache = runner.new_cache(8, 256)

    k_st, v_st = (torch.empty(4, runner.num_kv_heads, 64, runner.head_dim, dtype=runner.dtype, device="cuda")
                  for _ in range(2))  # fmt: skip

    def kv_written(i: int) -> None:
        attention.write_prefill(ref_cache.k[i], ref_cache.v[i], slots, prompt_of_row, k_st[:3, :, : max(lengths)],
                                v_st[:3, :, : max(lengths)])  # fmt: skip

    expected = runner.prefill_forward(padded, padded_len, lambda i: (k_st, v_st), kv_written, True)[:3]
    assert torch.equal(got, expected)
    n = max(lengths)
    assert torch.equal(cache.buffer[:, :, slots, :, :n], ref_cache.buffer[:, :, slots, :, :n])
    assert cache.buffer[:, :, slots, :, :n].abs().sum() > 0
    others = torch.ones(cache.num_slots + 1, dtype=torch.bool, device="cuda")
    others[slots] = False
    assert cache.buffer[:, :, others].abs().sum() == 0  # no other slot was written

    # Against the plain eager prefill (cuBLASLt, unpadded): the same logits up to the GEMMs' rounding.
    plain_cache = runner.new_cache(8, 256)
    plain = runner.prefill(ids, lengths_t, plain_cache, slots, prompt_of_row)
    torch.testing.assert_close(got.float(), plain.float(), rtol=0.05, atol=0.05)


def test_graph_prefill_survives_a_new_cache_and_sees_weight_updates(model_dir: Path) -> None:
    engine = NativeEngine(str(model_dir), fp8=True, device="cuda", max_batch_size=8)
    sched = engine._scheduler
    runner, graphs = sched.runner, sched.prefill_graphs
    assert graphs is not None
    first = runner.new_cache(8, 256)
    ids, lengths_t, slots, prompt_of_row = _inputs(runner, sched.pad_token_id, [20, 33], 3, first)
    before = graphs.run(ids, lengths_t, first, slots, prompt_of_row).clone()
    with torch.no_grad():
        runner.final_norm.mul_(1.5)  # in place, as weight sync writes
    second = runner.new_cache(8, 256)  # another KV cache, as after release / resume
    after = graphs.run(ids, lengths_t, second, slots, prompt_of_row).clone()
    assert len(graphs.buckets) == 1  # the same graph replayed
    assert not torch.equal(before, after)
    n = 33
    assert torch.equal(first.buffer[:, :, slots, :, :n], second.buffer[:, :, slots, :, :n])  # layers' K/V


def test_engine_keeps_its_prefill_graphs_across_a_colocated_release(model_dir: Path) -> None:
    engine = NativeEngine(str(model_dir), fp8=True, device="cuda", max_batch_size=8)
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    reqs = [
        GenerateRequest(f"r{i}", list(range(5, 20 + 7 * i)), n=2, params=params, seed=i) for i in range(3)
    ]
    first = engine.generate(reqs)
    sched = engine._scheduler
    graphs = sched.prefill_graphs
    assert sched.tally["graph_prefills"] >= 1 and graphs is not None and graphs.buckets
    assert engine.generate(reqs) == first  # replays give the same samples
    replays = sched.tally["graph_prefills"]
    engine.release_memory()
    engine.resume_memory()
    assert sched.prefill_graphs is graphs  # kept: no eager prefill in the next RL step
    assert engine.generate(reqs) == first
    assert sched.tally["graph_prefills"] > replays
    sched.keep_prefill_graphs = False  # the pre-session-41 rule: dropped at a colocated release, for good
    engine.release_memory()
    engine.resume_memory()
    assert sched.prefill_graphs is None
    again = engine.generate(reqs)
    assert [len(s.response_ids) for s in again] == [6] * 6
