"""A micro-batch's counts known on the host (``TokenBatch.counts``): what the losses and the trainer's scoring
read instead of counting device tensors, each count of which made the host wait for the GPU."""

import pytest
import torch

from infir2_rl.algo.config import AlgorithmConfig
from infir2_rl.algo.loss_fns import GrpoLoss
from infir2_rl.stages.sft_eval import SftLossFn
from infir2_rl.trainers.microbatch import MetricMeans, pad_length, select_rows
from infir2_rl.trainers.torch.varlen_attention import varlen_kwargs
from infir2_rl.types import HostCounts, TokenBatch, TokenScores


def _batch() -> TokenBatch:
    """Three right-padded rows of 5, 2 and 4 tokens; responses after a two-token prompt."""
    lengths = [5, 2, 4]
    attention = torch.zeros(3, 5, dtype=torch.long)
    for row, n in enumerate(lengths):
        attention[row, :n] = 1
    loss_mask = attention.float()
    loss_mask[:, :2] = 0
    logp = -torch.rand(3, 5, generator=torch.Generator().manual_seed(0)) * loss_mask
    return TokenBatch(
        input_ids=torch.arange(15).view(3, 5) * attention,
        attention_mask=attention,
        loss_mask=loss_mask,
        rollout_logprobs=logp - 0.01 * loss_mask,
        old_logprobs=logp.clone(),
        advantages=torch.tensor([1.0, -0.5, 0.25]),
    )


def test_to_counts_the_cpu_batch_and_slices_keep_the_counts_right() -> None:
    batch = _batch()
    assert batch.counts is None
    moved = batch.to("cpu")
    assert moved.counts == HostCounts(lengths=(5, 2, 4), targets=(3, 0, 2))
    assert moved.num_targets == 5 == int((batch.loss_mask[:, 1:] > 0).sum())
    assert moved.rows(1, 3).counts == HostCounts((2, 4), (0, 2))
    picked = select_rows(moved, 1, 3)  # cut to the longest of its rows
    assert picked.counts == HostCounts((2, 4), (0, 2)) and picked.input_ids.shape == (2, 4)
    assert pad_length(moved, 8).counts == moved.counts  # pads add no token
    assert moved.to("cpu").counts is moved.counts  # counted once


def test_a_batch_that_is_not_right_padded_or_trains_a_pad_is_refused() -> None:
    batch = _batch()
    left = batch.attention_mask.flip(1)  # row 0 is full: row 1 is the first left-padded one
    with pytest.raises(ValueError, match="row 1: attention_mask is not right-padded"):
        TokenBatch(batch.input_ids, left, torch.zeros(3, 5)).to("cpu")
    trains_pad = batch.loss_mask.clone()
    trains_pad[1, 3] = 1.0
    with pytest.raises(ValueError, match="row 1: loss_mask selects a pad position"):
        TokenBatch(batch.input_ids, batch.attention_mask, trains_pad).to("cpu")


def _scores(batch: TokenBatch) -> TokenScores:
    logp = batch.old_logprobs + 0.02 * batch.loss_mask  # ratio exp(0.02) on response tokens
    return TokenScores(logprobs_BL=logp.requires_grad_())


@pytest.mark.parametrize("reduction", ["token_mean", "sample_token_mean"])
def test_losses_read_the_hosts_counts_and_give_the_same_results(reduction: str) -> None:
    """With counts (a trainer batch) GRPO's statistics stay tensors until the step adds them up, and every
    number equals the path that counts on the device."""
    loss_fn = GrpoLoss(AlgorithmConfig(loss_reduction=reduction, tis=True), temperature=1.0)  # type: ignore[arg-type]
    plain, counted = _batch(), _batch().to("cpu")
    a, b = loss_fn(_scores(plain), plain), loss_fn(_scores(counted), counted)
    assert a.num_units == b.num_units == (5 if reduction == "token_mean" else 3)
    assert a.metric_weight == b.metric_weight == 5
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=0)
    assert a.metrics.keys() == b.metrics.keys()
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in b.metrics.values())
    means = []
    for out in (a, b):
        metrics = MetricMeans()
        metrics.add(out)
        metrics.add(out)
        names = sorted(out.metrics)
        means.append(MetricMeans.means(names, metrics.totals(names)))
    assert means[0] == pytest.approx(means[1], rel=1e-12)
    assert all(isinstance(v, float) for v in means[1].values())

    sft_a, sft_b = SftLossFn()(_scores(plain), plain), SftLossFn()(_scores(counted), counted)
    assert sft_a.num_units == sft_b.num_units == 5
    torch.testing.assert_close(sft_a.loss, sft_b.loss, rtol=0, atol=0)


def test_varlen_offsets_from_host_lengths_equal_those_from_a_tensor() -> None:
    for padded_to in (None, 32, 4096):
        lengths = [9, 4, 7] if padded_to != 4096 else [300] * 10
        from_tensor = varlen_kwargs(torch.tensor(lengths), padded_to=padded_to)
        from_host = varlen_kwargs(lengths, padded_to=padded_to, device=torch.device("cpu"))
        assert from_tensor.keys() == from_host.keys()
        for key, value in from_tensor.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, from_host[key]), key
            else:
                assert value == from_host[key], key
    with pytest.raises(ValueError, match="need the device"):
        varlen_kwargs([3, 4])
